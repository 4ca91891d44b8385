"""A node partial: the summaries of some ranks for one window, folded into one message.

A node agent folds its ranks' summaries (``core.partial.fold_summaries``); the relay of a group
of nodes merges its group's node partials (``core.partial.merge_partials``) and pushes one
partial per group per window instead of one summary per rank. The coordinator merges partials
into its window aggregate exactly as it merges single summaries: sums, counts and sums of
squares are integers (nanoseconds for times), so the order and grouping of folds never change
a total.

The wire is msgpack, decoded by msgspec into typed structs whose constraints are the checks, as
for rank summaries: strict, capped before parsing, ``SummaryDecodeError`` on anything else.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from coordinator.protocol.collective_replies import MAX_BLOCK_BYTES
from coordinator.protocol.summary_codec import (
    MAX_KERNELS,
    MAX_MEMORY_ROWS,
    MAX_STEPS,
    MAX_STREAMS,
    Count,
    GpuRow,
    HostRow,
    LaunchRow,
    Micros,
    Name,
    StreamRow,
    strict_decode,
    strict_encode,
)

PARTIAL_VERSION = 2  # 2: the CUDA figures of summary v3, and the op tables
MAX_PARTIAL_BYTES = 32 * 1024 * 1024
MAX_PARTIAL_RANKS = 16_384
MAX_PARTIAL_TOP = 64
"""Kernels (a node's largest by total) whose value is carried for every rank of the node."""
MAX_DETAIL_BLOCKS = 4_096
NS = 1000
"""Times are summed in integer nanoseconds: exact in any order (traces carry ns precision)."""

SQ_BASE = 2**62
"""A sum of squares of nanoseconds passes 2**64 (msgpack's largest int) for a kernel over 4.3 s:
it travels as ``(high, low)`` with ``value = high * SQ_BASE + low``."""
Low = Annotated[int, msgspec.Meta(ge=0, lt=SQ_BASE)]


class TableRow(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One name's statistics over the node's ranks: integer sums, extremes with their rank."""

    name: Name
    total: Count  # ns for kernels, bytes for memory
    sumsq: tuple[Count, Low]  # (high, low): see SQ_BASE
    count: Count  # calls (or allocations)
    present: Count  # ranks that had the name
    min: Micros  # smallest value among the ranks present
    max: Micros
    max_rank: Count

    @property
    def square_sum(self) -> int:
        return self.sumsq[0] * SQ_BASE + self.sumsq[1]


def split_square_sum(value: int) -> tuple[int, int]:
    """``value`` as the ``(high, low)`` pair of ``TableRow.sumsq``."""
    return divmod(value, SQ_BASE)


class RankPart(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """What the cross-rank views need of one rank: totals, breakdown, step times, streams."""

    rank: Count
    steps: tuple[Count, Count]
    partial: bool
    device: Literal["cpu", "cuda"]
    total_us: Micros
    dropped: tuple[Count, Micros]
    step_us: Annotated[tuple[tuple[Count, Micros], ...], msgspec.Meta(max_length=MAX_STEPS)]
    breakdown: tuple[Micros, Micros, Micros, Micros, Micros, Micros]
    streams: Annotated[tuple[StreamRow, ...], msgspec.Meta(max_length=MAX_STREAMS)]
    peak_bytes: Count | None
    unattributed_us: Micros
    step_device: Annotated[
        tuple[tuple[Count, Micros, Micros], ...], msgspec.Meta(max_length=MAX_STEPS)
    ]
    launch: LaunchRow | None
    launch_bound: Annotated[tuple[Count, ...], msgspec.Meta(max_length=MAX_STEPS)]
    memory_flow: tuple[Annotated[int, msgspec.Meta(ge=-1)], Count, Count] | None = None
    collectives: Annotated[bytes, msgspec.Meta(max_length=MAX_BLOCK_BYTES)] | None = None
    """Its summary's collectives (``collective_replies.encode_block``), decoded when read."""
    host: HostRow | None = None
    """Its summary's DataLoader and gradient-zeroing time (``summary_codec.HostRow``)."""
    gpu: GpuRow | None = None
    """Its summary's syncs, pageable copies and fp32 GEMMs (``summary_codec.GpuRow``)."""
    # (Tuples, not lists: a tuple of numbers or untracked rows leaves the garbage collector's
    # lists at its first pass, and the coordinator keeps these for every rank of a window.)


class OpKernelRow(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The device time (ns) an op's launches of one kernel took, summed over ranks (each rank
    sends its ops' largest kernels: ``summary_codec.MAX_OP_KERNELS``)."""

    op: Name
    kernel: Name
    total: Count


class DetailBlock(msgspec.Struct, array_like=True, frozen=True):
    """One node's ranks' values of its largest kernels, for the rank x kernel views:
    ``values[i * len(names) + j]`` is rank ``ranks[i]``'s self time of ``names[j]``."""

    names: Annotated[list[Name], msgspec.Meta(max_length=MAX_PARTIAL_TOP)]
    ranks: Annotated[list[Count], msgspec.Meta(max_length=MAX_PARTIAL_RANKS)]
    values: list[Micros]


class NodePartial(msgspec.Struct, forbid_unknown_fields=True):
    """The wire form of a node partial (see the module docstring)."""

    v: int
    source: Annotated[str, msgspec.Meta(max_length=128)]  # the node, or the relay, that folded it
    window: Count
    ranks: Annotated[list[RankPart], msgspec.Meta(min_length=1, max_length=MAX_PARTIAL_RANKS)]
    kernels: Annotated[list[TableRow], msgspec.Meta(max_length=MAX_KERNELS * 8)]
    memory: Annotated[list[TableRow], msgspec.Meta(max_length=MAX_MEMORY_ROWS * 8)]
    detail: Annotated[list[DetailBlock], msgspec.Meta(max_length=MAX_DETAIL_BLOCKS)]
    ops: Annotated[list[TableRow], msgspec.Meta(max_length=MAX_KERNELS * 8)]
    """CUDA ranks' ops by the device time they launched (ns; ``count``: calls)."""
    op_cpu: Annotated[list[TableRow], msgspec.Meta(max_length=MAX_KERNELS * 8)]
    """The same ops' self CPU time (ns)."""
    op_kernels: Annotated[list[OpKernelRow], msgspec.Meta(max_length=MAX_KERNELS * 8 * 5)]

    def __post_init__(self) -> None:
        seen = set()
        for part in self.ranks:
            if part.rank in seen:
                raise ValueError(f"rank {part.rank} appears twice")
            seen.add(part.rank)
            if part.steps[0] > part.steps[1]:
                raise ValueError(f"rank {part.rank}: steps {part.steps}: first is after last")
        for row in (*self.kernels, *self.memory, *self.ops, *self.op_cpu):
            if row.present > len(self.ranks) or row.max_rank not in seen:
                raise ValueError(f"row {row.name!r:.80}: its ranks are not the partial's")
        for n, block in enumerate(self.detail):
            if len(block.values) != len(block.names) * len(block.ranks):
                raise ValueError(f"detail block {n}: values do not match its names x ranks")
            if not seen.issuperset(block.ranks):
                raise ValueError(f"detail block {n}: its ranks are not the partial's")


_DECODER = msgspec.msgpack.Decoder(NodePartial)


def encode_partial(partial: NodePartial) -> bytes:
    """Serialise to msgpack; raises ValueError if the result would not decode."""
    return strict_encode(partial, "node partial", decode_partial)


def decode_partial(data: Any) -> NodePartial:
    """Parse and check a payload from ``encode_partial``; ``SummaryDecodeError`` says what is
    wrong and where."""
    partial: NodePartial = strict_decode(
        data, "node partial", MAX_PARTIAL_BYTES, PARTIAL_VERSION, _DECODER
    )
    return partial


__all__ = [
    "MAX_PARTIAL_TOP",
    "NS",
    "SQ_BASE",
    "DetailBlock",
    "NodePartial",
    "OpKernelRow",
    "RankPart",
    "TableRow",
    "decode_partial",
    "encode_partial",
    "split_square_sum",
]
