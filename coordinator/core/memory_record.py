"""A run's memory as its record holds it (``memory.msgpack``): what ``memory()`` showed last,
each rank's series included, so that ``memory --from``, ``status --from`` and ``serve --from``
answer after the cluster is gone. Pure: no Ray, no torch, no I/O.

The file is bounded however long the run and however many its ranks: each rank's series is
the live one (``RankMemory.series``: bucketed, at most ``SERIES_POINTS``), thinned further so
that all ranks together keep at most ``MAX_POINTS`` (peaks kept); the last ``MAX_SNAPSHOTS``
snapshots' notes and ``MAX_BANDS`` windows; every text cut to ``MAX_TEXT``. Its fields are
checked on read as every record file's are (``record_fields``).

>>> reply = empty_reply("job")
>>> f = memory_file(reply, version=1, now=5.0)
>>> memory_reply(f, series=True, trainer_id=None) == reply
True
"""

from __future__ import annotations

from typing import Annotated, Literal, TypedDict

import msgspec

from coordinator.core.memory import SERIES_POINTS, Key, thin
from coordinator.core.record_fields import MAX_KEYS, Name, Node, Path, Rank, RunName, Text
from coordinator.core.validate import MAX_TEXT
from coordinator.protocol.memory_replies import (
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
MAX_SNAPSHOTS = 256
MAX_BANDS = 256
MAX_NODES = 1 << 16
Bytes = Annotated[int, msgspec.Meta(ge=0)] | None
Series = Annotated[list[tuple[float, int]], msgspec.Meta(max_length=SERIES_POINTS)]


class GrowthFile(TypedDict):
    """``memory_replies.Growth`` as a record holds it."""

    bytes_per_min: float
    since: float
    span_s: float
    time_left_s: float | None


class RankMemoryFile(TypedDict):
    """``memory_replies.MemoryRankEntry`` as a record holds it: the same keys, each checked."""

    trainer_id: Name
    role: Name
    rank: Rank
    node_id: Node | None
    pid: int | None
    state: MemoryState
    reason: Text | None
    rss_bytes: Bytes
    uss_bytes: Bytes
    gpu_bytes: Bytes
    peak_rss_bytes: Bytes
    peak_gpu_bytes: Bytes
    growth: GrowthFile | None
    culprit: bool
    samples: int
    last_at: float | None
    series: Series | None


class SnapshotFile(TypedDict):
    """``memory_replies.SnapshotEntry`` as a record holds it."""

    trainer_id: Name
    rank: Rank
    on: Literal["window", "oom", "demand"]
    path: Path | None
    error: Text | None
    at: float


class NodeMemoryFile(TypedDict):
    """``memory_replies.NodeMemory`` as a record holds it."""

    total_bytes: int
    available_bytes: int
    at: float
    source: Literal["host", "cgroup"]


class MemoryFile(msgspec.Struct, tag="memory", tag_field="kind"):
    """``memory()`` of the run as the coordinator last made it (``MemoryReply``), bounded;
    replaced whole each time it is written."""

    version: int
    run: RunName
    written_at: float
    sample_s: float
    leak_span_s: float
    leak_min_bytes_per_min: float
    leak_fast_span_s: float
    leak_fast_min_bytes_per_min: float
    taken_at: float
    ranks: Annotated[list[RankMemoryFile], msgspec.Meta(max_length=MAX_KEYS)]
    culprits: Annotated[list[Text], msgspec.Meta(max_length=MAX_KEYS)]
    windows: Annotated[list[tuple[int, float, float]], msgspec.Meta(max_length=MAX_BANDS)]
    gpu: Annotated[dict[Node, Text], msgspec.Meta(max_length=MAX_NODES)]
    agent_cpu_s: Annotated[dict[Node, float], msgspec.Meta(max_length=MAX_NODES)]
    snapshots: Annotated[list[SnapshotFile], msgspec.Meta(max_length=MAX_SNAPSHOTS)]
    nodes: Annotated[dict[Node, NodeMemoryFile], msgspec.Meta(max_length=MAX_NODES)]


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
    per_rank = min(SERIES_POINTS, max(MIN_POINTS, MAX_POINTS // max(1, len(ranks))))
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
        ranks=[_rank_file(r, per_rank) for r in ranks[:MAX_KEYS]],
        culprits=[c[:MAX_TEXT] for c in reply["culprits"][:MAX_KEYS]],
        windows=[(int(i), a, b) for i, a, b in reply["windows"][-MAX_BANDS:]],
        gpu={n: why[:MAX_TEXT] for n, why in reply["gpu"].items()},
        agent_cpu_s=dict(reply["agent_cpu_s"]),
        snapshots=[_snapshot_file(s) for s in reply["snapshots"][-MAX_SNAPSHOTS:]],
        nodes={n: {**m} for n, m in reply["nodes"].items()},
    )


def _rank_file(r: MemoryRankEntry, points: int) -> RankMemoryFile:
    series = r["series"]
    return {
        **r,
        "reason": r["reason"][:MAX_TEXT] if r["reason"] else r["reason"],
        "growth": {**r["growth"]} if r["growth"] else None,
        "series": thin([(t, v) for t, v in series], points) if series is not None else None,
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
    ranks = [*before.values(), *ranks][-MAX_KEYS:]
    per_rank = min(SERIES_POINTS, max(MIN_POINTS, MAX_POINTS // max(1, len(ranks))))
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
