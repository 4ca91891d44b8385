"""A window's collectives across ranks (issue 56): what one rank's trace gives of each
collective it ran (``RankCollective``, as its summary carries it), and what matching them across
each group's ranks answers (``CollectivesReply``). The JSON names of the reply are public:
a top-level ``collectives`` list (``group``, ``name``, ``ranks``, ``last_rank``, ``skew_us``,
``wait_us`` keyed by rank, ``transfer_us``, ``bytes``, ``busbw_gbps``) and a top-level ``ranks``
list (``rank``, ``wait_us``, ``arrived_last``, ``collectives``, ``clock_offset_us``).
"""

from __future__ import annotations

from typing import Annotated, TypedDict

import msgspec

MAX_COLLECTIVES = 10_000
"""The most collectives one rank's summary may carry of a window (its cap is lower, a config
field); past the cap they travel folded (``FoldedCollective``)."""
DEFAULT_COLLECTIVES_CAP = 1_000
"""Collectives a rank's summary carries of a window by default (the config's
``collectives_cap``): whole steps, the rest folded."""
MAX_FOLDED = 1_000
MAX_GROUPS = 256
MAX_GROUP_RANKS = 1 << 20
MAX_NOTES = 16
_LIMIT = 2**62

Count = Annotated[int, msgspec.Meta(ge=0, lt=_LIMIT)]
Seq = Annotated[int, msgspec.Meta(gt=-_LIMIT, lt=_LIMIT)]
Time = Annotated[float, msgspec.Meta(ge=-1e18, le=1e18)]  # finite (NaN fails both bounds)
Duration = Annotated[float, msgspec.Meta(ge=0.0, le=1e18)]
Group = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Kind = Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
Dtype = Annotated[str, msgspec.Meta(max_length=32)]
Note = Annotated[str, msgspec.Meta(max_length=500)]


class RankCollective(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True,
                     gc=False):  # fmt: skip
    """One collective as one rank's trace shows it, in the order the rank ran them. Times are
    microseconds on the rank's own clock (its trace's ``baseTimeNanoseconds`` plus ``ts``)."""

    group: Group  # the process group's name ("0" for the default group)
    seq: Seq | None  # the trace's ``Seq`` for it, where the trace has one
    name: Kind  # the kind, as ``collectives.kind_of`` names it: all_reduce, broadcast, ...
    nbytes: Count  # the size nccl-tests measures it by: the larger of its input and output
    dtype: Dtype  # (all_gather's output, reduce_scatter's input, all_reduce's buffer)
    step: Count | None  # the step it fell in (None: outside every step)
    arrive_us: Time  # its start on the calling thread (a GPU rank: its NCCL kernel's start)
    work_us: Duration  # how long its work took (the NCCL kernel; gloo's op)
    end_us: Time  # the end of its work


class FoldedCollective(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True,
                       gc=False):  # fmt: skip
    """Collectives past a rank's cap, folded per (group, kind, bytes): how many, their work."""

    group: Group
    name: Kind
    nbytes: Count
    count: Count
    work_us: Duration  # their work, all together


class CollectiveBlock(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """What one rank's summary carries of its window's collectives: those it ran (whole steps,
    up to its cap, in order), the rest folded, the process groups its trace names (name ->
    ranks: ``distributedInfo.pg_config``), and what the reader noted of them (unpaired ops,
    odd arguments)."""

    calls: Annotated[tuple[RankCollective, ...], msgspec.Meta(max_length=MAX_COLLECTIVES)]
    folded: Annotated[tuple[FoldedCollective, ...], msgspec.Meta(max_length=MAX_FOLDED)]
    cut: Count  # collectives past the cap (folded), 0 when none
    groups: Annotated[
        tuple[tuple[Group, Annotated[tuple[Count, ...], msgspec.Meta(max_length=MAX_GROUP_RANKS)]],
              ...],
        msgspec.Meta(max_length=MAX_GROUPS),
    ]  # fmt: skip
    notes: Annotated[tuple[Note, ...], msgspec.Meta(max_length=MAX_NOTES)]


MAX_BLOCK_BYTES = 4 * 1024 * 1024
"""A block's bytes at most (it travels inside a summary, whose cap is the same)."""
_BLOCK = msgspec.msgpack.Decoder(CollectiveBlock)
_ENCODER = msgspec.msgpack.Encoder()


def encode_block(block: CollectiveBlock) -> bytes:
    """A block as the node partials and the coordinator keep it: msgpack, about 56 bytes a
    collective (a tenth of the decoded structs), decoded only when a read matches them."""
    return _ENCODER.encode(block)


def decode_block(data: bytes) -> CollectiveBlock:
    """A block from ``encode_block``, every field checked; ValueError saying what is wrong."""
    if len(data) > MAX_BLOCK_BYTES:
        raise ValueError(f"{len(data)} bytes, over the {MAX_BLOCK_BYTES}-byte cap")
    try:
        return _BLOCK.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"malformed: {exc}") from None


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
    arrived_last_per_step: dict[str, int]  # step (as a string) -> of those, in that step
    made_wait_us: float  # the others' wait for it where it arrived last (their mean, summed)
    wait_us: float  # its wait in them, all together
    wait_us_per_step: dict[str, float]  # step (as a string; "none": outside every step) -> its
    # wait in that step
    wait_share: float | None  # its wait a step over its mean step time (None: not timed)
    clock_reference: int  # the rank its clock is estimated against (itself: none links them)
    clock_offset_us: float  # its clock minus the reference's, as estimated
    clock_spread_us: float | None  # the spread of that estimate (None: not estimated)
    clock_corrected: bool  # whether its times were set by the offset before matching
    cut: int  # its collectives past its summary's cap: folded, not matched


class LastArriver(TypedDict):
    """The rank that made the others wait in the window's collectives, in
    ``stragglers["last_arriver"]``: named when it arrived last at over half of the collectives it
    took part in (with a skew over the noise floor), at least ``MIN_LAST`` of them."""

    rank: int
    arrived_last: int  # collectives it arrived last at
    collectives: int  # collectives it took part in
    waiting_ranks: list[int]  # the ranks that waited for it
    wait_ms_per_step: float  # their wait for it, mean over them, per step with a collective
    reason: str  # "arrives last at 11 of 12 collectives; ranks 0, 2, 3 wait 31 ms a step"
    agrees: bool  # the compute-time stragglers flag it too
    note: str | None  # when they do not: why the two can differ


class CollectivesReply(TypedDict):
    """A window's collectives matched across ranks: the ``collectives`` (bounded, the
    costliest waits first when cut), the ``ranks``, and ``problems`` (one line each: what could
    not be matched and why; the rest still answers)."""

    collectives: list[MatchedCollective]
    ranks: list[RankCollectives]
    matched: int  # collectives matched in all
    shown: int  # of those, how many ``collectives`` lists
    last_arriver: LastArriver | None  # the rank the others waited for, if one did it often
    problems: list[str]


class WindowCollectivesReply(CollectivesReply):
    """``collectives()``: one window's collectives of one trainer (one role), matched across
    its ranks; ``window`` None when no window has closed (or the run keeps none)."""

    run: str
    window: int | None
    steps: list[int] | None
    trainer_id: str | None
    role: str | None
    ranks_recorded: int  # ranks whose summary is in
    ranks_without: list[int]  # of those, ranks whose trace had no collective
