"""The coordinator actor's shared state and the helpers every part of it uses.

``CoordinatorShell`` holds the current ``Run`` and the runs kept for reading, the lock that
orders the trainer's calls, the pending capture requests, and the checkpoint that lets Ray
restart the actor without losing the run (``coordinator.checkpoint``). ``_refuse`` is the one way
the coordinator says no. The RPCs live in ``coordinator.actor`` (runs, the trainer's steps,
readers), ``coordinator.captures`` and ``coordinator.agent_reports``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from coordinator import checkpoint
from coordinator.config import ProfilerConfig
from coordinator.metrics import CoordinatorMetrics
from coordinator.rank_calls import run_commands
from coordinator.replies import CaptureAnswer, Phase, StepReply
from coordinator.run import Run, new_run
from coordinator.worker_handles import install_worker_handle_stubs

log = logging.getLogger(__name__)

# Configuring a rank warms Kineto up, which took up to 41 s on a loaded 2-core machine.
CONFIGURE_TIMEOUT_S = 120.0
PREVIOUS_RUNS = 8
# Changes that only move the global step, or add a summary, are saved at most this often.
CHECKPOINT_INTERVAL_S = 1.0
Key = tuple[str, int]


@dataclass
class CaptureRequest:
    """A capture waiting for the trainer's next report, which tells where the trainer is."""

    active: int
    warmup: int
    ranks: list[int] | None
    start_step: int | None
    answer: asyncio.Future[CaptureAnswer] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class CoordinatorShell:
    """State and helpers shared by the coordinator's RPCs (see the module docstring)."""

    def __init__(self, config: dict[str, Any], name: str, namespace: str) -> None:
        self._stubs = install_worker_handle_stubs()  # before any worker handle arrives
        self.name, self.namespace = name, namespace
        self.run = new_run(ProfilerConfig.from_dict(config, check_paths=False), set())
        self.previous: collections.deque[Run] = collections.deque(maxlen=PREVIOUS_RUNS)
        self._lock = asyncio.Lock()
        self._metrics = CoordinatorMetrics(name)
        self._requests: list[CaptureRequest] = []
        self._throttled = False  # the stepping trainer waits only on the steps it is told to
        self._next_report_waits = False  # the trainer will wait for its next report's answer
        self._warned: set[str] = set()
        self.restarts = 0
        self.last_restart_at: float | None = None
        self._recovering = False  # restored with a window open: close it on the ranks first
        self._ckpt: dict[str, Any] = {"bytes": 0, "seconds": 0.0, "at": None, "error": None}
        self._dirty = False
        self._progress_dirty = False  # only the step counters moved since the last save
        self._flusher: asyncio.Task[None] | None = None
        self._restore()

    # ------------------------------------------------------------ surviving a restart

    def _restore(self) -> None:
        """After Ray restarts this actor, pick the state up from the last checkpoint; a
        coordinator created anew (not restarted) forgets any older one of its name."""
        try:
            restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        except Exception:
            restarted = False
        if not restarted:
            checkpoint.delete(self.namespace, self.name)
            return
        saved = checkpoint.load(self.namespace, self.name)
        self.restarts = (saved or {}).get("restarts", 0) + 1
        self.last_restart_at = time.time()
        if saved is None:
            log.warning("coordinator %s restarted without a checkpoint", self.name)
            return
        self.run = saved["run"]
        self.previous = collections.deque(saved["previous"], maxlen=PREVIOUS_RUNS)
        self._restore_progress(checkpoint.load(self.namespace, self.name, checkpoint.PROGRESS))
        self._throttled = saved["throttled"]
        self._recovering = self.run.driver.current is not None
        log.warning(
            "coordinator %s restarted (restart %d): run %s at global step %s restored",
            self.name,
            self.restarts,
            self.run.name,
            self.run.state.global_step,
        )

    def _restore_progress(self, progress: dict[str, Any] | None) -> None:
        """Steps outside windows saved after the last full checkpoint of the same run."""
        drv, st = self.run.driver, self.run.state
        if not progress or progress.get("run") != self.run.name:
            return
        last, step = progress.get("last_step"), progress.get("global_step")
        if isinstance(last, int) and (drv.last_step is None or last > drv.last_step):
            drv.last_step, st.global_step = last, step if isinstance(step, int) else last

    async def _recover(self) -> None:
        """A window was open when the coordinator died: close it as partial on every rank
        that still records, so that no torch profiler is left running. Call under the lock."""
        if not self._recovering:
            return
        self._recovering = False
        run = self.run
        rec = run.state.current_window()
        if rec is not None:
            rec.cut = (
                f"the coordinator restarted inside the window (after step {run.driver.last_step})"
            )
        await run_commands(run, run.driver.stop())
        self._save(force=True)

    def _save(self, force: bool = True) -> None:
        """Checkpoint now (``force``), or within ``CHECKPOINT_INTERVAL_S``."""
        self._dirty = True
        if not force:
            self._flush_soon()
            return
        self._dirty = self._progress_dirty = False
        t0 = time.perf_counter()
        try:
            size = checkpoint.save(
                self.namespace,
                self.name,
                {
                    "run": self.run,
                    "previous": list(self.previous),
                    "throttled": self._throttled,
                    "restarts": self.restarts,
                },
            )
            self._ckpt = {
                "bytes": size,
                "seconds": time.perf_counter() - t0,
                "at": time.time(),
                "error": None,
            }
        except Exception as exc:  # a checkpoint that fails costs the restart, never the run
            self._ckpt["error"] = f"{type(exc).__name__}: {exc}"[:500]
            log.warning("checkpoint failed: %s", self._ckpt["error"])

    def _save_progress(self) -> None:
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
        async with self._lock:
            if self._dirty:
                self._save(force=True)
            elif self._progress_dirty:
                self._progress_dirty = False
                progress = {
                    "run": self.run.name,
                    "last_step": self.run.driver.last_step,
                    "global_step": self.run.state.global_step,
                }
                try:
                    checkpoint.save(self.namespace, self.name, progress, checkpoint.PROGRESS)
                except Exception as exc:
                    self._ckpt["error"] = f"{type(exc).__name__}: {exc}"[:500]

    def _find_run(self, name: str | None) -> Run | None:
        if name is None or name == self.run.name:
            return self.run
        return next((r for r in self.previous if r.name == name), None)

    def _report_to(self, trainer_id: str) -> dict[str, str]:
        """Where a rank's node agent sends that rank's summaries and trace reports."""
        return {
            "name": self.name,
            "namespace": self.namespace,
            "trainer_id": trainer_id,
            "run": self.run.name,
        }

    def _not_the_stepping_trainer(self, trainer_id: str, what: str) -> str | None:
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
        return self._refuse(what, why)

    def _refuse(self, what: str, why: str) -> str:
        """The one way the coordinator says no: count it, log the first of its kind, and
        return the reason for the caller's reply."""
        counters = self.run.state.counters
        counters[f"refused_{what}"] += 1
        if counters[f"refused_{what}"] == 1:
            log.warning("%s refused: %s", what, why)
        return why

    def _step_reply(
        self, applied: bool, reason: str | None = None, ignored: str | None = None
    ) -> StepReply:
        self._metrics.export(self.run.state)
        cur = self.run.driver.current
        return {
            "applied": applied,
            "reason": reason,
            "ignored": ignored,  # type: ignore[typeddict-item]
            "run": self.run.name,
            "global_step": self.run.state.global_step,
            "phase": self._phase(),
            "window": cur.index if cur else None,
            "next_sync_step": self._next_sync_step(),
        }

    def _next_sync_step(self) -> int | None:
        """The first step k whose ``step(k)`` makes ranks act, so the trainer must wait for it.

        Reports of earlier steps change no rank's state, and a client may send them without
        waiting (``coordinator.client.StepClient`` does). While a capture request waits to be
        planned, that is the next step. None: no window is planned.
        """
        drv = self.run.driver
        nxt = (drv.last_step + 1) if drv.last_step is not None else 0
        if drv.current is not None or self._requests:
            return nxt
        upcoming = drv.next_window()
        if upcoming is None:
            return None
        return max(nxt, upcoming.warmup_start - 1)

    def _phase(self) -> Phase:
        drv = self.run.driver
        cur = drv.current
        if cur is None:
            return "idle"
        nxt = (drv.last_step + 1) if drv.last_step is not None else 0
        return "warmup" if nxt < cur.first else "recording"

    def _end_requests(self, why: str) -> None:
        """Answer every waiting capture request with ``why`` (the run ended)."""
        requests, self._requests = self._requests, []
        for req in requests:
            if not req.answer.done():
                req.answer.set_result(self._capture_no(f"no steps can be promised: {why}"))

    def _capture_no(self, why: str) -> CaptureAnswer:
        return {
            "accepted": False,
            "reason": self._refuse("capture", why),
            "run": self.run.name,
            "window": None,
            "steps": None,
            "warmup_start": None,
            "ranks": None,
        }
