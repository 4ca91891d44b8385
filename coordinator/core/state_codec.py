"""What a restarted coordinator needs beyond a run's record: the live parts of a run, as
declared structs in the record's own codec (``record_codec``: tagged, versioned msgpack).

A run's record (``run.msgpack``, ``windows/``) says what the run did; these files say where it
stands, so that a coordinator Ray restarts goes on from the same step:

- ``state.msgpack`` (``RunState``): the full config (credentials included: this file is only
  ever written to Ray's key-value store, never to ``save_path``), the window plan, the slowdown
  detector, the captures still to open, the counters;
- ``ranks/NNNNNN.msgpack`` (``RanksChunk``): the rank records, ``RANK_CHUNK`` a file;
- ``trainers.msgpack`` (``TrainersFile``): the trainers' registrations, each rank's actor by
  its id (``handles``: hex, made and looked up again by ``raylink.handles``; never Ray's
  serialized handle, whose decoder trusts its bytes).

Every field is named where it is converted: nothing is read from an object by reflection.
Pure: no Ray, no torch, no I/O.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import msgspec

from coordinator.core.config import ProfilerConfig
from coordinator.core.records import RankRecord, TrainerRecord
from coordinator.core.run import Run
from coordinator.core.saved import WindowSpan
from coordinator.core.schedule import Schedule, Window
from coordinator.core.slowdown import SlowdownDetector
from coordinator.core.spmd_plan import PlannedCapture
from coordinator.core.window_plan import WindowPlan
from coordinator.protocol.replies import AutoTrigger

STATE_VERSION = 1
RANK_CHUNK = 1024
"""Rank records in one file (converted in one turn of the event loop: about 2 ms)."""
Key = tuple[str, int]


class PlanFile(msgspec.Struct):
    """A ``WindowPlan``: where the run's plan stands."""

    last_step: int | None
    current: WindowSpan | None
    next_index: int
    skipped_windows: int
    cursor: WindowSpan | None
    started: bool
    captures: list[WindowSpan]
    promised: dict[int, WindowSpan]
    gaps: set[int]


class DetectorFile(msgspec.Struct):
    """A ``SlowdownDetector``'s estimates (its clock is not kept: a restart forgets it)."""

    first_step: int | None
    excluded_next: bool
    baseline: list[float]
    slow_since: int | None
    slow_steps: int
    recent_ms: float | None
    captures: int
    last_trigger: int | None
    backoff_until: int


class CaptureFile(msgspec.Struct):
    """A ``PlannedCapture`` for SPMD ranks."""

    window: WindowSpan
    keys: list[Key]
    missed: list[tuple[str, int, str]]


class RunState(msgspec.Struct, tag="state", tag_field="kind"):
    """A run's live parts: what its ``run.msgpack`` (the run, its counters, its global step)
    does not hold (see the module docstring)."""

    version: int
    name: str
    config: dict[str, Any]
    """Whole, credentials included (``run.msgpack``'s is redacted)."""
    plan: PlanFile
    detector: DetectorFile | None
    capture_ranks: dict[int, list[Key]]
    spmd_captures: dict[int, CaptureFile]
    auto_triggers: dict[int, AutoTrigger]
    auto_override: bool | None
    ranks_version: int
    windows: list[int]
    """Every window the run keeps, settled or not (``windows/``)."""
    rank_chunks: int
    """The ``ranks/`` files that hold the run's rank records."""


class RankFile(msgspec.Struct):
    """A ``RankRecord``."""

    trainer_id: str
    rank: int
    selected: bool
    state: str
    reason: Any
    device: str | None
    note: str | None
    windows_captured: int
    last_trace_path: str | None
    agent: dict[str, Any] | None
    last_agent_error: dict[str, Any] | None
    node_id: str | None
    pid: int | None
    stack_dump: dict[str, Any] | None
    attached: dict[str, Any] | None


class RanksChunk(msgspec.Struct, tag="ranks", tag_field="kind"):
    """Rank records ``n * RANK_CHUNK`` onwards, as read (``RankFile``: its dicts as they are)."""

    version: int
    run: str
    n: int
    ranks: list[RankFile]


class RanksChunkOut(msgspec.Struct, tag="ranks", tag_field="kind"):
    """``RanksChunk`` as written: ``RankRecord`` is a dataclass of declared public fields, the
    same names as ``RankFile``'s, which msgspec encodes in C (a Python call per record cost
    1.3 ms per 1,024 of the event loop's time)."""

    version: int
    run: str
    n: int
    ranks: list[RankRecord]


class LiveTrainer(msgspec.Struct):
    """A ``TrainerRecord``, with its ranks' actors by id."""

    trainer_id: str
    role: str
    ranks: list[int]
    handles: dict[int, str]
    """rank -> its actor's id (hex)."""
    run_dir: str | None
    driver: dict[str, Any] | None
    spmd: bool
    world: int | None
    attaches: dict[int, int]
    epochs: list[tuple[int, int, int]]
    """(generation, first step, index of the first window) per start of an SPMD group."""


class TrainersFile(msgspec.Struct, tag="trainers", tag_field="kind"):
    """A run's trainers."""

    version: int
    run: str
    trainers: list[LiveTrainer]


class CoordinatorFile(msgspec.Struct, tag="coordinator", tag_field="kind"):
    """The coordinator's own: its runs (the current first), restarts, its step throttle."""

    version: int
    runs: list[str]
    restarts: int
    throttled: bool


class ProgressFile(msgspec.Struct, tag="progress", tag_field="kind"):
    """The step counters, written by steps outside windows instead of the whole run."""

    version: int
    run: str
    last_step: int | None
    global_step: int | None


# ------------------------------------------------------------------ run state


def to_span(w: Window) -> WindowSpan:
    """A window as its files keep it (here and in the run's record)."""
    return WindowSpan(w.index, w.warmup_start, w.first, w.last, w.kind)


def from_span(s: WindowSpan) -> Window:
    return Window(s.index, s.warmup_start, s.first, s.last, s.kind)


def plan_file(plan: WindowPlan) -> PlanFile:
    return PlanFile(
        last_step=plan.last_step,
        current=to_span(plan.current) if plan.current else None,
        next_index=plan.next_index,
        skipped_windows=plan.skipped_windows,
        cursor=to_span(plan.cursor) if plan.cursor else None,
        started=plan.started,
        captures=[to_span(w) for w in plan.captures],
        promised={i: to_span(w) for i, w in plan.promised.items()},
        gaps=set(plan.gaps),
    )


def restore_plan(plan: WindowPlan, f: PlanFile) -> None:
    plan.last_step, plan.next_index = f.last_step, f.next_index
    plan.current = from_span(f.current) if f.current else None
    plan.skipped_windows = f.skipped_windows
    plan.restore_cursor(from_span(f.cursor) if f.cursor else None, f.started)
    plan.captures = [from_span(s) for s in f.captures]
    plan.promised = {i: from_span(s) for i, s in f.promised.items()}
    plan.gaps = set(f.gaps)


def detector_file(d: SlowdownDetector) -> DetectorFile:
    return DetectorFile(
        first_step=d.first_step, excluded_next=d.excluded_next, baseline=list(d.baseline),
        slow_since=d.slow_since, slow_steps=d.slow_steps, recent_ms=d.recent_ms,
        captures=d.captures, last_trigger=d.last_trigger, backoff_until=d.backoff_until,
    )  # fmt: skip


def restore_detector(d: SlowdownDetector, f: DetectorFile) -> None:
    """``f`` put back into ``d`` (its clock forgotten: it came from the old process)."""
    d.first_step, d.last, d.excluded_next = f.first_step, None, f.excluded_next
    d.baseline = collections.deque(f.baseline, maxlen=d.baseline.maxlen)
    d.slow_since, d.slow_steps, d.recent_ms = f.slow_since, f.slow_steps, f.recent_ms
    d.captures, d.last_trigger, d.backoff_until = f.captures, f.last_trigger, f.backoff_until


def run_state(run: Run, rank_chunks: int, config: dict[str, Any] | None = None) -> RunState:
    """``run``'s live parts (its config whole: for Ray's key-value store only; ``config``: its
    ``to_dict()`` when the caller has it)."""
    return RunState(
        version=STATE_VERSION,
        name=run.name,
        config=config if config is not None else run.config.to_dict(),
        plan=plan_file(run.plan),
        detector=detector_file(run.detector) if run.detector is not None else None,
        capture_ranks={i: list(keys) for i, keys in run.capture_ranks.items()},
        spmd_captures={i: _capture_file(c) for i, c in run.spmd_captures.items()},
        auto_triggers=dict(run.auto_triggers),
        auto_override=run.auto_override,
        ranks_version=run.state.ranks_version,
        windows=list(run.state.windows),
        rank_chunks=rank_chunks,
    )


def _capture_file(c: PlannedCapture) -> CaptureFile:
    missed = [(tid, rank, why) for (tid, rank), why in c.missed.items()]
    return CaptureFile(to_span(c.window), list(c.keys), missed)


def apply_state(run: Run, f: RunState) -> None:
    """``run`` (as its ``run.msgpack`` describes it) made whole again with its live parts: its
    config, plan, detector, captures to come (its windows, ranks and trainers are read apart)."""
    config = ProfilerConfig.from_dict(f.config, check_paths=False)
    st = run.state
    run.config, run.plan = config, WindowPlan(Schedule(config))
    st.max_windows, st.detail_windows = config.max_windows, config.detail_windows
    st.straggler_threshold, st.ranks_version = config.straggler_threshold, f.ranks_version
    restore_plan(run.plan, f.plan)
    run.detector = None
    if f.detector is not None:
        run.detector = SlowdownDetector(config.auto_capture)
        restore_detector(run.detector, f.detector)
    run.capture_ranks = {i: [(t, r) for t, r in keys] for i, keys in f.capture_ranks.items()}
    run.spmd_captures = {
        i: PlannedCapture(from_span(c.window), [(t, r) for t, r in c.keys],
                          {(t, r): why for t, r, why in c.missed})
        for i, c in f.spmd_captures.items()
    }  # fmt: skip
    run.auto_triggers = dict(f.auto_triggers)
    run.auto_override = f.auto_override


# ------------------------------------------------------------------ ranks and trainers


def _plain(d: Any) -> dict[str, Any] | None:
    return dict(d) if d is not None else None


def rank_record(f: RankFile) -> RankRecord:
    return RankRecord(
        trainer_id=f.trainer_id, rank=f.rank, selected=f.selected,
        state=f.state,  # type: ignore[arg-type]
        reason=f.reason, device=f.device, note=f.note, windows_captured=f.windows_captured,
        last_trace_path=f.last_trace_path, agent=f.agent,  # type: ignore[arg-type]
        last_agent_error=f.last_agent_error,  # type: ignore[arg-type]
        node_id=f.node_id, pid=f.pid, stack_dump=f.stack_dump,  # type: ignore[arg-type]
        attached=f.attached,  # type: ignore[arg-type]
    )  # fmt: skip


def trainer_file(t: TrainerRecord, dump_handle: Callable[[Any], str]) -> LiveTrainer:
    """``t`` with its handles as ``dump_handle`` names them (their actors' ids)."""
    return LiveTrainer(
        trainer_id=t.trainer_id, role=t.role, ranks=list(t.ranks),
        handles={r: dump_handle(h) for r, h in t.handles.items()}, run_dir=t.run_dir,
        driver=_plain(t.driver), spmd=t.spmd, world=t.world, attaches=dict(t.attaches),
        epochs=[(g, first, index) for (g, first), index in t.epochs.items()],
    )  # fmt: skip


def trainer_record(f: LiveTrainer, handles: dict[str, Any]) -> TrainerRecord:
    """``f`` with the handles found for its actors' ids (``handles``: id -> handle); a rank
    whose actor has none found has no handle."""
    return TrainerRecord(
        trainer_id=f.trainer_id, role=f.role, ranks=list(f.ranks),
        handles={r: handles[i] for r, i in f.handles.items() if i in handles},
        run_dir=f.run_dir,
        driver=f.driver, spmd=f.spmd, world=f.world, attaches=dict(f.attaches),
        epochs={(g, first): index for g, first, index in f.epochs},
    )  # fmt: skip
