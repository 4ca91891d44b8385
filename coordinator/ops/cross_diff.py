"""Window diffs across jobs: ``RUN:WINDOW`` against ``RUN:WINDOW``, each run live or recorded.

A side is ``WINDOW`` (the source's current run), or ``RUN:WINDOW`` where ``RUN`` is a record's
path or URL, a run's directory, or a run's name: a run the live coordinator keeps, else a
record under ``save_path`` (the coordinator's, or ``$RAY_PROFILER_SAVE_PATH``). Each side's
table is its source's ``kernel_summary`` of every kernel; the diff is ``kernel_diff`` of the two,
the same function the coordinator's own ``kernel_diff`` answers with.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from coordinator.core.window_diff import kernel_diff
from coordinator.protocol.replies import KernelDiffReply, KernelSummaryReply

ALL_KERNELS = 100_000
_SIDE = re.compile(r"^(?:(?P<run>.+):)?(?P<window>-?\d+)$")

Call = Callable[..., Any]
"""``call(method, *args, **kwargs)`` on a coordinator, live or recorded."""


@dataclass(frozen=True)
class Side:
    """One side of a diff: its run (None: the source's current run) and window."""

    run: str | None
    window: int


def parse_side(text: str) -> Side:
    """``"3"`` or ``"RUN:3"`` (``RUN`` may hold colons: ``s3://b/x:3``); ValueError else."""
    m = _SIDE.match(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"a diff side is WINDOW or RUN:WINDOW, got {text!r:.200}")
    window = int(m["window"])
    if window < 0:
        raise ValueError(f"a window's index is >= 0, got {window}")
    return Side(m["run"] or None, window)


def side_table(
    side: Side, live: Call | None, save_path: str | None, opener: Callable[[str], Call]
) -> KernelSummaryReply:
    """``side``'s table of every kernel: from ``live`` (a coordinator, or None) when it keeps
    the run, else from the record the run names (``opener(url)`` gives its calls)."""
    from coordinator.ops.recorded import locate

    if live is not None and (side.run is None or _kept(live, side.run)):
        table: KernelSummaryReply = live("kernel_summary", side.window, ALL_KERNELS, None,
                                         False, side.run)  # fmt: skip
        return table
    if side.run is None:
        raise ValueError("a side without a run needs a coordinator or --from")
    recorded = opener(locate(side.run, save_path))
    found: KernelSummaryReply = recorded("kernel_summary", side.window, ALL_KERNELS)
    return found


def _kept(live: Call, run: str) -> bool:
    """Whether the live coordinator keeps run ``run`` (current or earlier)."""
    st = live("status")
    return run in {st["run"]["name"], *(p["run"]["name"] for p in st["previous_runs"])}


def diff_tables(a: KernelSummaryReply, b: KernelSummaryReply, top_k: int) -> KernelDiffReply:
    """``kernel_diff(a, b)``, refused as the coordinator refuses a window with no summary."""
    for name, s in (("a", a), ("b", b)):
        if not s["ranks"]:
            raise ValueError(f"window {s['window']} ({name}) has no summary to compare yet")
    return kernel_diff(a, b, top_k)


def diff_across(
    a: str,
    b: str,
    top_k: int = 30,
    live: Call | None = None,
    save_path: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> KernelDiffReply:
    """Window ``b`` against window ``a``, each ``WINDOW`` or ``RUN:WINDOW`` (see the module
    docstring); ``live`` answers for the runs a coordinator keeps."""
    from coordinator.ops.recorded import RecordedCoordinator, call, open_record

    def opener(url: str) -> Call:
        h = RecordedCoordinator(open_record(url, storage_options))
        return lambda method, *args, **kw: call(h, method, *args, **kw)

    sa = side_table(parse_side(a), live, save_path, opener)
    sb = side_table(parse_side(b), live, save_path, opener)
    return diff_tables(sa, sb, top_k)
