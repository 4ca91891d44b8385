"""The coordinator actor's shared state: what every part of it reads and changes.

``CoordinatorShell`` holds the current ``Run`` and the runs kept for reading, the lock that
orders the trainer's calls, the capture requests waiting for a report, the checkpoint that lets
Ray restart the actor without losing the run, and the event that wakes ``wait_window``. The
parts of the actor (``runs``, ``captures``, ``agent_reports``, ``readers``) each hold the shell;
``coordinator.service.actor`` puts them together. ``refuse`` is the one way the coordinator
says no.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from coordinator.core.config import ProfilerConfig
from coordinator.core.run import Run, new_run
from coordinator.core.stall_watch import StallWatch
from coordinator.core.state_codec import ProgressFile
from coordinator.protocol.memory_replies import MemoryReply
from coordinator.protocol.replies import (
    AttachProblemEntry,
    AutoCaptureEntry,
    AutoTrigger,
    CaptureReply,
    MemoryStatusEntry,
    Phase,
    RecordEntry,
    StallEntry,
    StepReply,
)
from coordinator.raylink.handle_stubs import install_handle_stubs
from coordinator.service import state_store
from coordinator.service.loop_watch import LoopWatch
from coordinator.service.metrics import CoordinatorMetrics
from coordinator.service.node_fanout import NodeFanOut
from coordinator.service.phase_store import PhaseStore
from coordinator.service.rank_calls import run_commands
from coordinator.service.record_reader import Recorded, adopt, new_or_recorded
from coordinator.service.straggler_refresh import StragglerRefresh

log = logging.getLogger(__name__)

# Configuring a rank warms Kineto up, which took up to 41 s on a loaded 2-core machine.
CONFIGURE_TIMEOUT_S = 120.0
PREVIOUS_RUNS = 8
STALL_HISTORY = 16  # stalls kept in status()
ATTACH_PROBLEMS = 32  # attached processes' problems kept in status()
# Changes that only move the global step, or add a summary, are saved at most this often.
CHECKPOINT_INTERVAL_S = 1.0
Key = tuple[str, int]


def no_record() -> RecordEntry:
    """``status()["record"]`` of a coordinator that keeps no record."""
    return {
        "dir": None, "windows": 0, "steps": 0, "files": 0, "bytes": 0, "pending": 0,
        "failures": 0, "dropped": 0, "error": None, "retry_in_s": None, "last_write_at": None,
    }  # fmt: skip


@dataclass
class CaptureRequest:
    """A capture waiting for the trainer's next report, which tells where the trainer is."""

    active: int
    warmup: int
    ranks: list[int] | None
    start_step: int | None
    kind: str = "capture"  # or ``auto``: slow steps, nobody waits for the answer
    trigger: AutoTrigger | None = None
    answer: asyncio.Future[CaptureReply] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class CoordinatorShell:
    """State shared by the coordinator's parts (see the module docstring)."""

    def __init__(self, config: dict[str, Any], name: str, namespace: str) -> None:
        self.stubs = install_handle_stubs()  # before any worker handle arrives
        self.name, self.namespace = name, namespace
        self.run = new_run(ProfilerConfig.from_dict(config, check_paths=False), set())
        self.previous: collections.deque[Run] = collections.deque(maxlen=PREVIOUS_RUNS)
        self.lock = asyncio.Lock()
        self.metrics = CoordinatorMetrics(name)
        self.requests: list[CaptureRequest] = []
        self.throttled = False  # the stepping trainer waits only on the steps it is told to
        self.next_report_waits = False  # the trainer will wait for its next report's answer
        self.warned: set[str] = set()
        self.restarts = 0
        self.last_restart_at: float | None = None
        self.recovering = False  # restored with a window open: stop it on the ranks first
        self.checkpoint = state_store.StateSaver(namespace, name)
        self._dirty = False
        self._progress_dirty = False  # only the step counters moved since the last save
        self._flusher: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self._restore()
        # An agent keeps rank handles and last replies per owner: a restart is a new owner.
        self.nodes = NodeFanOut(f"{namespace}/{name}#{self.restarts}")
        self.loop_watch = LoopWatch()
        # Reads that walk every rank of a large window run here, on a snapshot.
        self.reads = concurrent.futures.ThreadPoolExecutor(1, "profiler-reads")
        self.straggler_refresh = StragglerRefresh(self.reads)
        # status()'s parts of large windows: never queued behind a table a read is building
        self.status_parts = concurrent.futures.ThreadPoolExecutor(1, "profiler-status")
        self.stalls: collections.deque[StallEntry] = collections.deque(maxlen=STALL_HISTORY)
        self.attach_problems = collections.deque[AttachProblemEntry](maxlen=ATTACH_PROBLEMS)
        self._watch: tuple[str, StallWatch] | None = None
        self.phases = PhaseStore(self.refuse, self.metrics.phases)
        # The run's record in save_path (``run_recorder``): told of changes, shown, given memory.
        self.record_soon: Callable[[], None] = lambda: None
        self.record_entry: Callable[[], RecordEntry] = no_record
        self.memory_recorded: Callable[..., Awaitable[MemoryReply | None]] | None = None
        self.memory_entry: Callable[[], MemoryStatusEntry | None] = lambda: None
        self.restored: dict[str, Recorded] = {}  # runs continued from their record, by name
        if not self.restarts:  # created anew: a run its record says did not end goes on
            self.run = self.continue_recorded(*new_or_recorded(self.run.config, set()))

    @property
    def stall_watch(self) -> StallWatch:
        """The stall watchdog's clock for the current run (a new run gets a new one)."""
        if self._watch is None or self._watch[0] != self.run.name:
            cfg = self.run.config
            self._watch = (self.run.name, StallWatch(cfg.stall_factor, cfg.stall_min_s))
        return self._watch[1]

    def continue_recorded(self, run: Run, rec: Recorded | None) -> Run:
        """``run`` (fresh), going on as the recorded run ``rec`` when there is one (windows,
        counters, step, phase times, stalls: ``record_reader.adopt``), its record too."""
        if rec is not None:
            adopt(run, rec)
            self.phases.adopt(run.name, rec.phases)
            self.stalls.extend(rec.stalls)
            self.restored[run.name] = rec
        return run

    # ------------------------------------------------------------ windows changing

    def changed(self) -> None:
        """Something about a window changed: wake every ``wait_window``."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for_change(self, timeout_s: float) -> None:
        """Until the next ``changed()``, or ``timeout_s``."""
        event = self._changed
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except asyncio.TimeoutError:
            return

    # ------------------------------------------------------------ surviving a restart

    def _restore(self) -> None:
        """After Ray restarts this actor, pick the state up from where it was saved (Ray's
        key-value store, read by the record's one reader); a coordinator created anew (not
        restarted) forgets any older one of its name."""
        try:
            restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        except Exception:
            restarted = False
        if not restarted:
            state_store.delete(self.namespace, self.name)
            return
        loaded = self.checkpoint.load()
        self.restarts = (loaded[1] if loaded else {}).get("restarts", 0) + 1
        self.last_restart_at = time.time()
        if not loaded or not loaded[0]:
            log.warning("coordinator %s restarted without a checkpoint", self.name)
            return
        recs, saved = loaded
        for rec in recs:
            if rec.problems:
                log.warning("run %s restored without: %s", rec.run.name, "; ".join(rec.problems))
        runs = [rec.run for rec in recs]
        self.run = runs[0]
        self.previous = collections.deque(runs[1:], maxlen=PREVIOUS_RUNS)
        self.checkpoint.loaded(runs)
        self._restore_progress(state_store.load_progress(self.namespace, self.name))
        self.throttled = saved["throttled"]
        self.recovering = self.run.plan.current is not None
        log.warning(
            "coordinator %s restarted (restart %d): run %s at global step %s restored",
            self.name,
            self.restarts,
            self.run.name,
            self.run.state.global_step,
        )

    def _restore_progress(self, progress: ProgressFile | None) -> None:
        """Steps outside windows saved after the last full save of the same run."""
        plan, st = self.run.plan, self.run.state
        if progress is None or progress.run != self.run.name:
            return
        last, step = progress.last_step, progress.global_step
        if last is not None and (plan.last_step is None or last > plan.last_step):
            plan.last_step, st.global_step = last, step if step is not None else last

    async def recover(self) -> None:
        """A window was open when the coordinator died: stop it as partial on every rank that
        still records, so that no torch profiler is left running. Call under the lock."""
        if not self.recovering:
            return
        self.recovering = False
        run = self.run
        rec = run.state.current_window()
        if rec is not None:
            rec.cut = (
                f"the coordinator restarted inside the window (after step {run.plan.last_step})"
            )
        await run_commands(run, run.plan.stop(), self.nodes)
        self.save()

    # ------------------------------------------------------------ checkpoints

    def save(self, force: bool = True) -> None:
        """Checkpoint now (``force``), or within ``CHECKPOINT_INTERVAL_S``."""
        self._dirty = True
        self.changed()
        self.record_soon()
        if not force:
            self._flush_soon()
            return
        self._dirty = self._progress_dirty = False
        self.checkpoint.save_runs(
            self.run,
            list(self.previous),
            {"throttled": self.throttled, "restarts": self.restarts},
        )

    def save_progress(self) -> None:
        """A step that changed nothing but the step counters: within ``CHECKPOINT_INTERVAL_S``,
        save those (a few bytes), not the whole run."""
        self._progress_dirty = True
        self._flush_soon()

    def _flush_soon(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush_later())

    async def _flush_later(self) -> None:
        await asyncio.sleep(CHECKPOINT_INTERVAL_S)
        if not (self._dirty or self._progress_dirty):
            return
        async with self.lock:
            if self._dirty:
                self.save(force=True)
            elif self._progress_dirty:
                self._progress_dirty = False
                run = self.run
                self.checkpoint.save_progress(run.name, run.plan.last_step, run.state.global_step)

    # ------------------------------------------------------------ helpers

    def refresh_stragglers(self, run: Run, window: int) -> None:
        """A large window's summaries are all in: find its stragglers off the event loop, so
        that ``status()`` can list them (it never computes them for over ``CHEAP_RANKS``)."""
        rec = run.state.windows.get(window)
        if rec is None or rec.summaries_pending:
            return
        for agg in rec.aggregates.values():
            self.straggler_refresh.request(agg, run.state.straggler_threshold)

    def find_run(self, name: str | None) -> Run | None:
        if name is None or name == self.run.name:
            return self.run
        return next((r for r in self.previous if r.name == name), None)

    def report_to(self, trainer_id: str) -> dict[str, str]:
        """Where a rank's node agent sends that rank's summaries and trace reports."""
        return {
            "name": self.name,
            "namespace": self.namespace,
            "trainer_id": trainer_id,
            "run": self.run.name,
        }

    def not_the_stepping_trainer(self, trainer_id: str, what: str) -> str | None:
        st = self.run.state
        if trainer_id == st.stepping_trainer:
            return None
        if st.stepping_trainer is None:
            why = f"no trainer is registered; call register({trainer_id!r}, workers) first"
        else:
            why = (
                f"trainer {trainer_id!r} does not advance the global step; "
                f"{st.stepping_trainer!r} does (register with advances_step=True to take over)"
            )
        return self.refuse(what, why)

    def refuse(self, what: str, why: str) -> str:
        """The one way the coordinator says no: count it, log the first of its kind, and
        return the reason for the caller's reply."""
        counters = self.run.state.counters
        counters[f"refused_{what}"] += 1
        if counters[f"refused_{what}"] == 1:
            log.warning("%s refused: %s", what, why)
        return why

    def step_reply(
        self, applied: bool, reason: str | None = None, ignored: str | None = None
    ) -> StepReply:
        self.metrics.export(self.run.state)
        cur = self.run.plan.current
        return {
            "applied": applied,
            "reason": reason,
            "ignored": ignored,  # type: ignore[typeddict-item]
            "run": self.run.name,
            "global_step": self.run.state.global_step,
            "phase": self.phase(),
            "window": cur.index if cur else None,
            "next_sync_step": self.next_sync_step(),
        }

    def next_sync_step(self) -> int | None:
        """The first step k whose ``step(k)`` makes ranks act, so the trainer must wait for it.

        Reports of earlier steps change no rank's state, and a client may send them without
        waiting (``StepClient`` does). While a capture request waits to be planned, that is
        the next step. None: no window is planned.
        """
        plan = self.run.plan
        nxt = plan.next_boundary
        if plan.current is not None or self.requests:
            return nxt
        upcoming = plan.next_window()
        if upcoming is None:
            return None
        return max(nxt, upcoming.warmup_start - 1)

    def phase(self) -> Phase:
        """Where the open window is: idle, warmup or recording."""
        plan = self.run.plan
        cur = plan.current
        if cur is None:
            return "idle"
        return "warmup" if plan.next_boundary < cur.first else "recording"

    def auto_capture_entry(self) -> AutoCaptureEntry:
        """``status()["auto_capture"]`` of the current run."""
        run = self.run
        seen = run.detector.to_mapping() if run.detector else {}
        return {
            "enabled": run.auto_enabled,
            "source": "config" if run.auto_override is None else "operator",
            "captures": seen.get("captures", 0),
            "max_per_run": run.config.auto_capture.max_per_run,
            "baseline_ms": seen.get("baseline_ms"),
            "recent_ms": seen.get("recent_ms"),
            "slow_steps": seen.get("slow_steps", 0),
            "last_trigger": seen.get("last_trigger"),
        }

    def end_requests(self, why: str) -> None:
        """Answer every waiting capture request with ``why`` (the run ended)."""
        requests, self.requests = self.requests, []
        for req in requests:
            if req.kind == "auto":  # nobody waits for it: dropped with the run
                self.run.state.counters["auto_captures_dropped"] += 1
            elif not req.answer.done():
                req.answer.set_result(self.capture_no(f"no steps can be promised: {why}"))

    def capture_no(self, why: str) -> CaptureReply:
        return {
            "accepted": False,
            "reason": self.refuse("capture", why),
            "run": self.run.name,
            "window": None,
            "steps": None,
            "warmup_start": None,
            "ranks": None,
            "missed": [],
        }
