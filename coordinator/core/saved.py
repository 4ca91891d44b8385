"""The saved form of a window's cross-rank figures: explicit structs, one per kept object.

``RowTable``, ``DeviceFigures`` and ``WindowAggregate`` each convert themselves to and from
these (``saved()`` / ``from_saved()``), naming every field: nothing is read from an object's
attributes by reflection, so renaming a private attribute changes no byte on disk. Each
field's name on disk is declared here (``name=``, the run record's version 1: a few begin with
``_``, as the attributes did when the format was made). Pure: no Ray, no torch, no I/O.
"""

from __future__ import annotations

import msgspec

from coordinator.protocol.summary_codec import GpuRow, HostRow, LaunchRow, StreamRow

BigInt = int | str
"""An int, or its decimal digits beyond msgpack's 64 bits (a sum of squares of nanoseconds
over a thousand ranks passes 2**64)."""
_INT64 = 2**63


class SavedError(ValueError):
    """Saved figures that do not add up (a sum that is not an int's digits)."""


def digits(xs: list[int]) -> list[BigInt]:
    """``xs`` with each int msgpack cannot hold as its decimal digits."""
    return [str(x) if not -_INT64 <= x < _INT64 else x for x in xs]


def ints(xs: list[BigInt]) -> list[int]:
    """``digits`` undone; SavedError for digits that are not an int's."""
    try:
        return [x if isinstance(x, int) else int(x, 10) for x in xs]
    except ValueError:
        raise SavedError("a table's sum is neither an int nor an int's digits") from None


class RowTableFile(msgspec.Struct):
    """A ``RowTable``'s running sums (its names' positions are their ids)."""

    scale: int
    names: list[str]
    total: list[BigInt]
    sumsq: list[BigInt]
    max: list[float]
    max_rank: list[int]
    min_present: list[float]
    present: list[int]
    count: list[int]


class DeviceFile(msgspec.Struct):
    """A ``DeviceFigures``: what CUDA ranks add."""

    unattributed: dict[int, float]
    step_device: dict[int, tuple[tuple[int, float, float], ...]]
    launch: dict[int, LaunchRow]
    launch_bound: dict[int, tuple[int, ...]]
    ops: RowTableFile
    op_cpu: RowTableFile
    op_kernels: dict[str, dict[str, int]]
    rows: dict[int, GpuRow] = {}
    """Per rank: the findings' GPU figures (``GpuRow``; a file written before: none)."""


Block = tuple[tuple[int, ...], tuple[int, ...] | None, bytes]
"""Per-rank kernel values of a block of ranks (``aggregate._Block``)."""


class AggregateFile(msgspec.Struct):
    """A ``WindowAggregate``: one trainer's cross-rank figures of a window."""

    window: int
    steps: tuple[int, int] | None
    partial: bool
    devices: set[str]
    rank_totals: dict[int, float]
    rank_step_ms: dict[int, float]
    rank_steps: dict[int, tuple[tuple[int, float], ...]]
    step_ms_sum: dict[int, float]
    step_ranks: dict[int, int]
    rank_dropped: dict[int, tuple[int, float]]
    bad_ranks: dict[int, str]
    duplicates: int
    breakdowns: dict[int, tuple[float, ...]]
    streams: dict[int, tuple[StreamRow, ...]]
    peak_bytes: dict[int, int]
    kernels: RowTableFile = msgspec.field(name="_kernels")
    memory: RowTableFile = msgspec.field(name="_memory")
    gpu: DeviceFile = msgspec.field(name="gpu")
    detail: list[Block] | None = msgspec.field(name="_detail")
    """Per-rank values, while the coordinator keeps them (``detail_windows``)."""
    torn: set[int] = msgspec.field(name="_torn")
    """Ranks whose partial was being folded when it was saved: their rows are in the tables,
    and a summary of theirs sent again is refused."""
    memory_flow: dict[int, tuple[int, int, int]] = {}
    """Per rank: the step its peak fell in (-1: none), bytes allocated, bytes freed (a file
    written before it: none)."""
    collectives: dict[int, bytes] = {}
    """Per rank: the window's collectives its summary carried, as ``encode_block`` made them
    (a file written before: none)."""
    host: dict[int, HostRow] = {}
    """Per rank: its DataLoader and gradient-zeroing time (a file written before: none)."""


class WindowSpan(msgspec.Struct):
    """A ``Window``: its index, warm-up and recorded steps, kind."""

    index: int
    warmup_start: int
    first: int
    last: int
    kind: str
