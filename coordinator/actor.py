"""ProfilerCoordinator: the named, detached Ray actor that owns the schedule and the global step.

A thin shell around the pure core: each ``Run`` (``coordinator.run``) holds its config, its
window plan (``WindowDriver``) and its bookkeeping (``CoordinatorState``); the actor receives
calls, asks the run what they mean, fans the rank calls out (``coordinator.rank_calls``) and
answers with the types of ``coordinator.replies``. It never imports torch and never raises a
rank's fault to a trainer. A refused call is answered, never raised: its boolean is False and
``reason`` says why (``_refuse``, the one way the coordinator says no).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from coordinator import checkpoint
from coordinator.config import ProfilerConfig
from coordinator.metrics import CoordinatorMetrics
from coordinator.rank_calls import any_alive, fan_out, run_commands
from coordinator.replies import (
    CancelAnswer,
    CaptureAnswer,
    KernelSummary,
    Phase,
    Registration,
    RunInfo,
    Status,
    StepReply,
)
from coordinator.run import Run, attach_decision, new_run
from coordinator.state import RankRecord, TrainerRecord
from coordinator.trace_layout import child
from coordinator.validate import (
    MAX_SUMMARY_BYTES,
    MAX_WORLD,
    is_int,
    is_number,
    is_rank,
    rank_handles,
    span,
    step_problem,
    trainer_id_problem,
)
from coordinator.window_driver import Ignored
from coordinator.worker_handles import install_worker_handle_stubs

log = logging.getLogger(__name__)

DEFAULT_NAME = "profiler"
DEFAULT_NAMESPACE = "profiler"
# Configuring a rank warms Kineto up, which took up to 41 s on a loaded 2-core machine.
CONFIGURE_TIMEOUT_S = 120.0
# How long request_capture waits for the trainer's next report before it says no.
CAPTURE_REPORT_TIMEOUT_S = 30.0
PREVIOUS_RUNS = 8
# Changes that only move the global step, or add a summary, are saved at most this often.
CHECKPOINT_INTERVAL_S = 1.0
Key = tuple[str, int]


@dataclass
class _CaptureRequest:
    """A capture waiting for the trainer's next report, which tells where the trainer is."""

    active: int
    warmup: int
    ranks: list[int] | None
    start_step: int | None
    answer: asyncio.Future[CaptureAnswer] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class _Coordinator:
    """The actor's implementation; use ``get_or_create_coordinator`` to make one."""

    def __init__(self, config: dict[str, Any], name: str, namespace: str) -> None:
        self._stubs = install_worker_handle_stubs()  # before any worker handle arrives
        self.name, self.namespace = name, namespace
        self.run = new_run(ProfilerConfig.from_dict(config, check_paths=False), set())
        self.previous: collections.deque[Run] = collections.deque(maxlen=PREVIOUS_RUNS)
        self._lock = asyncio.Lock()
        self._metrics = CoordinatorMetrics(name)
        self._requests: list[_CaptureRequest] = []
        self._throttled = False  # the stepping trainer waits only on the steps it is told to
        self._next_report_waits = False  # the trainer will wait for its next report's answer
        self._warned: set[str] = set()
        self.restarts = 0
        self.last_restart_at: float | None = None
        self._recovering = False  # restored with a window open: close it on the ranks first
        self._ckpt: dict[str, Any] = {"bytes": 0, "seconds": 0.0, "at": None, "error": None}
        self._dirty = False
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
        self._throttled = saved["throttled"]
        self._recovering = self.run.driver.current is not None
        log.warning(
            "coordinator %s restarted (restart %d): run %s at global step %s restored",
            self.name,
            self.restarts,
            self.run.name,
            self.run.state.global_step,
        )

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
            if self._flusher is None or self._flusher.done():
                self._flusher = asyncio.ensure_future(self._flush_later())
            return
        self._dirty = False
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

    async def _flush_later(self) -> None:
        await asyncio.sleep(CHECKPOINT_INTERVAL_S)
        if self._dirty:
            async with self._lock:
                if self._dirty:
                    self._save(force=True)

    # ------------------------------------------------------------ runs

    async def open_run(self, config: dict[str, Any], trainer_id: str | None = None) -> RunInfo:
        """Attach to this coordinator: join or resume its run, or begin a fresh one.

        A run that stopped cleanly (or never had a trainer) gives way to a fresh run with
        ``config``; the stepping trainer re-attaching (a restarted driver) resumes its run; a
        run that is still active keeps its config, and another config is a ValueError.
        """
        if not isinstance(config, dict):
            raise ValueError(
                f"config must be a dict of ProfilerConfig fields, got {type(config).__name__}"
            )
        cfg = ProfilerConfig.from_dict(config, check_paths=False)
        if trainer_id is not None and (problem := trainer_id_problem(trainer_id)):
            raise ValueError(problem)
        async with self._lock:
            await self._recover()
            run = self.run
            stepping = run.state.stepping_trainer
            alive = True
            if run.active and stepping is not None and trainer_id != stepping:
                alive = await any_alive(list(run.state.trainers[stepping].handles.values()))
            decision, diff = attach_decision(run, cfg.to_dict(), trainer_id, alive)
            if decision == "conflict":
                raise ValueError(
                    f"profiler coordinator {self.namespace}/{self.name} is serving run "
                    f"{run.name!r} (stepping trainer {stepping!r}, global step "
                    f"{run.state.global_step}), which has not stopped, with another config "
                    f"(fields that differ: {', '.join(diff)}). Give this job its own "
                    "coordinator (ProfilingHooks.attach(..., name='profiler-<job>') or "
                    "get_or_create_coordinator(config, name=...)), or stop that run first"
                )
            if decision == "fresh":
                why = "its stepping trainer is gone without a stop" if run.active else "stopped"
                await self._begin_run(cfg, f"replaced by a new run ({why})")
            elif diff:
                key = f"{self.run.name}:{trainer_id}:{','.join(diff)}"
                if key not in self._warned:
                    self._warned.add(key)
                    log.warning(
                        "trainer %r attached to run %s with another config; the run keeps its "
                        "own (fields that differ: %s)",
                        trainer_id,
                        self.run.name,
                        ", ".join(diff),
                    )
            self._save()
            return {
                "run": self.run.name,
                "run_dir": self.run.run_dir,
                "decision": decision,
                "config": self.run.config.public_dict(),
                "mismatch": diff if decision != "fresh" else [],
            }

    async def _begin_run(self, cfg: ProfilerConfig, why: str, carry: bool = False) -> None:
        """End the current run (kept for reading unless it is empty) and begin a fresh one.

        ``carry``: register the current run's trainers in the new one (a trainer that starts
        again after it stopped).
        """
        old = self.run
        self._end_requests(f"the run {old.name} ended: {why}")
        taken = {r.name for r in self.previous}
        empty = old.phase == "configured" and not old.state.trainers and not old.state.windows
        if not empty:
            if old.phase in ("configured", "running"):
                old.phase, old.ended_at, old.ended_reason = "abandoned", time.time(), why
            for w in old.state.windows.values():
                for agg in w.aggregates.values():
                    agg.drop_detail()
            self.previous.append(old)
            taken.add(old.name)
        self.run = new_run(cfg, taken)
        self._throttled = self._next_report_waits = False
        if carry:
            for t in old.state.trainers.values():
                await self._register(
                    t.trainer_id, t.handles, t.role, t.trainer_id == old.state.stepping_trainer
                )

    def _find_run(self, name: str | None) -> Run | None:
        if name is None or name == self.run.name:
            return self.run
        return next((r for r in self.previous if r.name == name), None)

    # ------------------------------------------------------------ trainer API

    async def register(
        self,
        trainer_id: str,
        workers: list[Any] | dict[int, Any],
        role: str = "policy",
        advances_step: bool | None = None,
    ) -> Registration:
        """Register a trainer's workers (a list in rank order, or {rank: handle}).

        The first trainer advances the global step unless another registers with
        ``advances_step=True``. Re-registering a ``trainer_id`` replaces its handles and keeps
        the global step and the window history. Raises ValueError for a bad registration.
        """
        async with self._lock:
            await self._recover()
            reply = await self._register(trainer_id, workers, role, advances_step)
            self._save()
            return reply

    async def _register(
        self, trainer_id: str, workers: Any, role: str, advances_step: bool | None
    ) -> Registration:
        problem = trainer_id_problem(trainer_id)
        if problem:
            raise ValueError(problem)
        handles = rank_handles(trainer_id, workers)
        odd = [r for r, h in handles.items() if not isinstance(h, ray.actor.ActorHandle)]
        if odd:
            raise ValueError(
                f"trainer {trainer_id!r}: the workers of ranks {span(sorted(odd))} are not Ray "
                "actor handles"
            )
        if not isinstance(role, str) or len(role) > 64:
            raise ValueError(f"role must be a string of at most 64 characters, got {role!r:.80}")
        if advances_step is not None and not isinstance(advances_step, bool):
            raise ValueError(
                f"advances_step must be True, False or None, got {advances_step!r:.80}"
            )
        run, world = self.run, sorted(handles)
        cfg, st = run.config, run.state
        if cfg.ranks != "all":
            outside = [r for r in cfg.ranks if r not in handles]
            if outside:
                raise ValueError(
                    f"profiler config selects ranks {outside}, which trainer {trainer_id!r} "
                    f"does not have (its ranks: {span(world)})"
                )
        existing = st.trainers.get(trainer_id)
        run_dir = run.run_dir
        if existing is not None:
            run_dir = existing.run_dir
        elif st.trainers and run.run_dir is not None:
            run_dir = child(run.run_dir, trainer_id)  # a second trainer: its own directory
        st.trainers[trainer_id] = TrainerRecord(trainer_id, role, world, handles, run_dir)
        if advances_step or st.stepping_trainer is None:
            st.stepping_trainer = trainer_id
        for key in [k for k in st.ranks if k[0] == trainer_id]:
            del st.ranks[key]
        keys = []
        for r in world:
            selected = cfg.enable and cfg.selects(r)
            st.ranks[(trainer_id, r)] = RankRecord(trainer_id, r, selected)
            if selected:
                keys.append((trainer_id, r))
        st.counters["registrations"] += 1
        cfg_dict, report_to = cfg.to_dict(), self._report_to(trainer_id)
        await fan_out(
            run,
            keys,
            "configure_profiler",
            lambda key: (key[1], cfg_dict, run_dir, True, report_to),
            timeout=max(CONFIGURE_TIMEOUT_S, cfg.worker_timeout_s),
        )
        await self._join_open_window(keys)
        return {
            "trainer_id": trainer_id,
            "advances_step": st.stepping_trainer == trainer_id,
            "world_size": len(world),
            "selected_ranks": [r for _, r in keys],
            "run": run.name,
            "run_dir": run_dir,
        }

    async def start(
        self, trainer_id: str, first_step: int = 0, throttled: bool = False
    ) -> StepReply:
        """Before the loop: the next step to run is ``first_step`` (the loaded step on resume).

        ``throttled``: the trainer waits only for the reports of the steps it is told to
        (``next_sync_step`` and on), as ``StepClient`` does; otherwise it waits for every one.
        A start after the run stopped begins a fresh run with the same config and trainers.
        """
        async with self._lock:
            await self._recover()
            no = self._not_the_stepping_trainer(trainer_id, "start")
            if no:
                return self._step_reply(False, no)
            problem = step_problem("first_step", first_step)
            if problem or not isinstance(throttled, bool):
                why = problem or f"throttled must be True or False, got {throttled!r:.80}"
                return self._step_reply(False, self._refuse("start", why))
            if self.run.phase == "stopped":
                await self._begin_run(self.run.config, "started again after it stopped", carry=True)
            run = self.run
            run.phase, run.started_at = "running", run.started_at or time.time()
            st = run.state
            st.global_step = first_step - 1 if first_step > 0 else st.global_step
            self._throttled = bool(throttled)
            await run_commands(run, run.driver.start(first_step))
            reply = self._step_reply(True)
            ns = reply["next_sync_step"]
            self._next_report_waits = not self._throttled or (ns is not None and ns <= first_step)
            self._save()
            return reply

    async def step(self, trainer_id: str, k: int, waiting: bool = True) -> StepReply:
        """Global step ``k`` has finished. Returns once the ranks that act are ready for k+1.

        ``waiting``: the trainer waits for this answer before it runs step k+1 (``StepClient``
        sends reports of idle steps without waiting, and says so).
        """
        async with self._lock:
            await self._recover()
            no = self._not_the_stepping_trainer(trainer_id, "step")
            if no:
                return self._step_reply(False, no)
            problem = step_problem("step", k)
            if problem or not isinstance(waiting, bool):
                why = problem or f"waiting must be True or False, got {waiting!r:.80}"
                return self._step_reply(False, self._refuse("step", why))
            run = self.run
            if run.phase == "stopped":
                return self._step_reply(
                    False,
                    self._refuse(
                        "step", f"the run {run.name} stopped; start() begins a new run first"
                    ),
                )
            drv = run.driver
            fresh = drv.last_step is None or k > drv.last_step
            if waiting and fresh and self._requests:
                await self._plan_requests()  # the trainer waits: it runs k+1 only after this
            result = drv.step(k)
            if isinstance(result, Ignored):
                run.state.counters["ignored_steps"] += 1
                run.state.counters[f"ignored_steps_{result.reason}"] += 1
                return self._step_reply(False, ignored=result.reason)
            if run.phase == "configured":
                run.phase, run.started_at = "running", time.time()
            run.state.global_step = k
            await run_commands(run, result)
            reply = self._step_reply(True)
            ns = reply["next_sync_step"]
            self._next_report_waits = not self._throttled or (
                bool(waiting) and ns is not None and ns <= k + 1
            )
            self._save(force=bool(result))  # a window changed: now; only the step: soon
            return reply

    async def stop(self, trainer_id: str) -> StepReply:
        """After the loop: close an open window (partial), end the captures that never opened,
        collect the summaries still pending, and end the run. Safe to call twice, without
        start, and after a failure."""
        async with self._lock:
            await self._recover()
            no = self._not_the_stepping_trainer(trainer_id, "stop")
            if no:
                return self._step_reply(False, no)
            run = self.run
            if run.phase != "running":
                return self._step_reply(True)  # nothing started, or stopped already
            st = run.state
            await run_commands(run, run.driver.stop())
            why = f"the run stopped at step {st.global_step}"
            for w in run.driver.drop_captures():
                st.never_opened(w, f"{why} before the window opened")
                run.capture_ranks.pop(w.index, None)
            self._end_requests(why)
            pending = sorted({k for w in st.windows.values() for k in w.pending})
            if pending:
                wait_s = min(30.0, run.config.worker_timeout_s / 2)
                await fan_out(run, pending, "dump_profiler_summary", lambda _: (wait_s,))
            run.phase, run.ended_at, run.ended_reason = "stopped", time.time(), why
            self._save()
            return self._step_reply(True)

    # ------------------------------------------------------------ captures

    async def request_capture(
        self,
        active: int = 1,
        warmup: int = 1,
        ranks: list[int] | None = None,
        start_step: int | None = None,
        wait_s: float = CAPTURE_REPORT_TIMEOUT_S,
    ) -> CaptureAnswer:
        """Profile ``active`` steps from ``start_step`` (default: as soon as possible).

        The answer names exactly the steps every selected rank records. To promise them, the
        coordinator must know where the trainer is: if the trainer will wait for its next
        report's answer, the capture is planned at once; otherwise this waits (at most
        ``wait_s``) for the trainer's next report, which it tells to wait. ``ranks=None``
        means the configured ranks.
        """
        cap = self.run.config.max_capture_steps
        for name, value, low in (("active", active, 1), ("warmup", warmup, 0)):
            if not is_int(value) or not low <= value <= cap:
                return self._capture_no(
                    f"{name} must be an int in {low}..{cap} (max_capture_steps), got {value!r:.80}"
                )
        if active + warmup > cap:
            return self._capture_no(
                f"warmup + active = {active + warmup} steps, more than max_capture_steps ({cap})"
            )
        if start_step is not None and (problem := step_problem("start_step", start_step)):
            return self._capture_no(problem)
        if ranks is not None and (
            not isinstance(ranks, (list, tuple))
            or len(ranks) > MAX_WORLD
            or not all(is_rank(r) for r in ranks)
        ):
            return self._capture_no(
                f"ranks must be None or a list of ints in 0..{MAX_WORLD - 1}, got {ranks!r:.80}"
            )
        if not is_number(wait_s) or not 0 < wait_s <= 3600:
            return self._capture_no(f"wait_s must be a number in (0, 3600], got {wait_s!r:.80}")
        req = _CaptureRequest(active, warmup, None if ranks is None else list(ranks), start_step)
        async with self._lock:
            no = self._capture_refusal(req)
            if no:
                return self._capture_no(no)
            if self._next_report_waits:
                return await self._plan(req)
            self._requests.append(req)
        try:
            return await asyncio.wait_for(asyncio.shield(req.answer), wait_s)
        except asyncio.TimeoutError:
            async with self._lock:
                if req.answer.done():
                    return req.answer.result()
                self._requests.remove(req)
            return self._capture_no(
                f"the trainer reported no step within {wait_s:g} s, so no steps can be promised "
                "(is it in a long step, or stalled?); ask again"
            )

    def _capture_refusal(self, req: _CaptureRequest) -> str | None:
        """Why ``req`` cannot be planned now, or None."""
        run, st = self.run, self.run.state
        tid = st.stepping_trainer
        if tid is None:
            return "no trainer is registered with the coordinator"
        if not run.config.enable:
            return "profiling is disabled in this coordinator's config"
        if run.phase == "stopped":
            return f"no trainer is running: {run.ended_reason}"
        if run.phase != "running":
            return f"no trainer is running: trainer {tid!r} has not started"
        world = st.trainers[tid].ranks
        if req.ranks is not None:
            unknown = sorted(set(req.ranks) - set(world))
            if unknown:
                return f"unknown ranks {unknown}: trainer {tid!r} has ranks {span(world)}"
        keys = self._capture_keys(req)
        down = [r for (t, r) in keys if st.ranks[(t, r)].selected and not st.ranks[(t, r)].active]
        if down:
            return f"ranks {down} cannot profile: " + "; ".join(
                f"rank {r} is {st.ranks[(tid, r)].state}" for r in down
            )
        return None

    def _capture_keys(self, req: _CaptureRequest) -> list[Key]:
        st = self.run.state
        tid = st.stepping_trainer
        assert tid is not None
        world = st.trainers[tid].ranks
        wanted = (
            [r for r in world if self.run.config.selects(r)]
            if req.ranks is None
            else sorted(set(req.ranks))
        )
        return [(tid, r) for r in wanted]

    async def _plan(self, req: _CaptureRequest) -> CaptureAnswer:
        """Plan ``req`` now: the trainer learns of it before it runs another step."""
        run = self.run
        no = self._capture_refusal(req)
        if no:
            return self._capture_no(no)
        planned = run.driver.request_capture(req.warmup, req.active, req.start_step)
        if isinstance(planned, str):
            return self._capture_no(planned)
        keys = self._capture_keys(req)
        await self._configure_for_capture(keys)
        run.capture_ranks[planned.index] = keys
        run.state.counters["captures_requested"] += 1
        self._save()
        return {
            "accepted": True,
            "reason": None,
            "run": run.name,
            "window": planned.index,
            "steps": [planned.first, planned.last],
            "warmup_start": planned.warmup_start,
            "ranks": [r for _, r in keys],
        }

    async def _plan_requests(self) -> None:
        requests, self._requests = self._requests, []
        for req in requests:
            if not req.answer.done():
                req.answer.set_result(await self._plan(req))

    def _end_requests(self, why: str) -> None:
        requests, self._requests = self._requests, []
        for req in requests:
            if not req.answer.done():
                req.answer.set_result(self._capture_no(f"no steps can be promised: {why}"))

    async def cancel_capture(self, window: int) -> CancelAnswer:
        """Drop a requested capture that has not opened yet."""
        async with self._lock:
            if not is_int(window):
                return {
                    "cancelled": False,
                    "reason": self._refuse("cancel", f"window must be an int, got {window!r:.80}"),
                    "window": -1,
                }
            why = self.run.driver.cancel_capture(window)
            if why is not None:
                return {"cancelled": False, "reason": self._refuse("cancel", why), "window": window}
            self.run.capture_ranks.pop(window, None)
            self.run.state.counters["captures_cancelled"] += 1
            self._save()
            return {"cancelled": True, "reason": None, "window": window}

    async def _configure_for_capture(self, keys: list[Key]) -> None:
        """Ranks the config does not select are configured for this capture only."""
        run = self.run
        st = run.state
        fresh = [k for k in keys if not st.ranks[k].selected]
        if not fresh:
            return
        for key in fresh:
            st.ranks[key].selected = True
        tid = fresh[0][0]
        report_to, run_dir = self._report_to(tid), st.trainers[tid].run_dir
        base = run.config.to_dict()
        await fan_out(
            run,
            fresh,
            "configure_profiler",
            lambda key: (key[1], {**base, "ranks": [key[1]]}, run_dir, False, report_to),
            timeout=max(CONFIGURE_TIMEOUT_S, run.config.worker_timeout_s),
        )

    # ------------------------------------------------------------ node agents report here

    async def ingest_summary(
        self, trainer_id: str, rank: int, blob: bytes, run: str | None = None
    ) -> bool:
        """A rank's summary, pushed by its node agent as soon as it is built.

        True when the coordinator has it, or never will want it (the agent then drops it).
        """
        if not self._reporter_ok(trainer_id, rank, run):
            return True  # nobody will ever want it: do not make the rank keep it
        if not isinstance(blob, (bytes, bytearray)) or len(blob) > MAX_SUMMARY_BYTES:
            size = (
                f"{len(blob)} bytes"
                if isinstance(blob, (bytes, bytearray))
                else type(blob).__name__
            )
            self._refuse("ingest_summary", f"a summary must be bytes, at most 4 MiB; got {size}")
            return True  # refused before it is decoded; sending it again would not help
        target = self._find_run(run)
        key = (trainer_id, rank)
        if target is None or key not in target.state.ranks:
            self.run.state.counters["unexpected_summaries"] += 1
            return True
        target.state.counters["summaries_pushed"] += 1
        target.state.ingest_summary(key, blob)
        self._metrics.export(self.run.state)
        self._save(force=False)
        return True

    async def summary_failed(
        self, trainer_id: str, rank: int, window: int, reason: Any, run: str | None = None
    ) -> bool:
        """A rank's node agent could not build its summary of ``window`` (or died): say why."""
        if not self._reporter_ok(trainer_id, rank, run) or not is_int(window):
            return False
        target = self._find_run(run)
        key = (trainer_id, rank)
        if target is None or key not in target.state.ranks or not isinstance(reason, dict):
            self.run.state.counters["unexpected_summaries"] += 1
            return False
        reason = {str(k): str(v)[:1000] for k, v in list(reason.items())[:8]}
        self._save(force=False)
        return target.state.summary_failed(key, window, reason)

    async def trace_stored(
        self,
        trainer_id: str,
        rank: int,
        window: int,
        path: object,
        error: Any = None,
        run: str | None = None,
        local_path: object = None,
        node: object = None,
    ) -> bool:
        """The node agent finished a rank's trace of ``window``: its final ``path``, or why not."""
        if not self._reporter_ok(trainer_id, rank, run) or not is_int(window):
            return False
        target = self._find_run(run)
        key = (trainer_id, rank)
        if target is None or key not in target.state.ranks:
            self.run.state.counters["unexpected_trace_reports"] += 1
            return False
        if not all(v is None or isinstance(v, str) for v in (path, local_path, node)):
            target.state.counters["unexpected_trace_reports"] += 1
            return False
        if error is not None:
            if not isinstance(error, dict):
                error = {"message": str(error)}
            error = {str(k): str(v)[:1000] for k, v in list(error.items())[:8]}
        self._save(force=False)
        return target.state.trace_stored(
            key,
            window,
            path[:4096] if isinstance(path, str) else None,
            error,
            local_path=local_path[:4096] if isinstance(local_path, str) else None,
            node=node[:128] if isinstance(node, str) else None,
        )

    # ------------------------------------------------------------ readers

    async def status(self) -> Status:
        """Everything about the run, JSON-serialisable; ``coordinator.replies.Status``."""
        if self._recovering:
            async with self._lock:
                await self._recover()
        run = self.run
        st, drv = run.state, run.driver
        cur, nxt = drv.current, drv.next_window()
        return {
            "name": self.name,
            "namespace": self.namespace,
            "run": run.info(),  # type: ignore[typeddict-item]
            "phase": self._phase(),
            "config": run.config.public_dict(),
            "run_dir": run.run_dir,
            "global_step": st.global_step,
            "current_window": cur.to_dict() if cur else None,  # type: ignore[typeddict-item]
            "next_window": nxt.to_dict() if nxt else None,  # type: ignore[typeddict-item]
            "windows": [w.to_dict() for w in st.closed_windows()],
            "trainers": [
                t.to_dict(t.trainer_id == st.stepping_trainer) for t in st.trainers.values()
            ],
            "ranks": [r.to_dict() for r in st.ranks.values()],
            "counters": {
                "worker_rpcs": 0,
                "ignored_steps": 0,
                "skipped_windows": drv.skipped_windows,
                **dict(st.counters),
            },
            "metrics": self._metrics.snapshot(),
            "process": {
                "pid": os.getpid(),
                "torch_loaded": "torch" in sys.modules,
                "worker_handle_stubs": self._stubs,
            },
            "restarts": self.restarts,
            "last_restart": self.last_restart_at,
            "checkpoint": dict(self._ckpt),  # type: ignore[typeddict-item]
            "previous_runs": [
                {
                    "run": r.info(),  # type: ignore[typeddict-item]
                    "config": r.config.public_dict(),
                    "windows": [w.to_dict() for w in r.state.closed_windows()],
                }
                for r in self.previous
            ],
        }

    async def kernel_summary(
        self,
        window: int | None = None,
        top_k: int = 20,
        trainer_id: str | None = None,
        per_rank: bool = False,
        run: str | None = None,
    ) -> KernelSummary:
        """Cross-rank kernel table for the latest closed window, or for ``window``.

        ``per_rank=True`` adds each top kernel's self time on every rank (recent windows only);
        ``run`` names an earlier run of this coordinator (``status()["previous_runs"]``).
        """
        if not is_int(top_k) or not 0 <= top_k <= 100_000:
            raise ValueError(f"top_k must be an int in 0..100000, got {top_k!r:.80}")
        if window is not None and not is_int(window):
            raise ValueError(f"window must be an int or None, got {window!r:.80}")
        if trainer_id is not None and (problem := trainer_id_problem(trainer_id)):
            raise ValueError(problem)
        if not isinstance(per_rank, bool):
            raise ValueError(f"per_rank must be True or False, got {per_rank!r:.80}")
        if run is not None and not isinstance(run, str):
            raise ValueError(f"run must be a run's name or None, got {run!r:.80}")
        target = self._find_run(run)
        if target is None:
            known = [self.run.name, *(r.name for r in self.previous)]
            raise ValueError(f"no run {run!r}: this coordinator keeps {known}")
        out = target.state.kernel_summary(window, top_k, trainer_id, bool(per_rank))
        out["run"] = target.name
        return out

    async def ping(self) -> dict[str, Any]:
        """Cheap liveness check: the current run's name and how often this actor restarted."""
        return {"run": self.run.name, "restarts": self.restarts}

    async def get_config(self) -> dict[str, Any]:
        """The current run's config, credentials redacted."""
        return self.run.config.public_dict()

    # ------------------------------------------------------------ internals

    def _report_to(self, trainer_id: str) -> dict[str, str]:
        """Where a rank's node agent sends that rank's summaries and trace reports."""
        return {
            "name": self.name,
            "namespace": self.namespace,
            "trainer_id": trainer_id,
            "run": self.run.name,
        }

    async def _join_open_window(self, keys: list[Key]) -> None:
        """Ranks registered while a window is open (a restarted driver) join it now."""
        run = self.run
        rec, cur = run.state.current_window(), run.driver.current
        if rec is None or cur is None or run.driver.last_step is None:
            return
        rec.participants.update(keys)
        w, nxt = cur.to_dict(), run.driver.last_step + 1
        await fan_out(run, keys, "start_profile", lambda _: (w, nxt))

    def _reporter_ok(self, trainer_id: object, rank: object, run: object) -> bool:
        """A node agent's report names a trainer, a rank and a run (or None) of plain types."""
        if trainer_id_problem(trainer_id) or not is_rank(rank):
            self.run.state.counters["unexpected_reports"] += 1
            return False
        return run is None or isinstance(run, str)

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


# Ray restarts it after a crash (same name, same handle); it picks its state up from the
# checkpoint. Calls in flight when it died fail; later ones wait for the restart.
ProfilerCoordinator = ray.remote(num_cpus=0, max_restarts=-1)(_Coordinator)
_WARNED: set[tuple[str, str, str]] = set()


def attach_coordinator(
    config: ProfilerConfig | dict[str, Any],
    name: str = DEFAULT_NAME,
    namespace: str = DEFAULT_NAMESPACE,
    trainer_id: str | None = None,
) -> tuple[Any, RunInfo]:
    """The named, detached coordinator (created if it does not exist), attached to a run.

    Returns the handle and the ``RunInfo``: a coordinator whose run stopped begins a fresh run
    with ``config``; a running one keeps its config (``mismatch`` names the fields that differ,
    logged once); ValueError when another active run has another config. Ray must be
    initialised.
    """
    cfg = config if isinstance(config, ProfilerConfig) else ProfilerConfig.from_dict(config)
    cfg.validate()
    if not ray.is_initialized():
        raise RuntimeError("ray is not initialised: call ray.init() before creating the profiler")
    handle = ProfilerCoordinator.options(
        name=name, namespace=namespace, lifetime="detached", get_if_exists=True
    ).remote(cfg.to_dict(), name, namespace)
    info: RunInfo = ray.get(handle.open_run.remote(cfg.to_dict(), trainer_id))
    key = (namespace, name, info["run"])
    if info["mismatch"] and key not in _WARNED:
        _WARNED.add(key)
        log.warning(
            "profiler coordinator %s/%s keeps the config of its running run %s "
            "(fields that differ from yours: %s)",
            namespace,
            name,
            info["run"],
            ", ".join(info["mismatch"]),
        )
    return handle, info


def get_or_create_coordinator(
    config: ProfilerConfig | dict[str, Any],
    name: str = DEFAULT_NAME,
    namespace: str = DEFAULT_NAMESPACE,
    trainer_id: str | None = None,
) -> Any:
    """The named, detached coordinator, attached to a run (see ``attach_coordinator``)."""
    return attach_coordinator(config, name, namespace, trainer_id)[0]


def connect(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE) -> Any:
    """A handle to a running coordinator; ValueError with the name if there is none."""
    if not ray.is_initialized():
        raise RuntimeError("ray is not initialised: call ray.init(address='auto') first")
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError as exc:
        raise ValueError(
            f"no profiler coordinator named {name!r} in namespace {namespace!r}"
        ) from exc


__all__ = [
    "DEFAULT_NAME",
    "DEFAULT_NAMESPACE",
    "ProfilerCoordinator",
    "attach_coordinator",
    "connect",
    "get_or_create_coordinator",
]
