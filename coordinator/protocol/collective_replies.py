"""A window's collectives across ranks (issue 56): what one rank's trace gives of each
collective it ran (``RankCollective``, as its summary carries it), and what matching them across
each group's ranks answers (``CollectivesReply``). The JSON names of the reply are public:
a top-level ``collectives`` list (``group``, ``name``, ``ranks``, ``last_rank``, ``skew_us``,
``wait_us`` keyed by rank, ``transfer_us``, ``bytes``, ``busbw_gbps``) and a top-level ``ranks``
list (``rank``, ``wait_us``, ``arrived_last``, ``collectives``, ``clock_offset_us``).
"""

from __future__ import annotations

from typing import TypedDict

import msgspec


class RankCollective(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One collective as one rank's trace shows it, in the order the rank ran them. Times are
    microseconds on the rank's own clock (its trace's base plus ``ts``)."""

    group: str  # the process group's name ("0" for the default group)
    seq: int | None  # the trace's ``Seq`` for it, where the trace has one
    name: str  # the kind, as ``collectives.kind_of`` names it: all_reduce, broadcast, ...
    nbytes: int  # the size nccl-tests measures it by: the larger of its input and output
    dtype: str  # (all_gather's output, reduce_scatter's input, all_reduce's buffer)
    step: int | None  # the step it fell in (None: outside every step)
    arrive_us: float  # its start on the calling thread (a GPU rank: its launch)
    work_us: float  # how long its work took (the NCCL kernel; gloo's op)
    end_us: float  # the end of its work


class MatchedCollective(TypedDict):
    """One collective matched across the ranks of its group that recorded it."""

    group: str
    seq: int  # its ``Seq``, or its order among its group's collectives of that step
    name: str
    ranks: list[int]  # the ranks matched, ascending
    missing: list[int]  # ranks of the group that did not record it (a window cut short)
    step: int | None  # the step it fell in on the lowest rank
    last_rank: int  # the rank that arrived last
    skew_us: float  # the latest arrival minus the earliest
    wait_us: dict[str, float]  # rank (as a string, for JSON) -> latest arrival minus its own
    transfer_us: float  # the shortest duration of its work across the ranks
    bytes: int
    algbw_gbps: float | None  # bytes / transfer time (None: no bytes, or no time)
    busbw_gbps: float | None  # algbw x nccl-tests' factor for the kind and group size


class RankCollectives(TypedDict):
    """One rank's part in the window's matched collectives."""

    rank: int
    collectives: int  # matched collectives it took part in
    arrived_last: int  # of those, how many it arrived last at (with a skew over the floor)
    wait_us: float  # its wait in them, all together
    wait_us_per_step: dict[str, float]  # step (as a string) -> its wait in that step
    clock_reference: int  # the rank its clock is estimated against (itself: none links them)
    clock_offset_us: float  # its clock minus the reference's, as estimated
    clock_spread_us: float | None  # the spread of that estimate (None: not estimated)
    clock_corrected: bool  # whether its times were set by the offset before matching


class CollectivesReply(TypedDict):
    """A window's collectives matched across ranks: the ``collectives`` (bounded, the
    costliest waits first when cut), the ``ranks``, and ``problems`` (one line each: what could
    not be matched and why; the rest still answers)."""

    collectives: list[MatchedCollective]
    ranks: list[RankCollectives]
    matched: int  # collectives matched in all
    shown: int  # of those, how many ``collectives`` lists
    problems: list[str]
