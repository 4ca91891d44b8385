"""Where traces go: ``{save_path}/{run_name}/window_{k:04d}_steps_{first}-{last}/rank{r}.<ext>``
(``window_{k:04d}_auto_steps_...`` for an auto capture)."""

from __future__ import annotations

import os
import time

from coordinator.core.storage import is_remote, join

WINDOW_DIR = "window_{index:04d}_steps_{first}-{last}"
AUTO_WINDOW_DIR = (
    "window_{index:04d}_auto_steps_{first}-{last}"  # slow steps, profiled by themselves
)
TRACE_FILE = {
    "chrome_trace": "rank{rank}.pt.trace.json",
    "chrome_trace_gz": "rank{rank}.pt.trace.json.gz",
    "stacks": "rank{rank}.stacks.txt",
}


def default_run_name(now: float | None = None) -> str:
    """``run_YYYYmmdd-HHMMSS`` in UTC."""
    return time.strftime("run_%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))


def run_dir(save_path: str, run_name: str) -> str:
    """The run directory, refusing a run name that leaves ``save_path``."""
    return contained(save_path, run_name)


def window_dir(
    run_directory: str, index: int, first: int, last: int, kind: str = "scheduled"
) -> str:
    """The directory of one window (an auto capture's says ``auto``); all its numbers are ints,
    so it cannot escape."""
    layout = AUTO_WINDOW_DIR if kind == "auto" else WINDOW_DIR
    return contained(
        run_directory, layout.format(index=int(index), first=int(first), last=int(last))
    )


def trace_path(window_directory: str, rank: int, export_type: str) -> str:
    """The file one rank writes for one window."""
    return contained(window_directory, TRACE_FILE[export_type].format(rank=int(rank)))


def child(base: str, name: str) -> str:
    """``base/name`` for a local directory (see ``contained``) or a URL (``s3://...``)."""
    if is_remote(base):
        return join(base, name)
    return contained(base, name)


def contained(base: str, name: str) -> str:
    """``base/name``, or ValueError if the result is not strictly inside ``base``."""
    if not name or os.sep in name or (os.altsep and os.altsep in name) or name in (".", ".."):
        raise ValueError(f"path component {name!r} is not a single file name")
    root = os.path.realpath(base)
    path = os.path.realpath(os.path.join(root, name))
    if os.path.dirname(path) != root:
        raise ValueError(f"path {name!r} escapes {base!r}")
    return path
