"""The memory replies that cross Ray, declared once: what a node agent samples, what
``memory()`` answers and what ``status()["memory"]`` says. Pure: no Ray, no torch.

The names of ``MemoryReply`` are public (docs/replies.md): a top-level ``ranks`` list, each
entry with ``trainer_id``, ``rank``, ``rss_bytes``, ``peak_rss_bytes`` and ``growth`` (None, or
``{"bytes_per_min", "since", "span_s", "time_left_s"}`` when the rank is marked as leaking).
Keys may be added.
"""

from __future__ import annotations

from typing import Literal, TypedDict


class MemoryTarget(TypedDict):
    """One process a node agent samples."""

    pid: int


class MemoryWatch(TypedDict):
    """The coordinator to a node agent: sample these processes every ``sample_s`` seconds and
    answer what was sampled for ``watcher`` (the coordinator's ``namespace/name``) since its
    last watch (``AgentMemoryReply``)."""

    targets: list[MemoryTarget]
    sample_s: float
    watcher: str


class ProcessSamples(TypedDict):
    """One process's samples since the last watch: ``[t, rss, uss, gpu]`` each (epoch seconds,
    bytes; ``uss`` None where the OS refused it, ``gpu`` None with no NVML or no GPU use)."""

    pid: int
    samples: list[tuple[float, int, int | None, int | None]]
    gone: str | None  # the process exited (or was never there): why its samples end
    error: str | None  # a sample failed (psutil refused by the OS): the last reason


class AgentMemoryReply(TypedDict):
    """A node agent's answer to a ``MemoryWatch``."""

    node: str
    processes: list[ProcessSamples]
    gpu: str | None  # why GPU memory is not sampled on this node (no NVML ...), or None
    cpu_s: float  # the sampler thread's CPU seconds since it started (the agent's cost)
    sampled: int  # samples taken since it started
    snapshots: list[SnapshotNote]  # snapshots the node's ranks noted since the last watch
    node_memory: NodeMemory | None  # the node's memory now (None: it could not be read)


class NodeMemory(TypedDict):
    """A node's memory as its agent read it at a watch: the host's (``psutil``), or its
    container's where a cgroup limit is lower (``source``: ``host`` or ``cgroup``)."""

    total_bytes: int
    available_bytes: int
    at: float  # epoch seconds
    source: Literal["host", "cgroup"]


class SnapshotNote(TypedDict):
    """A rank's note that it wrote a CUDA memory snapshot (or failed to)."""

    pid: int
    on: Literal["window", "oom", "demand"]
    path: str | None
    error: str | None
    at: float


class Growth(TypedDict):
    """A rank marked as leaking: its memory grew steadily over the leak span."""

    bytes_per_min: float
    since: float  # epoch seconds: when the steady growth was first seen
    span_s: float  # the span that marked it: the short one (a steep leak) or ``leak_span_s``
    time_left_s: float | None  # until its node's available memory is gone at the marked
    # ranks' rates on that node (None: the node's memory is not known)


MemoryState = Literal["sampled", "waiting", "lost", "unreachable"]
"""A rank's sampling: ``sampled``; ``waiting`` (no sample yet); ``lost`` (its process is gone:
its samples end); ``unreachable`` (its node's agent or its pid is unknown: ``reason``)."""


class MemoryRankEntry(TypedDict):
    """One rank in ``memory()["ranks"]``."""

    trainer_id: str
    role: str
    rank: int
    node_id: str | None
    pid: int | None
    state: MemoryState
    reason: str | None
    rss_bytes: int | None
    uss_bytes: int | None
    gpu_bytes: int | None
    peak_rss_bytes: int | None
    peak_gpu_bytes: int | None
    growth: Growth | None
    culprit: bool  # it grows while the other ranks of its role stay flat
    samples: int
    last_at: float | None
    series: list[tuple[float, int]] | None  # (t, rss) over the run, bounded; with series=True


class MemoryReply(TypedDict):
    """``memory()``: every rank's memory over the run, and the leaks named."""

    run: str
    sample_s: float  # 0: sampling is off
    leak_span_s: float
    leak_min_bytes_per_min: float
    leak_fast_span_s: float  # the short span a steep leak is marked over (0: off)
    leak_fast_min_bytes_per_min: float  # ...at this rate at least
    taken_at: float
    ranks: list[MemoryRankEntry]
    culprits: list[str]  # one line a culprit: "policy rank 1 grows 60.0 MiB/min since ..."
    windows: list[tuple[int, float, float]]  # (index, opened at, closed at): the chart's bands
    gpu: dict[str, str]  # node -> why GPU memory is not sampled there
    agent_cpu_s: dict[str, float]  # node -> its sampler's CPU seconds
    snapshots: list[SnapshotEntry]
    nodes: dict[str, NodeMemory]  # node -> its memory at the last watch


class SnapshotEntry(TypedDict):
    """A CUDA memory snapshot a rank wrote (or failed to write)."""

    trainer_id: str
    rank: int
    on: Literal["window", "oom", "demand"]
    path: str | None
    error: str | None
    at: float


class MemoryStatusEntry(TypedDict):
    """``status()["memory"]``: the leaks named, in short."""

    sample_s: float
    sampled_ranks: int
    lost_ranks: int
    marked: list[MemoryMark]
    culprits: list[str]
    snapshots: list[SnapshotEntry]  # the latest few (``memory()`` has them all, bounded)


class MemoryMark(TypedDict):
    """A rank marked as leaking, in ``status()["memory"]["marked"]``."""

    trainer_id: str
    rank: int
    bytes_per_min: float
    since: float
    culprit: bool
    span_s: float
    time_left_s: float | None


class SnapshotAsk(TypedDict):
    """One rank asked for a snapshot on demand: where it goes (a path relative to the node's
    memory directory when the run directory is a URL), or why it was not asked."""

    trainer_id: str
    rank: int
    path: str
    asked: bool
    reason: str | None


class SnapshotReply(TypedDict):
    """``memory_snapshot()``: the ranks asked; each notes its file in ``memory()["snapshots"]``
    once written."""

    request: int
    ranks: list[SnapshotAsk]
