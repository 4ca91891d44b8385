"""A run's record in ``save_path``: its files' types, and their strict, versioned codec.

The record is what the coordinator knew of a run, kept beside its traces so that it outlives
the cluster (``docs/reference.md#the-runs-record``). Every file is msgpack of one of the types
below, tagged by ``kind`` and carrying ``version``; the decoder checks both and every field's
type, and refuses a file over ``MAX_FILE_BYTES``. Pure: no Ray, no torch, no I/O.

- ``run.msgpack`` (``RunFile``): the run's config (secrets redacted), trainers and roles,
  lifecycle, counters, and what else the record holds;
- ``windows/NNNNNN.msgpack`` (``WindowFile``): a settled window, written once: its cross-rank
  aggregates (each trainer's, exactly what ``kernel_summary`` reads), stragglers' inputs,
  regression marks, trigger;
- ``marks/NNNNNN.msgpack`` (``MarksFile``): a recorded window's marks when they changed after it
  was written (a later window confirmed one);
- ``phases/NNNNNN.msgpack`` (``PhaseChunk``): per-step phase times, appended in chunks;
- ``stalls/NNNNNN.msgpack`` (``StallFile``): a stall and its grouped stacks.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from coordinator.core.aggregate import WindowAggregate
from coordinator.core.device_views import DeviceFigures
from coordinator.core.marks import WindowProfile
from coordinator.core.records import WindowRecord
from coordinator.core.row_table import RowTable
from coordinator.core.run import Run
from coordinator.core.schedule import Window
from coordinator.core.state import rank_counts
from coordinator.protocol.replies import AutoTrigger, RegressionEntry, WindowTrace
from coordinator.protocol.stack_replies import StallEntry
from coordinator.protocol.summary_codec import LaunchRow, StreamRow

VERSION = 1
MAX_FILE_BYTES = 512 * 1024 * 1024
"""The largest record file read (a window of 10,000 ranks is a few MB)."""
Kind = Literal["run", "window", "marks", "phases", "stall"]


class RecordError(ValueError):
    """A record file that is malformed, oversized, of another kind or of an unknown version."""


class _Tag(msgspec.Struct):
    """What every record file starts with (read first, to name a file of another version)."""

    kind: str
    version: int


BigInt = int | str
"""An int, or its decimal digits beyond msgpack's 64 bits (a sum of squares of nanoseconds
over a thousand ranks passes 2**64)."""


class RowTableFile(msgspec.Struct):
    """A ``RowTable``'s running sums (its ``ids`` are its names' positions)."""

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


Block = tuple[tuple[int, ...], tuple[int, ...] | None, bytes]


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
    _kernels: RowTableFile
    _memory: RowTableFile
    gpu: DeviceFile
    _detail: list[Block] | None
    _torn: set[int]


class WindowSpan(msgspec.Struct):
    """A ``Window``: its index, warm-up and recorded steps, kind."""

    index: int
    warmup_start: int
    first: int
    last: int
    kind: str


Key = tuple[str, int]


class WindowFile(msgspec.Struct, tag="window", tag_field="kind"):
    """A settled window (``WindowRecord``), written once."""

    version: int
    run: str
    window: WindowSpan
    planned: WindowSpan | None
    participants: set[Key]
    acked: set[Key]
    steps: tuple[int, int] | None
    partial: bool
    closed: bool
    trace_dirs: dict[str, str]
    aggregates: dict[str, AggregateFile]
    summaries_pending: set[Key]
    traces: list[tuple[str, int, WindowTrace]]
    traces_pending: set[Key]
    threshold: float
    unopened: str | None
    stopped_at: int | None
    cut: str | None
    trigger: AutoTrigger | None
    marks: dict[str, RegressionEntry]
    profiles: dict[str, WindowProfile]
    counted_slower: bool
    roles: dict[str, str]
    primary: str | None
    changes: int
    optimizer_steps: dict[str, tuple[int, int]] = {}  # (a file written before it: none)


class MarksFile(msgspec.Struct, tag="marks", tag_field="kind"):
    """A recorded window's marks as they are now (they change when a later window confirms)."""

    version: int
    run: str
    window: int
    marks: dict[str, RegressionEntry]
    counted_slower: bool


class TrainerFile(msgspec.Struct):
    """A trainer as ``status()`` lists it (its actor handles are not recorded)."""

    trainer_id: str
    role: str
    ranks: list[int]
    run_dir: str | None


PhaseRecord = tuple[int, float, dict[str, float]]


class PhaseChunk(msgspec.Struct, tag="phases", tag_field="kind"):
    """Steps' phase times, as ``PhaseLog.add`` took them, in step order; ``lost``: steps the
    coordinator kept no longer when this chunk was made (none unless the record fell behind)."""

    version: int
    run: str
    n: int
    records: list[PhaseRecord]
    lost: int = 0


class StallFile(msgspec.Struct, tag="stall", tag_field="kind"):
    """A stall and the grouped stacks taken during it (``status()["stalls"]``)."""

    version: int
    run: str
    stall: StallEntry


class RunFile(msgspec.Struct, tag="run", tag_field="kind"):
    """The run: written at its start, at each window and stop, and every few seconds while it
    steps (its step counter)."""

    version: int
    name: str
    config: dict[str, Any]
    run_dir: str | None
    lifecycle: str
    created_at: float
    started_at: float | None
    ended_at: float | None
    ended_reason: str | None
    baseline: int | None
    global_step: int | None
    stepping_trainer: str | None
    trainers: list[TrainerFile]
    counters: dict[str, int]
    rank_counts: dict[str, int]
    skipped_windows: int
    next_window: int
    """The index the run's next window gets (a restored run goes on from it)."""
    windows: list[int]
    """The windows recorded (``windows/``), in order."""
    phase_chunks: int
    steps_recorded: int
    stalls: list[int]
    written_at: float
    nodes: dict[str, str] = {}
    """The name of each node its windows' traces were written on, by Ray node id (a merged
    timeline made from the record names its ranks' nodes as the live one does; a file written
    before it: none)."""


RecordFile = RunFile | WindowFile | MarksFile | PhaseChunk | StallFile
_DECODER = msgspec.msgpack.Decoder(RecordFile)
_TAG = msgspec.msgpack.Decoder(_Tag)
_ENCODER = msgspec.msgpack.Encoder()


def encode(item: RecordFile) -> bytes:
    """One record file's bytes."""
    return _ENCODER.encode(item)


def decode(blob: bytes, where: str = "a record file") -> RecordFile:
    """A record file from its bytes; RecordError saying what is wrong with it."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise RecordError(f"{where}: expected bytes, got {type(blob).__name__}")
    if len(blob) > MAX_FILE_BYTES:
        raise RecordError(f"{where}: {len(blob)} bytes, over the {MAX_FILE_BYTES} read")
    try:
        tag = _TAG.decode(blob)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RecordError(f"{where}: not a record file ({exc})") from None
    if tag.version != VERSION:
        raise RecordError(
            f"{where}: record version {tag.version}; this reader knows version {VERSION}"
        )
    try:
        return _DECODER.decode(blob)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RecordError(f"{where}: malformed {tag.kind!r} file ({exc})") from None


# ------------------------------------------------------------------ windows


_RECORD_CACHES = ("_parts_cache",)
_AGGREGATE_LEFT_OUT = ("_stragglers", "_folding")
"""An aggregate's fields not recorded: a cache (made again when asked), and the ranks of a
partial being folded (none once the window settled)."""


def window_file(run: str, rec: WindowRecord) -> WindowFile:
    """A settled window's file (``rec`` a snapshot: nothing changes it meanwhile)."""
    traces = [(tid, rank, t) for (tid, rank), t in sorted(rec.traces.items())]
    return WindowFile(
        version=VERSION,
        run=run,
        window=_span(rec.window),
        planned=_span(rec.planned) if rec.planned is not None else None,
        participants=set(rec.participants),
        acked=set(rec.acked),
        steps=rec.steps,
        partial=rec.partial,
        closed=rec.closed,
        trace_dirs=dict(rec.trace_dirs),
        aggregates={t: aggregate_file(a) for t, a in rec.aggregates.items()},
        summaries_pending=set(rec.summaries_pending),
        traces=traces,
        traces_pending=set(rec.traces_pending),
        threshold=rec.threshold,
        unopened=rec.unopened,
        stopped_at=rec.stopped_at,
        cut=rec.cut,
        trigger=rec.trigger,
        marks=dict(getattr(rec, "marks", {})),
        profiles=dict(getattr(rec, "profiles", {})),
        counted_slower=getattr(rec, "counted_slower", False),
        roles=dict(getattr(rec, "roles", {})),
        primary=getattr(rec, "primary", None),
        changes=getattr(rec, "changes", 0),
        optimizer_steps=dict(getattr(rec, "optimizer_steps", {})),
    )


def window_record(f: WindowFile) -> WindowRecord:
    """The ``WindowRecord`` a window's file holds."""
    rec = WindowRecord(window=_window(f.window))
    fields = {name: getattr(f, name) for name in f.__struct_fields__}
    for name in ("version", "run"):
        del fields[name]
    fields.update(
        window=_window(f.window),
        planned=_window(f.planned) if f.planned is not None else None,
        aggregates={t: window_aggregate(a) for t, a in f.aggregates.items()},
        traces={(tid, rank): t for tid, rank, t in f.traces},
    )
    rec.__dict__.update(fields)
    return rec


def aggregate_file(agg: WindowAggregate) -> AggregateFile:
    """An aggregate's figures as recorded (its per-rank values too, while it keeps them)."""
    agg.step_sums()  # (an aggregate from an older checkpoint has none)
    f = msgspec.convert(agg, AggregateFile, from_attributes=True)
    for table in (f._kernels, f._memory, f.gpu.ops, f.gpu.op_cpu):
        table.total, table.sumsq = _digits(table.total), _digits(table.sumsq)
    return f


_INT64 = 2**63


def _digits(xs: list[BigInt]) -> list[BigInt]:
    """``xs`` with each int msgpack cannot hold as its decimal digits."""
    return [str(x) if isinstance(x, int) and not -_INT64 <= x < _INT64 else x for x in xs]


def _ints(xs: list[BigInt]) -> list[int]:
    """``_digits`` undone; RecordError for digits that are not an int's."""
    try:
        return [x if isinstance(x, int) else int(x, 10) for x in xs]
    except ValueError:
        raise RecordError("a table's sum is neither an int nor an int's digits") from None


def window_aggregate(f: AggregateFile) -> WindowAggregate:
    """The ``WindowAggregate`` an aggregate's file holds."""
    agg = WindowAggregate.__new__(WindowAggregate)
    state = {name: getattr(f, name) for name in f.__struct_fields__}
    gpu = DeviceFigures()
    for name in f.gpu.__struct_fields__:
        setattr(gpu, name, getattr(f.gpu, name))
    gpu.ops, gpu.op_cpu = _table(f.gpu.ops), _table(f.gpu.op_cpu)
    state.update(
        _kernels=_table(f._kernels),
        _memory=_table(f._memory),
        gpu=gpu,
        _stragglers=None,
        _folding=set(),
    )
    agg.__dict__.update(state)
    return agg


def _table(f: RowTableFile) -> RowTable:
    table = RowTable(f.scale)
    for name in f.__struct_fields__:
        setattr(table, name, list(getattr(f, name)) if name != "scale" else f.scale)
    table.total, table.sumsq = _ints(f.total), _ints(f.sumsq)
    table.ids = {name: i for i, name in enumerate(f.names)}
    return table


def _span(w: Window) -> WindowSpan:
    return WindowSpan(w.index, w.warmup_start, w.first, w.last, w.kind)


def _window(s: WindowSpan) -> Window:
    return Window(s.index, s.warmup_start, s.first, s.last, s.kind)


# ------------------------------------------------------------------ the run


def run_file(
    run: Run,
    windows: list[int],
    phase_chunks: int,
    steps_recorded: int,
    stalls: list[int],
    now: float,
    nodes: dict[str, str] | None = None,
) -> RunFile:
    """The run's file (its config with secrets redacted, as ``status()`` shows it)."""
    st = run.state
    trainers = [
        TrainerFile(t.trainer_id, t.role, list(t.ranks), t.run_dir) for t in st.trainers.values()
    ]
    return RunFile(
        version=VERSION,
        name=run.name,
        config=run.config.public_dict(),
        run_dir=run.run_dir,
        lifecycle=run.lifecycle,
        created_at=run.created_at,
        started_at=run.started_at,
        ended_at=run.ended_at,
        ended_reason=run.ended_reason,
        baseline=getattr(run, "baseline", None),
        global_step=st.global_step,
        stepping_trainer=st.stepping_trainer,
        trainers=trainers,
        counters=dict(st.counters),
        rank_counts=rank_counts(st),
        skipped_windows=run.plan.skipped_windows,
        next_window=run.plan.next_index,
        windows=sorted(windows),
        phase_chunks=phase_chunks,
        steps_recorded=steps_recorded,
        stalls=sorted(stalls),
        written_at=now,
        nodes=dict(nodes or {}),
    )
