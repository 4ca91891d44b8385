"""ProfilerCoordinator: the named, detached Ray actor that owns the schedule and the global step.

A thin shell around the pure core: each ``Run`` (``coordinator.run``) holds its config, its
window plan (``WindowDriver``) and its bookkeeping (``CoordinatorState``); the actor receives
calls, asks the run what they mean, fans the rank calls out (``coordinator.rank_calls``) and
answers with the types of ``coordinator.replies``. It never imports torch and never raises a
rank's fault to a trainer. A refused call is answered, never raised: its boolean is False and
``reason`` says why (``_refuse``, the one way the coordinator says no).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import ray

from coordinator.agent_reports import AgentReports
from coordinator.captures import CaptureRPCs
from coordinator.config import ProfilerConfig
from coordinator.rank_calls import any_alive, fan_out, run_commands
from coordinator.replies import (
    KernelSummary,
    Registration,
    RunInfo,
    Status,
    StepReply,
)
from coordinator.run import attach_decision, new_run
from coordinator.shell import CONFIGURE_TIMEOUT_S, Key
from coordinator.state import RankRecord, TrainerRecord
from coordinator.trace_layout import child
from coordinator.validate import (
    is_int,
    rank_handles,
    span,
    step_problem,
    trainer_id_problem,
)
from coordinator.window_driver import Ignored

log = logging.getLogger(__name__)


class _Coordinator(CaptureRPCs, AgentReports):
    """The actor's implementation; use ``get_or_create_coordinator`` to make one."""

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
            no = self._trainer_call_problem(
                trainer_id, "start", ("first_step", first_step), ("throttled", throttled)
            )
            if no:
                return self._step_reply(False, no)
            if self.run.phase == "stopped":
                await self._begin_run(self.run.config, "started again after it stopped", carry=True)
            run = self.run
            run.phase, run.started_at = "running", run.started_at or time.time()
            st = run.state
            st.global_step = first_step - 1 if first_step > 0 else st.global_step
            self._throttled = bool(throttled)
            await run_commands(run, run.driver.start(first_step))
            reply = self._step_reply(True)
            self._expect_next_report(reply, first_step, waited=True)
            self._save()
            return reply

    async def step(self, trainer_id: str, k: int, waiting: bool = True) -> StepReply:
        """Global step ``k`` has finished. Returns once the ranks that act are ready for k+1.

        ``waiting``: the trainer waits for this answer before it runs step k+1 (``StepClient``
        sends reports of idle steps without waiting, and says so).
        """
        async with self._lock:
            await self._recover()
            no = self._trainer_call_problem(trainer_id, "step", ("step", k), ("waiting", waiting))
            if no:
                return self._step_reply(False, no)
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
            changed = bool(result) or run.phase == "configured"
            if run.phase == "configured":
                run.phase, run.started_at = "running", time.time()
            run.state.global_step = k
            await run_commands(run, result)
            reply = self._step_reply(True)
            self._expect_next_report(reply, k + 1, waited=waiting)
            if changed:
                self._save()  # a window opened, moved on or closed: the whole run, now
            else:
                self._save_progress()  # only the step moved: its counters, soon
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
            "run": run.info(),
            "phase": self._phase(),
            "config": run.config.public_dict(),
            "run_dir": run.run_dir,
            "global_step": st.global_step,
            "current_window": cur.to_dict() if cur else None,
            "next_window": nxt.to_dict() if nxt else None,
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
                    "run": r.info(),
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

    def _trainer_call_problem(
        self, trainer_id: str, what: str, step: tuple[str, object], flag: tuple[str, object]
    ) -> str | None:
        """Why a ``start``/``step`` call is refused (its trainer, its step, its flag), or None."""
        no = self._not_the_stepping_trainer(trainer_id, what)
        if no:
            return no
        problem = step_problem(*step)
        if problem is None and not isinstance(flag[1], bool):
            problem = f"{flag[0]} must be True or False, got {flag[1]!r:.80}"
        return self._refuse(what, problem) if problem else None

    def _expect_next_report(self, reply: StepReply, next_step: int, waited: bool) -> None:
        """Whether the trainer will wait for its next report's answer (a capture can then be
        planned at once): always, unless it is throttled; then only if it read this answer
        before running ``next_step`` and that answer told it to wait from ``next_step``."""
        ns = reply["next_sync_step"]
        self._next_report_waits = not self._throttled or (
            waited and ns is not None and ns <= next_step
        )

    async def _join_open_window(self, keys: list[Key]) -> None:
        """Ranks registered while a window is open (a restarted driver) join it now."""
        run = self.run
        rec, cur = run.state.current_window(), run.driver.current
        if rec is None or cur is None or run.driver.last_step is None:
            return
        rec.participants.update(keys)
        w, nxt = cur.to_dict(), run.driver.last_step + 1
        await fan_out(run, keys, "start_profile", lambda _: (w, nxt))


# Ray restarts it after a crash (same name, same handle); it picks its state up from the
# checkpoint. Calls in flight when it died fail; later ones wait for the restart.
ProfilerCoordinator = ray.remote(num_cpus=0, max_restarts=-1)(_Coordinator)
