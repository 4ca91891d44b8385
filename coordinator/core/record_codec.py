"""A run's record in ``save_path``: its files' types, and their strict, versioned codec.

The record is what the coordinator knew of a run, kept beside its traces so that it outlives
the cluster (``docs/api.md#the-runs-record``). Every file is msgpack of one of the types
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
- ``stalls/NNNNNN.msgpack`` (``StallFile``): a stall and its grouped stacks;
- ``memory.msgpack`` (``memory_record.MemoryFile``): every rank's memory over the run, its
  peaks, leak marks and snapshots' notes, as ``memory()`` showed them last (older records:
  none).

The same codec is the coordinator's only persistence, with two back ends: ``save_path``
(fsspec) for a run that outlives its cluster, and Ray's key-value store for a coordinator Ray
restarts, which also keeps a run's live parts (``state_codec``: the plan, the ranks, the
trainers, the window still open). One reader (``service.record_reader.open_record``) restores
both.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec

from coordinator.core.aggregate import restored_aggregate, saved_aggregate
from coordinator.core.marks import WindowProfile
from coordinator.core.memory_record import MemoryFile, oversized
from coordinator.core.msgpack_head import array_length
from coordinator.core.record_fields import (
    MAX_KEYS,
    MAX_TRAINERS,
    Keys,
    Name,
    Node,
    Path,
    Ranks,
    RunName,
    Traces,
)
from coordinator.core.records import WindowRecord
from coordinator.core.run import Run
from coordinator.core.saved import (
    AggregateFile,
    SavedError,
    WindowSpan,
)
from coordinator.core.state import rank_counts
from coordinator.core.state_codec import (
    CoordinatorFile,
    ProgressFile,
    RanksChunk,
    RanksChunkOut,
    RunState,
    TrainersFile,
    from_span,
    to_span,
)
from coordinator.protocol.replies import AutoTrigger, RegressionEntry
from coordinator.protocol.stack_replies import StallEntry

VERSION = 1
MAX_FILE_BYTES = 64 * 1024 * 1024
"""The largest record file read: a window of 10,000 ranks is about 8 MB, and reading one costs
about 5x its size (``tests/test_record_trust.py`` measures it). The costliest shape, millions
of ranks' keys (about 15x its size in memory), is refused before it is decoded: a window file
lists at most ``MAX_KEYS`` keys in all its rank sets together (``window_keys``). Every field's
limits: ``record_fields``."""
Kind = Literal[
    "run", "window", "marks", "phases", "stall", "state", "ranks", "trainers", "coordinator",
    "progress", "memory",
]  # fmt: skip


class RecordError(ValueError):
    """A record file that is malformed, oversized, of another kind or of an unknown version."""


class _Tag(msgspec.Struct):
    """What every record file starts with (read first, to name a file of another version)."""

    kind: str
    version: int


T = TypeVar("T")
PerTrainer = Annotated[dict[Name, T], msgspec.Meta(max_length=MAX_TRAINERS)]
"""A map trainer id -> a ``T`` (at most ``MAX_TRAINERS``)."""


class WindowFile(msgspec.Struct, tag="window", tag_field="kind"):
    """A settled window (``WindowRecord``), written once."""

    version: int
    run: RunName
    window: WindowSpan
    planned: WindowSpan | None
    participants: Keys
    acked: Keys
    steps: tuple[int, int] | None
    partial: bool
    closed: bool
    trace_dirs: PerTrainer[Path]
    aggregates: PerTrainer[AggregateFile]
    summaries_pending: Keys
    traces: Traces
    traces_pending: Keys
    threshold: float
    unopened: str | None
    stopped_at: int | None
    cut: str | None
    trigger: AutoTrigger | None
    marks: PerTrainer[RegressionEntry]
    profiles: PerTrainer[WindowProfile]
    counted_slower: bool
    roles: PerTrainer[Name]
    primary: Name | None
    changes: int
    optimizer_steps: PerTrainer[tuple[int, int]] = {}  # (a file written before it: none)
    opened_at: float | None = None  # wall clock: the memory chart's band (older files: none)
    closed_at: float | None = None


class MarksFile(msgspec.Struct, tag="marks", tag_field="kind"):
    """A recorded window's marks as they are now (they change when a later window confirms)."""

    version: int
    run: RunName
    window: int
    marks: PerTrainer[RegressionEntry]
    counted_slower: bool


class TrainerFile(msgspec.Struct):
    """A trainer as ``status()`` lists it (its actor handles are not recorded)."""

    trainer_id: Name
    role: Name
    ranks: Ranks
    run_dir: Path | None


PhaseRecord = tuple[int, float, dict[str, float]]


class PhaseChunk(msgspec.Struct, tag="phases", tag_field="kind"):
    """Steps' phase times, as ``PhaseLog.add`` took them, in step order; ``lost``: steps the
    coordinator kept no longer when this chunk was made (none unless the record fell behind)."""

    version: int
    run: RunName
    n: int
    records: list[PhaseRecord]
    lost: int = 0


class StallFile(msgspec.Struct, tag="stall", tag_field="kind"):
    """A stall and the grouped stacks taken during it (``status()["stalls"]``)."""

    version: int
    run: RunName
    stall: StallEntry


class RunFile(msgspec.Struct, tag="run", tag_field="kind"):
    """The run: written at its start, at each window and stop, and every few seconds while it
    steps (its step counter)."""

    version: int
    name: RunName
    config: dict[str, Any]
    run_dir: Path | None
    lifecycle: str
    created_at: float
    started_at: float | None
    ended_at: float | None
    ended_reason: str | None
    baseline: int | None
    global_step: int | None
    stepping_trainer: Name | None
    trainers: Annotated[list[TrainerFile], msgspec.Meta(max_length=MAX_TRAINERS)]
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
    nodes: Annotated[dict[Node, Node], msgspec.Meta(max_length=1 << 20)] = {}
    """The name of each node its windows' traces were written on, by Ray node id (a merged
    timeline made from the record names its ranks' nodes as the live one does; a file written
    before it: none)."""


RecordFile = (
    RunFile | WindowFile | MarksFile | PhaseChunk | StallFile
    | RunState | RanksChunk | TrainersFile | CoordinatorFile | ProgressFile | MemoryFile
)  # fmt: skip
_DECODER = msgspec.msgpack.Decoder(RecordFile)
_TAG = msgspec.msgpack.Decoder(_Tag)
_ENCODER = msgspec.msgpack.Encoder()


def encode(item: RecordFile | RanksChunkOut) -> bytes:
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
        if tag.kind == "window" and (keys := window_keys(blob)) > MAX_KEYS:
            raise RecordError(
                f"{where}: malformed 'window' file ({keys} ranks' keys in its rank sets, over "
                f"the {MAX_KEYS} read)"
            )
        if tag.kind == "memory" and (why := oversized(blob)):
            raise RecordError(f"{where}: malformed 'memory' file ({why})")
        return _DECODER.decode(blob)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RecordError(f"{where}: malformed {tag.kind!r} file ({exc})") from None


class _WindowKeys(msgspec.Struct):
    """A window file's rank sets, left undecoded (``msgspec.Raw``: a slice of the file)."""

    participants: msgspec.Raw = msgspec.Raw(b"\x90")
    acked: msgspec.Raw = msgspec.Raw(b"\x90")
    summaries_pending: msgspec.Raw = msgspec.Raw(b"\x90")
    traces: msgspec.Raw = msgspec.Raw(b"\x90")
    traces_pending: msgspec.Raw = msgspec.Raw(b"\x90")


_WINDOW_KEYS = msgspec.msgpack.Decoder(_WindowKeys)


def window_keys(blob: bytes) -> int:
    """How many keys a window file's rank sets hold together, read from their headers alone
    (nothing of them is decoded: a file of millions of keys costs no more than its size)."""
    sets = _WINDOW_KEYS.decode(blob)
    return sum(array_length(getattr(sets, f)) for f in _WindowKeys.__struct_fields__)


# ------------------------------------------------------------------ windows


def window_file(run: str, rec: WindowRecord, detail: bool = True) -> WindowFile:
    """A window's file (``rec`` a snapshot: nothing changes it meanwhile), every field named;
    ``detail``: with its per-rank kernel values (a restart's copy in Ray's KV goes without)."""
    traces = [(tid, rank, t) for (tid, rank), t in sorted(rec.traces.items())]
    return WindowFile(
        version=VERSION,
        run=run,
        window=to_span(rec.window),
        planned=to_span(rec.planned) if rec.planned is not None else None,
        participants=set(rec.participants),
        acked=set(rec.acked),
        steps=rec.steps,
        partial=rec.partial,
        closed=rec.closed,
        trace_dirs=dict(rec.trace_dirs),
        aggregates={t: saved_aggregate(a, detail) for t, a in rec.aggregates.items()},
        summaries_pending=set(rec.summaries_pending),
        traces=traces,
        traces_pending=set(rec.traces_pending),
        threshold=rec.threshold,
        unopened=rec.unopened,
        stopped_at=rec.stopped_at,
        cut=rec.cut,
        trigger=rec.trigger,
        marks=dict(rec.marks),
        profiles=dict(rec.profiles),
        counted_slower=rec.counted_slower,
        roles=dict(rec.roles),
        primary=rec.primary,
        changes=rec.changes,
        optimizer_steps=dict(rec.optimizer_steps),
        opened_at=rec.opened_at,
        closed_at=rec.closed_at,
    )


def window_record(f: WindowFile) -> WindowRecord:
    """The ``WindowRecord`` a window's file holds; RecordError for figures that do not add
    up."""
    try:
        aggregates = {t: restored_aggregate(a) for t, a in f.aggregates.items()}
    except SavedError as exc:
        raise RecordError(str(exc)) from None
    return WindowRecord(
        window=from_span(f.window),
        planned=from_span(f.planned) if f.planned is not None else None,
        participants=set(f.participants),
        acked=set(f.acked),
        steps=f.steps,
        partial=f.partial,
        closed=f.closed,
        trace_dirs=dict(f.trace_dirs),
        aggregates=aggregates,
        summaries_pending=set(f.summaries_pending),
        traces={(tid, rank): t for tid, rank, t in f.traces},
        traces_pending=set(f.traces_pending),
        threshold=f.threshold,
        unopened=f.unopened,
        stopped_at=f.stopped_at,
        cut=f.cut,
        trigger=f.trigger,
        marks=dict(f.marks),
        profiles=dict(f.profiles),
        counted_slower=f.counted_slower,
        roles=dict(f.roles),
        primary=f.primary,
        changes=f.changes,
        optimizer_steps=dict(f.optimizer_steps),
        opened_at=f.opened_at,
        closed_at=f.closed_at,
    )


# ------------------------------------------------------------------ the run


def run_file(
    run: Run,
    windows: list[int],
    phase_chunks: int,
    steps_recorded: int,
    stalls: list[int],
    now: float,
    nodes: dict[str, str] | None = None,
    config: dict[str, Any] | None = None,
) -> RunFile:
    """The run's file (its config with secrets redacted, as ``status()`` shows it; ``config``:
    that ``public_dict()`` when the caller has it)."""
    st = run.state
    trainers = [
        TrainerFile(t.trainer_id, t.role, list(t.ranks), t.run_dir) for t in st.trainers.values()
    ]
    return RunFile(
        version=VERSION,
        name=run.name,
        config=config if config is not None else run.config.public_dict(),
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
