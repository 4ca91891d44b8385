"""A window's ranks merged into one Chrome trace, for Perfetto: every rank a process, on one
clock (``coordinator/core/timeline.py`` says how, and what is left out).

``merge_window`` collects the window's traces from the nodes that wrote them (as ``collect``
does), then reads them one rank at a time and writes the merged file as it goes: memory is one
rank's trace, whatever the window's size. It runs in the process that asks (the CLI, the web
view's server), never in the coordinator.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import IO, Any, TypedDict

import msgspec

from coordinator.core.storage import filesystem
from coordinator.core.timeline import (
    DEFAULT_MAX_EVENTS,
    RankCount,
    RankLabel,
    origin_us,
    rank_process,
    step_spread,
)

TOTAL_EVENTS = 6_400_000
"""Without ``max_events``, a rank keeps at most this many over the window's ranks (and at most
``DEFAULT_MAX_EVENTS``): 64 ranks of 100,000 events, about 200 MB gzipped at most."""
MIN_PER_RANK = 1_000
_CHUNK = 2_000


class TooManyRanks(ValueError):
    """More ranks than the caller's ``max_ranks``; the message says both."""


class TimelineResult(TypedDict):
    """What ``merge_window`` (or ``write_timeline``) wrote."""

    run: str | None
    window: int | None
    out: str
    bytes: int
    events: int  # in the merged file, names of processes and tracks included
    ranks: list[RankCount]  # each rank's process: what was kept and left out
    missing: dict[str, str]  # "role rank" -> why its trace is not in the file
    step_start_spread_us: dict[int, float]  # each step's start spread over the ranks


def merge_window(
    coordinator: Any,
    window: int,
    out: str,
    *,
    run: str | None = None,
    roles: list[str] | None = None,
    ranks: list[int] | None = None,
    min_us: float = 0.0,
    max_events: int | None = None,
    wait_s: float = 60.0,
    storage_options: dict[str, Any] | None = None,
    keep: str | None = None,
    max_ranks: int | None = None,
) -> TimelineResult:
    """Merge every rank's trace of ``window`` (of ``roles``: every role by default; of
    ``ranks``: all by default) into one Chrome trace at ``out`` (``.gz``: gzipped; a local path
    or an fsspec URL).

    Args:
        min_us: leave out events shorter than this (steps always stay).
        max_events: keep at most this many events per rank, the longest; by default
            ``TOTAL_EVENTS`` over the ranks, at most ``DEFAULT_MAX_EVENTS``.
        keep: also keep the collected per-rank traces in this directory (one subdirectory per
            role when there are several); by default they are removed once merged.
        max_ranks: refuse (``TooManyRanks``) a merge of more ranks than this.

    Returns:
        A ``TimelineResult``: ``out``, ``bytes``, ``events``, each rank's process (``ranks``:
        what was kept and left out), ``missing`` ("role rank" -> why), and each step's start
        spread over the ranks (``step_start_spread_us``).

    Raises:
        ValueError: as ``collect_window`` (an unknown run or window, a run without traces, a
            role or rank the window does not have), or no trace to merge at all.

    Example::

        res = merge_window(connect(address="auto"), 3, "window3.json.gz", min_us=5)
        # then open window3.json.gz in Perfetto: one process per rank
    """
    from coordinator.ops.collect import _window_entry

    entry, run_name, _ = _window_entry(coordinator, window, run, wait_s)
    parts = _parts(entry, roles, ranks, max_ranks)
    with contextlib.ExitStack() as stack:
        base = keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="ray-profiler-"))
        sources, missing = _collected(
            coordinator, window, run_name, parts, base, keep is None or len(parts) > 1,
            ranks=ranks, wait_s=wait_s, storage_options=storage_options,
        )  # fmt: skip
        if not sources:
            why = "; ".join(f"rank {r}: {w}" for r, w in sorted(missing.items()))
            raise ValueError(f"window {window} of run {run_name}: no trace to merge ({why})")
        res = write_timeline(
            sources, out, min_us=min_us, max_events=max_events, storage_options=storage_options
        )
    res["run"], res["window"], res["missing"] = run_name, window, missing
    return res


def _parts(
    entry: dict[str, Any], roles: list[str] | None, ranks: list[int] | None, most: int | None
) -> list[dict[str, Any]]:
    """The window's parts (roles) to merge; ValueError for a role it does not have,
    ``TooManyRanks`` for more than ``most`` ranks."""
    window = entry["index"]
    parts = list(entry.get("roles", {}).values()) or [dict(entry, role="")]
    have = [p["role"] for p in parts]
    if roles:
        unknown = sorted(set(roles) - set(have))
        if unknown:
            raise ValueError(f"window {window} has no role {unknown[0]!r}: its roles are {have}")
        parts = [p for p in parts if p["role"] in roles]
    count = sum(len(ranks if ranks is not None else p["ranks"]) for p in parts)
    if most is not None and count > most:
        raise TooManyRanks(
            f"window {window} has {count} ranks to merge; at most {most} here: "
            f"ask for some (ranks=), or run ray-profiler collect --merge"
        )
    return parts


def _collected(
    coordinator: Any,
    window: int,
    run: str,
    parts: list[dict[str, Any]],
    base: str,
    by_role: bool,
    **kw: Any,
) -> tuple[list[tuple[RankLabel, str]], dict[str, str]]:
    """Each part's (role's) traces collected under ``base`` (a directory per role when
    ``by_role``): (who, file) per rank, and "role rank" -> why for those missing."""
    from coordinator.ops.collect import collect_window

    nodes = _node_names()
    missing: dict[str, str] = {}
    sources: list[tuple[RankLabel, str]] = []
    for part in parts:
        role = part["role"]
        dest = os.path.join(base, role) if by_role else base
        got = collect_window(coordinator, window, dest, run=run, role=role or None, **kw)
        missing.update({f"{role} {r}".strip(): why for r, why in got["missing"].items()})
        traces = {int(r): t for r, t in part["traces"].items()}
        for rank, path in sorted(got["files"].items()):
            node = (traces.get(rank) or {}).get("node") or ""
            label = RankLabel(rank=rank, role=role, node=nodes.get(node, node[:8] or "?"))
            sources.append((label, path))
    return sources, missing


def write_timeline(
    sources: Iterable[tuple[RankLabel, str]],
    out: str,
    *,
    min_us: float = 0.0,
    max_events: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> TimelineResult:
    """Merge per-rank Chrome traces (each a local path or URL, ``.gz`` or not) into ``out``,
    reading one at a time; each rank's process numbered in the order given, from 1.

    Args:
        sources: (who, path) per rank, in the order their processes are numbered.
        min_us, max_events: as ``merge_window``.

    Returns:
        A ``TimelineResult`` (``run``, ``window`` None and ``missing`` empty: the caller's).

    Raises:
        ValueError: no source, a file that is not a Chrome trace, a negative ``min_us`` or a
            ``max_events`` under 1.

    Example::

        write_timeline([({"rank": 0, "role": "policy", "node": "n1"}, "w3/rank0.pt.trace.json"),
                        ({"rank": 1, "role": "policy", "node": "n2"}, "w3/rank1.pt.trace.json")],
                       "w3.json.gz")
    """
    sources = list(sources)
    if not sources:
        raise ValueError("no trace to merge")
    max_events = _per_rank(max_events, len(sources))
    if min_us < 0 or max_events < 1:
        raise ValueError(f"min_us must be >= 0 and max_events >= 1 (got {min_us}, {max_events})")
    with _open_out(out, storage_options) as f:
        events, counts, starts, origin = _write_ranks(
            f, sources, min_us, max_events, storage_options
        )
        spread = step_spread(starts)
        f.write(b"]," + json.dumps(_tail(counts, min_us, max_events, spread, origin))[1:].encode())
    size = _size(out, storage_options)
    return TimelineResult(run=None, window=None, out=out, bytes=size, events=events,
                          ranks=counts, missing={}, step_start_spread_us=spread)  # fmt: skip


def _write_ranks(
    f: IO[bytes] | gzip.GzipFile,
    sources: list[tuple[RankLabel, str]],
    min_us: float,
    max_events: int,
    options: dict[str, Any] | None,
) -> tuple[int, list[RankCount], list[dict[int, float]], float | None]:
    """Write the events array's head and every rank's events, one rank read at a time: the
    events written, each rank's count and step starts, and the merged clock's origin."""
    counts: list[RankCount] = []
    starts: list[dict[int, float]] = []
    origin: float | None = None
    events = 0
    f.write(b'{"traceEvents":[')
    for pid, (label, path) in enumerate(sources, start=1):
        trace = _load(path, options)
        if origin is None:
            origin = origin_us(trace)
        merged, count, steps = rank_process(
            trace, label, pid=pid, origin=origin, min_us=min_us, max_events=max_events
        )
        del trace
        for i in range(0, len(merged), _CHUNK):
            chunk = msgspec.json.encode(merged[i : i + _CHUNK])[1:-1]
            f.write(b"," + chunk if events or i else chunk)
        events += len(merged)
        counts.append(count)
        starts.append(steps)
    return events, counts, starts, origin


def _tail(
    counts: list[RankCount],
    min_us: float,
    max_events: int,
    spread: dict[int, float],
    origin: float | None,
) -> dict[str, Any]:
    """The merged file's keys after its events: its clock, and what it holds of each rank."""
    about = {
        "ranks": counts,
        "min_us": min_us,
        "max_events_per_rank": max_events,
        "step_start_spread_us": {str(k): v for k, v in spread.items()},
        "clock": "each rank's wall clock (Kineto's ts + baseTimeNanoseconds); ranks on two "
        "nodes agree as well as the nodes' clocks do",
    }
    return {
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": int((origin or 0.0) * 1000),
        "rayProfiler": about,
    }


def _per_rank(max_events: int | None, ranks: int) -> int:
    """Events kept per rank: as asked, else ``TOTAL_EVENTS`` shared over the ranks."""
    if max_events is not None:
        return max_events
    return min(DEFAULT_MAX_EVENTS, max(MIN_PER_RANK, TOTAL_EVENTS // max(ranks, 1)))


def _load(path: str, options: dict[str, Any] | None) -> dict[str, Any]:
    fs, p = filesystem(path, options or {})
    with fs.open(p, "rb") as raw:
        data = raw.read()
    if path.endswith(".gz"):
        data = gzip.decompress(data)
    trace = msgspec.json.decode(data)
    if not isinstance(trace, dict):
        raise ValueError(f"{path} is not a Chrome trace (a JSON object)")
    return trace


@contextlib.contextmanager
def _open_out(out: str, options: dict[str, Any] | None) -> Iterator[IO[bytes] | gzip.GzipFile]:
    fs, p = filesystem(out, options or {})
    parent = os.path.dirname(p)
    if parent:
        with contextlib.suppress(Exception):
            fs.makedirs(parent, exist_ok=True)
    with fs.open(p, "wb") as raw:
        if out.endswith(".gz"):
            with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6) as gz:
                yield gz
        else:
            yield raw


def _size(out: str, options: dict[str, Any] | None) -> int:
    fs, p = filesystem(out, options or {})
    try:
        return int(fs.size(p))
    except Exception:
        return -1


def _node_names() -> dict[str, str]:
    """Ray node id -> its address, for the process names; with the node id's start where two
    nodes share an address (several raylets on one host)."""
    try:
        import ray

        nodes = {n["NodeID"]: n.get("NodeManagerAddress") or "" for n in ray.nodes()}
    except Exception:
        return {}
    shared = Counter(nodes.values())
    return {
        node: f"{addr}/{node[:6]}" if not addr or shared[addr] > 1 else addr
        for node, addr in nodes.items()
    }
