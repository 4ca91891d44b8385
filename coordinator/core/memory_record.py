"""A run's memory as its record holds it (``memory.msgpack``): what ``memory()`` showed last,
each rank's series included, so that ``memory --from``, ``status --from`` and ``serve --from``
answer after the cluster is gone. Pure: no Ray, no torch, no I/O.

The file is bounded however long the run and however many its ranks: each rank's series is
the live one (``RankMemory.series``: bucketed, at most ``SERIES_POINTS``), thinned further so
that all ranks together keep at most ``MAX_POINTS`` (peaks kept); the last ``MAX_SNAPSHOTS``
snapshots' notes and ``MAX_BANDS`` windows; every text cut to ``MAX_TEXT``. Its fields are
checked on read as every record file's are (``record_fields``): every float finite and
non-negative, every time within ``MAX_SECONDS``. A file holding more than ``MAX_RANKS`` ranks
or ``MAX_POINTS`` points is refused before it is decoded (``memory_counts`` reads them from
the msgpack headers): the record is data anyone who can write ``save_path`` made.

>>> reply = empty_reply("job")
>>> f = memory_file(reply, version=1, now=5.0)
>>> memory_reply(f, series=True, trainer_id=None) == reply
True
"""

from __future__ import annotations

from typing import Annotated, Literal, TypedDict

import msgspec

from coordinator.core.memory import SERIES_POINTS, Key, thin
from coordinator.core.msgpack_head import array_length
from coordinator.core.record_fields import Name, Node, Path, Rank, RunName, Text
from coordinator.core.validate import MAX_TEXT
from coordinator.protocol.memory_replies import (
    Growth,
    MemoryRankEntry,
    MemoryReply,
    MemoryState,
    MemoryStatusEntry,
    SnapshotEntry,
)

MAX_POINTS = 500_000
"""The (t, rss) points of all ranks' series together in one file (about 10 MB)."""
MIN_POINTS = 16
"""The fewest points a rank's series keeps however many its ranks."""
MAX_RANKS = MAX_POINTS // MIN_POINTS
"""The most ranks one file holds (31,250: three times the 10,000-rank scale target); with
``MIN_POINTS`` each they keep within ``MAX_POINTS`` together."""
MAX_SNAPSHOTS = 256
MAX_BANDS = 256
MAX_NODES = 4096
"""The most nodes (a 10,000-rank run of 8 GPUs a node has 1,250)."""
MAX_SECONDS = 1e11
"""The latest time (epoch seconds, about the year 5000) and the longest span a file holds."""
MAX_RATE = 1e18
"""The steepest growth a file holds, in bytes a minute (an exabyte)."""
Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)]
"""A time or a span: finite, non-negative (NaN and 1e300 are refused: a table prints it)."""
Rate = Annotated[float, msgspec.Meta(ge=0, le=MAX_RATE)]
Count = Annotated[int, msgspec.Meta(ge=0)]
Bytes = Count | None
Pid = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
Series = Annotated[list[tuple[Seconds, Count]], msgspec.Meta(max_length=SERIES_POINTS)]


class GrowthFile(TypedDict):
    """``memory_replies.Growth`` as a record holds it."""

    bytes_per_min: Rate
    since: Seconds
    span_s: Seconds
    time_left_s: Seconds | None


class RankMemoryFile(TypedDict):
    """``memory_replies.MemoryRankEntry`` as a record holds it: the same keys, each checked."""

    trainer_id: Name
    role: Name
    rank: Rank
    node_id: Node | None
    pid: Pid | None
    state: MemoryState
    reason: Text | None
    rss_bytes: Bytes
    uss_bytes: Bytes
    gpu_bytes: Bytes
    peak_rss_bytes: Bytes
    peak_gpu_bytes: Bytes
    growth: GrowthFile | None
    culprit: bool
    samples: Count
    last_at: Seconds | None
    series: Series | None


class SnapshotFile(TypedDict):
    """``memory_replies.SnapshotEntry`` as a record holds it."""

    trainer_id: Name
    rank: Rank
    on: Literal["window", "oom", "demand"]
    path: Path | None
    error: Text | None
    at: Seconds


class NodeMemoryFile(TypedDict):
    """``memory_replies.NodeMemory`` as a record holds it."""

    total_bytes: Count
    available_bytes: Count
    at: Seconds
    source: Literal["host", "cgroup"]


class MemoryFile(msgspec.Struct, tag="memory", tag_field="kind"):
    """``memory()`` of the run as the coordinator last made it (``MemoryReply``), bounded;
    replaced whole each time it is written."""

    version: int
    run: RunName
    written_at: Seconds
    sample_s: Seconds
    leak_span_s: Seconds
    leak_min_bytes_per_min: Rate
    leak_fast_span_s: Seconds
    leak_fast_min_bytes_per_min: Rate
    taken_at: Seconds
    ranks: Annotated[list[RankMemoryFile], msgspec.Meta(max_length=MAX_RANKS)]
    culprits: Annotated[list[Text], msgspec.Meta(max_length=MAX_RANKS)]
    windows: Annotated[list[tuple[Count, Seconds, Seconds]], msgspec.Meta(max_length=MAX_BANDS)]
    gpu: Annotated[dict[Node, Text], msgspec.Meta(max_length=MAX_NODES)]
    agent_cpu_s: Annotated[dict[Node, Seconds], msgspec.Meta(max_length=MAX_NODES)]
    snapshots: Annotated[list[SnapshotFile], msgspec.Meta(max_length=MAX_SNAPSHOTS)]
    nodes: Annotated[dict[Node, NodeMemoryFile], msgspec.Meta(max_length=MAX_NODES)]


class _Ranks(msgspec.Struct):
    """A memory file's ranks, left undecoded (``msgspec.Raw``: a slice of the file)."""

    ranks: msgspec.Raw = msgspec.Raw(b"\x90")


class _Series(msgspec.Struct):
    """A rank's series, left undecoded (its other fields are skipped, nothing made of them)."""

    series: msgspec.Raw = msgspec.Raw(b"\xc0")


_RANKS = msgspec.msgpack.Decoder(_Ranks)
_SERIES = msgspec.msgpack.Decoder(list[_Series])


def oversized(blob: bytes) -> str | None:
    """Why a memory file's bytes hold more than a file may (``MAX_RANKS`` ranks,
    ``MAX_POINTS`` points in all), counted from the msgpack headers alone before anything is
    decoded; None when they do not. msgspec's errors pass (the full decode names them)."""
    ranks = _RANKS.decode(blob).ranks
    count = array_length(ranks)
    if count > MAX_RANKS:
        return f"{count} ranks, over the {MAX_RANKS} read"
    points = sum(array_length(r.series) for r in _SERIES.decode(ranks)) if count else 0
    if points > MAX_POINTS:
        return f"{points} points in its ranks' series, over the {MAX_POINTS} read"
    return None


def empty_reply(run: str) -> MemoryReply:
    """A ``memory()`` of no rank (sampling off)."""
    return {
        "run": run, "sample_s": 0.0, "leak_span_s": 0.0, "leak_min_bytes_per_min": 0.0,
        "leak_fast_span_s": 0.0, "leak_fast_min_bytes_per_min": 0.0, "taken_at": 0.0,
        "ranks": [], "culprits": [], "windows": [], "gpu": {}, "agent_cpu_s": {},
        "snapshots": [], "nodes": {},
    }  # fmt: skip


def memory_file(reply: MemoryReply, version: int, now: float) -> MemoryFile:
    """The record's file of ``reply`` (``memory(series=True)``), bounded (module docstring)."""
    ranks = reply["ranks"]
    per_rank = _per_rank(min(len(ranks), MAX_RANKS))
    return MemoryFile(
        version=version,
        run=reply["run"],
        written_at=now,
        sample_s=reply["sample_s"],
        leak_span_s=reply["leak_span_s"],
        leak_min_bytes_per_min=reply["leak_min_bytes_per_min"],
        leak_fast_span_s=reply["leak_fast_span_s"],
        leak_fast_min_bytes_per_min=reply["leak_fast_min_bytes_per_min"],
        taken_at=reply["taken_at"],
        ranks=[_rank_file(r, per_rank) for r in ranks[:MAX_RANKS]],
        culprits=[c[:MAX_TEXT] for c in reply["culprits"][:MAX_RANKS]],
        windows=[(int(i), a, b) for i, a, b in reply["windows"][-MAX_BANDS:]],
        gpu={n: why[:MAX_TEXT] for n, why in list(reply["gpu"].items())[:MAX_NODES]},
        agent_cpu_s=dict(list(reply["agent_cpu_s"].items())[:MAX_NODES]),
        snapshots=[_snapshot_file(s) for s in reply["snapshots"][-MAX_SNAPSHOTS:]],
        nodes={n: {**m} for n, m in list(reply["nodes"].items())[:MAX_NODES]},
    )


def _per_rank(ranks: int) -> int:
    """The points each of ``ranks`` ranks keeps: all of them within ``MAX_POINTS``."""
    return min(SERIES_POINTS, max(MIN_POINTS, MAX_POINTS // max(1, ranks)))


def _rank_file(r: MemoryRankEntry, points: int) -> RankMemoryFile:
    series = r["series"]
    return {
        **r,
        "reason": r["reason"][:MAX_TEXT] if r["reason"] else r["reason"],
        "growth": _growth_file(r["growth"]) if r["growth"] else None,
        "series": thin([(t, v) for t, v in series], points) if series is not None else None,
    }


def _growth_file(g: Growth) -> GrowthFile:
    """``g`` within what a reader takes (a node of unbounded memory, a cgroup's ``max``, gives
    a time left past ``MAX_SECONDS``: said as that)."""
    left = g["time_left_s"]
    return {
        "bytes_per_min": min(g["bytes_per_min"], MAX_RATE),
        "since": g["since"],
        "span_s": g["span_s"],
        "time_left_s": min(left, MAX_SECONDS) if left is not None else None,
    }


def _snapshot_file(s: SnapshotEntry) -> SnapshotFile:
    return {**s, "error": s["error"][:MAX_TEXT] if s["error"] else s["error"]}


def memory_reply(f: MemoryFile, series: bool, trainer_id: str | None) -> MemoryReply:
    """``memory(series, trainer_id)`` of a record: as the coordinator last answered it."""
    ranks: list[MemoryRankEntry] = [
        {**r, "series": r["series"] if series else None}
        for r in f.ranks
        if trainer_id is None or r["trainer_id"] == trainer_id
    ]
    return {
        "run": f.run, "sample_s": f.sample_s, "leak_span_s": f.leak_span_s,
        "leak_min_bytes_per_min": f.leak_min_bytes_per_min,
        "leak_fast_span_s": f.leak_fast_span_s,
        "leak_fast_min_bytes_per_min": f.leak_fast_min_bytes_per_min, "taken_at": f.taken_at,
        "ranks": ranks, "culprits": list(f.culprits), "windows": list(f.windows),
        "gpu": dict(f.gpu), "agent_cpu_s": dict(f.agent_cpu_s),
        "snapshots": [{**s} for s in f.snapshots],
        "nodes": {n: {**m} for n, m in f.nodes.items()},
    }  # fmt: skip


def memory_status(f: MemoryFile) -> MemoryStatusEntry:
    """``status()["memory"]`` of a record: the marks and culprits it holds."""
    return {
        "sample_s": f.sample_s,
        "sampled_ranks": sum(1 for r in f.ranks if r["state"] == "sampled"),
        "lost_ranks": sum(1 for r in f.ranks if r["state"] == "lost"),
        "marked": [
            {
                "trainer_id": r["trainer_id"],
                "rank": r["rank"],
                "culprit": r["culprit"],
                "bytes_per_min": g["bytes_per_min"],
                "since": g["since"],
                "span_s": g["span_s"],
                "time_left_s": g["time_left_s"],
            }
            for r in f.ranks
            if (g := r["growth"]) is not None
        ],
        "culprits": list(f.culprits),
        "snapshots": [{**s} for s in f.snapshots[-8:]],
    }


def merged(old: MemoryFile, new: MemoryFile) -> MemoryFile:
    """``new`` after ``old`` (a run going on from its record with a new coordinator, whose
    samples start afresh): each rank's older points and peaks kept before its new ones, the
    ranks, snapshots and windows only ``old`` holds kept; bounded as ``memory_file``."""
    before: dict[Key, RankMemoryFile] = {(r["trainer_id"], r["rank"]): r for r in old.ranks}
    ranks = []
    for r in new.ranks:
        was = before.pop((r["trainer_id"], r["rank"]), None)
        ranks.append(r if was is None else _joined(was, r))
    ranks = [*before.values(), *ranks][-MAX_RANKS:]
    per_rank = _per_rank(len(ranks))
    bands = {w[0]: w for w in [*old.windows, *new.windows]}
    return msgspec.structs.replace(
        new,
        ranks=[
            {**r, "series": thin(r["series"], per_rank) if r["series"] else r["series"]}
            for r in ranks
        ],  # fmt: skip
        snapshots=[*old.snapshots, *new.snapshots][-MAX_SNAPSHOTS:],
        windows=[bands[i] for i in sorted(bands)][-MAX_BANDS:],
    )


def _joined(was: RankMemoryFile, now: RankMemoryFile) -> RankMemoryFile:
    """One rank's older file entry, then its newer one."""
    first = now["series"][0][0] if now["series"] else float("inf")
    older = [p for p in was["series"] or [] if p[0] < first]
    return {
        **now,
        "peak_rss_bytes": _most(was["peak_rss_bytes"], now["peak_rss_bytes"]),
        "peak_gpu_bytes": _most(was["peak_gpu_bytes"], now["peak_gpu_bytes"]),
        "samples": was["samples"] + now["samples"],
        "series": [*older, *(now["series"] or [])] if older or now["series"] else None,
    }


def _most(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)
