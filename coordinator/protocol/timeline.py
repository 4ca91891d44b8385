"""What a merged window trace is made of, as it crosses Ray: who each rank is, what was kept of
it, and a node's piece of the merge (``worker_ext.agent.timeline_file``, ``coordinator.ops.
timeline``)."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class RankLabel(TypedDict):
    """Who a trace is from."""

    rank: int
    role: str
    node: str


class RankCount(TypedDict):
    """What was kept of one rank's trace, and what was left out."""

    rank: int
    role: str
    node: str
    pid: int
    events: int  # in its trace (without Kineto's process and thread names)
    kept: int
    below_min_us: int
    over_max_events: int
    clock: str  # "baseTimeNanoseconds" or "ts" (a trace without it)
    clock_offset_us: float  # taken off its times: its clock's offset, from its collectives


class PieceRank(TypedDict):
    """One rank of a node's piece: who, its process number in the merged trace, its file."""

    label: RankLabel
    pid: int
    path: str
    clock_offset_us: NotRequired[float]  # its clock minus the reference rank's, to take off


class TimelinePiece(TypedDict):
    """Some ranks merged into one file (a node agent's piece of a window, or the whole of it):
    where, its clock's origin (wall-clock microseconds), each rank's count and step starts
    (step -> ``ts`` in the piece), and the ranks whose trace could not be read, with why."""

    piece: str  # the agent's name for it ("" for a file of the caller's own)
    path: str
    bytes: int
    events: int
    origin: float
    ranks: list[RankCount]
    starts: list[dict[int, float]]
    failed: dict[int, str]  # pid -> why
