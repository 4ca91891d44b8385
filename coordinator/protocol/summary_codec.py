"""Per-rank, per-window kernel summary and its msgpack wire format.

The wire is a msgpack map (``v``, ``rank``, ``window``, ``steps``, ...) whose rows are arrays.
It is decoded by msgspec into typed structs whose constraints are the checks: the decoder is
strict (every type, range and length; no unknown or missing key) and runs at C speed. It caps
the payload before it parses, and raises ``SummaryDecodeError`` (a ValueError) on anything
else, with the path of what is wrong (``at `$.kernels[3][1]```).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec

from coordinator.protocol.collective_replies import CollectiveBlock

SUMMARY_VERSION = 3  # 3: overlap, unattributed, device step times, launches, ops (CUDA)
MAX_PAYLOAD_BYTES = 4 * 1024 * 1024
MAX_NAME_CHARS = 2048
MAX_KERNELS = 10_000
MAX_STEPS = 100_000
MAX_STREAMS = 1_024
MAX_MEMORY_ROWS = 1_000
MAX_OP_KERNELS = 5  # an op's kernels, by device time, in its row
DEFAULT_TOP_K = 50
"""Rows a rank's summary keeps by default (the config's ``top_k``)."""
DEVICES = ("cpu", "cuda")
UNIT = "us"
_MAX_INT = 2**62

Count = Annotated[int, msgspec.Meta(ge=0, lt=_MAX_INT)]
"""A non-negative int below 2**62 (a count, a step, a rank, bytes)."""
Signed = Annotated[int, msgspec.Meta(gt=-_MAX_INT, lt=_MAX_INT)]
Micros = Annotated[float, msgspec.Meta(ge=0.0, le=sys.float_info.max)]
"""A finite, non-negative number (NaN and infinities fail the bounds)."""
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]


class SummaryDecodeError(ValueError):
    """A summary payload that is malformed, oversized or of an unknown version."""


class KernelRow(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One op or kernel: self time in microseconds, call count, flops (0 when not measured)."""

    name: Name
    self_us: Micros
    count: Count
    flops: Count


@dataclass(frozen=True)
class Breakdown:
    """Where the window's time went on this rank, in microseconds.

    CPU ranks: the wall time with a collective in flight on any thread (``comm``), self CPU time
    of copies (``memcpy``) and of every other op (``compute``), and the rest of the window
    (``other``: Python, waiting, idle). CUDA ranks, over the device span of the window (its
    first to its last device event launched in its steps): the unions of NCCL kernels
    (``comm``), memcpy/memset/dma (``memcpy``) and every other kernel (``compute``), device idle
    time (``other``), and the communication time during which a compute kernel also ran
    (``overlap``; 0 on CPU ranks).
    """

    compute_us: float = 0.0
    comm_us: float = 0.0
    memcpy_us: float = 0.0
    other_us: float = 0.0
    window_us: float = 0.0
    overlap_us: float = 0.0

    def share(self, what: str) -> float:
        """``what``'s share of the window (``compute``, ``comm``, ``memcpy`` or ``other``)."""
        return getattr(self, f"{what}_us") / self.window_us if self.window_us > 0 else 0.0


BREAKDOWN_KEYS = ("compute", "comm", "memcpy", "other")


class StreamRow(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Device time on one stream: busy (union of its activity) and idle, within the window."""

    device: Signed
    stream: Signed
    busy_us: Micros
    idle_us: Micros


class OpRow(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One CPU op of a CUDA rank: the device time of what it launched itself (its innermost op
    around the launch), its own CPU self time, its calls, and its largest kernels."""

    name: Name
    device_us: Micros
    cpu_us: Micros
    count: Count
    kernels: Annotated[list[tuple[Name, Micros]], msgspec.Meta(max_length=MAX_OP_KERNELS)]


class LaunchRow(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Launch statistics (HTA's ``get_cuda_kernel_launch_stats``) over the window's launches
    of kernels, copies and sets: the launch delay (device start minus the launch call's end, at
    least 0) as median and p95, and the share of events shorter than their launch call."""

    kernels: Count
    delay_p50_us: Micros
    delay_p95_us: Micros
    short_share: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class HostRow(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Host time the findings' ``dataloader`` and ``zero_grad`` rules read (issue 57), each a
    mean over the window's recorded steps (inclusive: the span with everything under it): the
    DataLoader's ``__next__`` and its calls in the window; the ops that zero gradients under a
    ``zero_grad`` (``aten::zero_``, ``aten::fill_``, ``aten::_foreach_zero_``) and their
    calls. ``optimizer_foreach`` reads the last three (trailing, so a row without them
    decodes): a torch optimizer's ``Optimizer.step#<Name>.step`` spans, and the outermost ops
    under them, per-parameter math (``aten::add_``, ``mul_``, ``addcdiv_`` ...) and
    ``aten::_foreach_*`` / ``aten::_fused_*``, each a mean per recorded step.
    ``host_contention`` reads ``cpu_wait_us`` (trailing, after them): the training thread's
    wait for a CPU a recorded step (Linux's schedstat ``run_delay``, read by the rank at the
    recorded steps' start and end); None: not measured (no schedstat, a trace read offline)."""

    dataloader_us: Micros
    dataloader_calls: Count
    zero_grad_us: Micros
    zero_grad_ops: Count
    optimizer_us: Micros = 0.0
    optimizer_loop_ops: Micros = 0.0
    optimizer_foreach_ops: Micros = 0.0
    cpu_wait_us: Micros | None = None


MAX_SYNC_CAUSES = 4
"""The ops a ``GpuRow`` names as causing device synchronizations, the costliest first."""


MAX_MATMUL_SHAPES = 3
"""The shapes of misaligned fp16/bf16 matmuls a ``GpuRow`` names (the first distinct ones)."""


class SyncCause(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """An op that made the host wait for the device: its wait a step and its syncs."""

    name: Name
    wait_us: Micros
    syncs: Count


class GpuRow(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A CUDA rank's figures of the findings' GPU rules (issue 57,
    ``core.findings_device``), each a mean over the window's recorded steps: the host's wait
    in device synchronizations (the sync runtime calls and ``aten::_local_scalar_dense``,
    outermost only, none inside a collective), how many, and the ops that caused the most; the
    device time of copies from pageable memory and how many (none a counted sync launched: the
    copy back of ``.item()``); the device time of fp32 GEMM kernels without TF32 on an Ampere
    or later device, and of TF32 ones (an older agent's row: its convolutions' too, judged as
    GEMMs). ``matmul_alignment`` reads the next three (trailing, so a row without them
    decodes): the device time of the kernels launched by fp16/bf16 ``aten::mm``/``bmm``/
    ``addmm`` ops with a dim not a multiple of 8 (ops recorded with ``record_shapes``; without
    shapes an op is not judged), how many such ops in the window, and the first
    ``MAX_MATMUL_SHAPES`` of their shapes. ``tf32_off`` reads the last two (trailing too): the
    device time of fp32 convolution (cuDNN) kernels without TF32 on an Ampere or later device,
    and of TF32 ones. ``mm_ops_shaped`` (trailing too): the matmul ops in the trace recorded
    with their input types and dims, the ones ``matmul_alignment`` can judge (0: none, or an
    older agent's row: the rule says it could not judge)."""

    wait_us: Micros
    syncs: Count
    causes: Annotated[tuple[SyncCause, ...], msgspec.Meta(max_length=MAX_SYNC_CAUSES)]
    pageable_us: Micros
    pageable_copies: Count
    fp32_gemm_us: Micros
    tf32_gemm_us: Micros
    misaligned_mm_us: Micros = 0.0
    misaligned_mm_ops: Count = 0
    misaligned_mm_shapes: Annotated[
        tuple[Name, ...], msgspec.Meta(max_length=MAX_MATMUL_SHAPES)
    ] = ()
    fp32_conv_us: Micros = 0.0
    tf32_conv_us: Micros = 0.0
    mm_ops_shaped: Count = 0


class MemoryRow(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """An op's allocations in the window: bytes allocated (frees not subtracted), how many."""

    name: Name
    bytes: Count
    count: Count


@dataclass
class RankSummary:
    """What one rank recorded in one window."""

    rank: int
    window: int
    steps: tuple[int, int]
    partial: bool
    device: str
    kernels: list[KernelRow]
    dropped_rows: int = 0
    dropped_us: float = 0.0
    step_us: list[tuple[int, float]] = field(default_factory=list)
    breakdown: Breakdown = field(default_factory=Breakdown)
    streams: list[StreamRow] = field(default_factory=list)
    peak_bytes: int | None = None
    """Peak allocated bytes in the window (with ``profile_memory``), else None."""
    memory: list[MemoryRow] = field(default_factory=list)
    memory_flow: tuple[int, int, int] | None = None
    """With ``peak_bytes``: the step the peak fell in (-1: none), bytes allocated, bytes freed."""
    unit: str = UNIT
    unattributed_us: float = 0.0
    """CUDA: device time launched outside the window's steps, or with no launch in the trace."""
    step_device: list[tuple[int, float, float]] = field(default_factory=list)
    """CUDA: each recorded step's device busy time and device span, ``(step, busy, span)``."""
    launch: LaunchRow | None = None
    launch_bound: list[int] = field(default_factory=list)
    """CUDA: steps whose device idled over half their span while over half their kernels ran
    shorter than their launch call took."""
    ops: list[OpRow] = field(default_factory=list)
    """CUDA: the op table (``OpRow``); on CPU ranks ``kernels`` is already per op."""
    collectives: CollectiveBlock | None = None
    """The window's collectives as this rank ran them (issue 56); None: its trace has none."""
    host: HostRow | None = None
    """Its DataLoader, gradient-zeroing and optimizer time (``HostRow``); None: it has none."""
    gpu: GpuRow | None = None
    """CUDA: its syncs, pageable copies and fp32 GEMMs (``GpuRow``); None: a CPU rank."""

    @property
    def total_us(self) -> float:
        """Self time of every row, the dropped ones included."""
        return sum(k.self_us for k in self.kernels) + self.dropped_us


class _Versioned(msgspec.Struct):
    """Only the version, read first so that an old or new format is named as such."""

    v: Any = None


class _Wire(msgspec.Struct, forbid_unknown_fields=True):
    """The payload as it travels (see ``encode_summary``)."""

    v: int
    rank: Count
    window: Count
    steps: tuple[Count, Count]
    partial: bool
    device: Literal["cpu", "cuda"]
    unit: Literal["us"]
    kernels: Annotated[list[KernelRow], msgspec.Meta(max_length=MAX_KERNELS)]
    dropped: tuple[Count, Micros]
    step_us: Annotated[list[tuple[Count, Micros]], msgspec.Meta(max_length=MAX_STEPS)]
    breakdown: tuple[Micros, Micros, Micros, Micros, Micros, Micros]
    streams: Annotated[list[StreamRow], msgspec.Meta(max_length=MAX_STREAMS)]
    memory: (
        tuple[Count, Annotated[list[MemoryRow], msgspec.Meta(max_length=MAX_MEMORY_ROWS)]] | None
    )
    unattributed_us: Micros
    step_device: Annotated[list[tuple[Count, Micros, Micros]], msgspec.Meta(max_length=MAX_STEPS)]
    launch: LaunchRow | None
    launch_bound: Annotated[list[Count], msgspec.Meta(max_length=MAX_STEPS)]
    ops: Annotated[list[OpRow], msgspec.Meta(max_length=MAX_KERNELS)]
    memory_flow: tuple[Annotated[int, msgspec.Meta(ge=-1)], Count, Count] | None = None
    collectives: CollectiveBlock | None = None
    host: HostRow | None = None
    gpu: GpuRow | None = None

    def __post_init__(self) -> None:
        if self.steps[0] > self.steps[1]:
            raise ValueError(f"steps {self.steps[0]}-{self.steps[1]}: first is after last")


_VERSION = msgspec.msgpack.Decoder(_Versioned)
_DECODER = msgspec.msgpack.Decoder(_Wire)
_ENCODER = msgspec.msgpack.Encoder()


def encode_summary(summary: RankSummary) -> bytes:
    """Serialise to msgpack; raises ValueError if the result would not decode."""
    b = summary.breakdown
    wire = _Wire(
        v=SUMMARY_VERSION,
        rank=summary.rank,
        window=summary.window,
        steps=(summary.steps[0], summary.steps[1]),
        partial=summary.partial,
        device=summary.device,  # type: ignore[arg-type]
        unit=summary.unit,  # type: ignore[arg-type]
        kernels=list(summary.kernels),
        dropped=(summary.dropped_rows, float(summary.dropped_us)),
        step_us=[(s, float(us)) for s, us in summary.step_us],
        breakdown=(b.compute_us, b.comm_us, b.memcpy_us, b.other_us, b.window_us, b.overlap_us),
        streams=list(summary.streams),
        memory=None if summary.peak_bytes is None else (summary.peak_bytes, list(summary.memory)),
        unattributed_us=float(summary.unattributed_us),
        step_device=[(s, float(b), float(sp)) for s, b, sp in summary.step_device],
        launch=summary.launch,
        launch_bound=list(summary.launch_bound),
        ops=list(summary.ops),
        memory_flow=summary.memory_flow if summary.peak_bytes is not None else None,
        collectives=summary.collectives,
        host=summary.host,
        gpu=summary.gpu,
    )
    return strict_encode(wire, "summary", decode_summary)


def strict_encode(struct: Any, what: str, decode: Any) -> bytes:
    """msgpack of ``struct``, checked by ``decode`` (never send what the receiver would refuse);
    ValueError if it cannot be encoded or would not decode."""
    try:
        data = _ENCODER.encode(struct)
    except (TypeError, OverflowError, ValueError) as exc:
        raise ValueError(f"{what} cannot be encoded: {exc}") from exc
    decode(data)
    return data


def strict_decode(data: Any, what: str, cap: int, version: int, decoder: Any) -> Any:
    """``decoder``'s struct of ``data``, checked: bytes, at most ``cap`` of them, of version
    ``version``, every field; ``SummaryDecodeError`` (saying what, and where) on anything
    else. The wire formats of summaries and node partials share it."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SummaryDecodeError(f"{what} must be bytes, got {type(data).__name__}")
    if len(data) > cap:
        raise SummaryDecodeError(f"{what} is {len(data)} bytes, over the {cap}-byte cap")
    try:
        found = _VERSION.decode(data).v
        if type(found) is not int or found != version:
            raise SummaryDecodeError(
                f"{what} version {found!r:.40} is not supported (expected {version})"
            )
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise SummaryDecodeError(f"{what} is malformed: {exc}") from None
    except msgspec.DecodeError as exc:
        raise SummaryDecodeError(f"{what} is not valid msgpack: {exc}") from None


def decode_summary(data: Any) -> RankSummary:
    """Parse and check a payload from ``encode_summary``; ``SummaryDecodeError`` says what is
    wrong and where."""
    w = strict_decode(data, "summary", MAX_PAYLOAD_BYTES, SUMMARY_VERSION, _DECODER)
    dropped_rows, dropped_us = w.dropped
    return RankSummary(
        rank=w.rank,
        window=w.window,
        steps=w.steps,
        partial=w.partial,
        device=w.device,
        kernels=w.kernels,
        dropped_rows=dropped_rows,
        dropped_us=dropped_us,
        step_us=w.step_us,
        breakdown=Breakdown(*w.breakdown),
        streams=w.streams,
        peak_bytes=None if w.memory is None else w.memory[0],
        memory=[] if w.memory is None else w.memory[1],
        unattributed_us=w.unattributed_us,
        step_device=w.step_device,
        launch=w.launch,
        launch_bound=w.launch_bound,
        ops=w.ops,
        memory_flow=w.memory_flow,
        collectives=w.collectives,
        host=w.host,
        gpu=w.gpu,
    )
