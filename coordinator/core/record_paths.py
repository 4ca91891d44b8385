"""Where a record's traces may be read: under the record's own run directory, nowhere else.

A record names each rank's trace by path, and whoever can write ``save_path`` can write that
path (``~/.aws/credentials``, ``../../.ssh/id_rsa``). So a path a record names is never read as
it stands: its part below the run's directory (the one the record was written in, or the one
it is read from now: a record copied elsewhere goes on working) is found under the directory
the record is read from, the parent of its ``record/``. A path below neither, or with an empty,
``.`` or ``..`` component, names no trace. Pure: strings only (``collect`` checks the links of
a local file when it opens it).
"""

from __future__ import annotations

import os

from coordinator.core.storage import is_remote, local_path

BAD_PARTS = ("", ".", "..")


def run_dir_of(record_url: str) -> str:
    """The run directory of the record directory ``record_url`` (``.../run/record``)."""
    url = record_url if is_remote(record_url) else os.path.abspath(local_path(record_url))
    head, sep, _ = url.rstrip("/").rpartition("/")
    if not sep or not head or head.endswith((":/", ":")):
        raise ValueError(f"a record directory has a run directory above it: {record_url!r}")
    return head


def _plain(path: str) -> str:
    """A local path without ``file://``, a URL as it is; no trailing ``/``."""
    return (path if is_remote(path) else local_path(path)).rstrip("/")


def below(path: str, base: str) -> list[str] | None:
    """``path``'s components below ``base`` (both a local path or both a URL), or None when it
    is not below it or a component is empty, ``.`` or ``..``."""
    p, b = _plain(path), _plain(base)
    if not b or is_remote(p) != is_remote(b) or not p.startswith(b + "/"):
        return None
    parts = p[len(b) + 1 :].split("/")
    return None if any(x in BAD_PARTS for x in parts) else parts


def in_run(path: str, run_dir: str, recorded_run_dir: str | None) -> str | None:
    """Where the trace a record names as ``path`` is read: ``run_dir`` (the directory the
    record is read from) joined with ``path``'s part below ``run_dir`` or below
    ``recorded_run_dir`` (the one the record says it was written in); None when it is below
    neither (see the module docstring)."""
    parts = below(path, run_dir)
    if parts is None and recorded_run_dir:
        parts = below(path, recorded_run_dir)
    if parts is None:
        return None
    return "/".join([_plain(run_dir), *parts])
