"""The trainer's calls: attach to a run, register workers, and ``start`` / ``step`` / ``stop``.

Each call takes the shell's lock, asks the run's pure core what it means (``attach_decision``,
``WindowPlan``), sends the resulting window commands to the ranks (``rank_calls``) and answers
with a declared reply. A refused call is answered, never raised.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray

from coordinator.core.config import ProfilerConfig
from coordinator.core.records import RankRecord, TrainerRecord, WindowRecord
from coordinator.core.roles import outside_ranks, role_ranks
from coordinator.core.run import Run, attach_decision
from coordinator.core.trace_layout import child
from coordinator.core.validate import (
    checked_driver,
    flag_problem,
    rank_handles,
    role_problem,
    span,
    step_problem,
    trainer_id_problem,
)
from coordinator.core.window_plan import Ignored, replay
from coordinator.protocol.replies import OpenRunReply, RegisterReply, StepReply
from coordinator.service.captures import Captures
from coordinator.service.rank_calls import any_alive, fan_out, run_commands
from coordinator.service.record_reader import new_or_recorded
from coordinator.service.shell import CONFIGURE_TIMEOUT_S, CoordinatorShell, Key

log = logging.getLogger(__name__)
FREEZE_RANKS = 1024
"""From this many ranks, a registration freezes what is alive (``LoopWatch.freeze_live``)."""


class RunCalls:
    """``open_run``, ``register``, ``start``, ``step`` and ``stop`` (see the actor's docs)."""

    def __init__(self, shell: CoordinatorShell, captures: Captures) -> None:
        self.shell = shell
        self.captures = captures

    async def open_run(self, config: dict[str, Any], trainer_id: str | None) -> OpenRunReply:
        if not isinstance(config, dict):
            raise ValueError(
                f"config must be a dict of ProfilerConfig fields, got {type(config).__name__}"
            )
        cfg = ProfilerConfig.from_dict(config, check_paths=False)
        if trainer_id is not None and (problem := trainer_id_problem(trainer_id)):
            raise ValueError(problem)
        sh = self.shell
        async with sh.lock:
            await sh.recover()
            run = sh.run
            stepping = run.state.stepping_trainer
            alive = True
            if run.active and stepping is not None and trainer_id != stepping:
                handles = list(run.state.trainers[stepping].handles.values())
                alive = await any_alive(handles) if handles else True  # (SPMD: not known)
            decision, diff = attach_decision(run, cfg.to_dict(), trainer_id, alive)
            if decision == "conflict":
                raise ValueError(self._conflict(diff))
            if decision == "fresh":
                why = "its stepping trainer is gone without a stop" if run.active else "stopped"
                await self.begin_run(cfg, f"replaced by a new run ({why})")
            elif diff:
                self._warn_mismatch(trainer_id, diff)
            sh.save()
            return {
                "run": sh.run.name,
                "run_dir": sh.run.run_dir,
                "decision": decision,
                "config": sh.run.config.public_dict(),
                "mismatch": diff if decision != "fresh" else [],
            }

    def _conflict(self, diff: list[str]) -> str:
        sh, run = self.shell, self.shell.run
        return (
            f"profiler coordinator {sh.namespace}/{sh.name} is serving run "
            f"{run.name!r} (stepping trainer {run.state.stepping_trainer!r}, global step "
            f"{run.state.global_step}), which has not stopped, with another config "
            f"(fields that differ: {', '.join(diff)}). Give this job its own "
            "coordinator (ProfilingHooks.attach(..., name='profiler-<job>') or "
            "get_or_create_coordinator(config, name=...)), or stop that run first"
        )

    def _warn_mismatch(self, trainer_id: str | None, diff: list[str]) -> None:
        sh = self.shell
        key = f"{sh.run.name}:{trainer_id}:{','.join(diff)}"
        if key in sh.warned:
            return
        sh.warned.add(key)
        log.warning(
            "trainer %r attached to run %s with another config; the run keeps its own "
            "(fields that differ: %s)",
            trainer_id,
            sh.run.name,
            ", ".join(diff),
        )

    async def begin_run(self, cfg: ProfilerConfig, why: str, carry: bool = False) -> None:
        """End the current run (kept for reading unless it is empty) and begin a fresh one.

        ``carry``: register the current run's trainers in the new one (a trainer that starts
        again after it stopped).
        """
        sh = self.shell
        old = sh.run
        sh.end_requests(f"the run {old.name} ended: {why}")
        taken = {r.name for r in sh.previous}
        empty = old.lifecycle == "configured" and not old.state.trainers and not old.state.windows
        if not empty:
            if old.lifecycle in ("configured", "running"):
                old.lifecycle, old.ended_at, old.ended_reason = "abandoned", time.time(), why
            for w in old.state.windows.values():
                for agg in w.aggregates.values():
                    agg.drop_detail()
            sh.previous.append(old)
            taken.add(old.name)
        loop = asyncio.get_running_loop()  # (reading a record is I/O: off the event loop)
        sh.run = sh.continue_recorded(
            *await loop.run_in_executor(None, new_or_recorded, cfg, taken)
        )
        sh.throttled = sh.next_report_waits = False
        sh.changed()
        if carry:
            for t in old.state.trainers.values():
                stepping = t.trainer_id == old.state.stepping_trainer
                if t.spmd:  # (its ranks attached themselves: they stay)
                    carry_spmd(old, sh.run, t, stepping)
                    continue
                await self.register_locked(
                    t.trainer_id, t.handles, t.role, stepping, driver=t.driver
                )

    async def register(
        self,
        trainer_id: str,
        workers: Any,
        role: str,
        advances_step: bool | None,
        driver: dict[str, Any] | None = None,
    ) -> RegisterReply:
        sh = self.shell
        sh.loop_watch.start()
        async with sh.lock:
            await sh.recover()
            reply = await self.register_locked(
                trainer_id, workers, role, advances_step, driver=driver
            )
            sh.save()
            if len(sh.run.state.ranks) >= FREEZE_RANKS:  # and what the fan-out and the save
                sh.loop_watch.freeze_live()  # made to stay (the records' dicts, the routes)
            return reply

    async def register_locked(
        self,
        trainer_id: str,
        workers: Any,
        role: str,
        advances_step: bool | None,
        driver: dict[str, Any] | None = None,
    ) -> RegisterReply:
        """``register`` under the lock: check, record the trainer, configure its ranks."""
        handles = _checked_registration(trainer_id, workers, role, advances_step)
        driver = checked_driver(driver)
        run, world = self.shell.run, sorted(handles)
        cfg, st = run.config, run.state
        chosen = role_ranks(cfg.ranks, cfg.roles, role)
        if outside := outside_ranks(chosen, world):
            field = f"roles.{role}.ranks" if role in cfg.roles else "ranks"
            raise ValueError(
                f"profiler config selects {role} ranks {outside} ({field}), which trainer "
                f"{trainer_id!r} does not have (its ranks: {span(world)})"
            )
        run_dir = trainer_run_dir(run.run_dir, st.trainers, trainer_id, role)
        trainer = TrainerRecord(trainer_id, role, world, handles, run_dir, driver)
        keys = st.register(trainer, advances_step, lambda r: cfg.enable and cfg.selects(r, role))
        if len(keys) >= FREEZE_RANKS:  # its records stay: out of the collector's full passes
            self.shell.loop_watch.freeze_live()
        self.shell.nodes.forget([(trainer_id, r) for r in world])  # new handles for the agents
        cfg_dict, report_to = cfg.to_dict(), self.shell.report_to(trainer_id)
        await fan_out(
            run,
            keys,
            "configure_profiler",
            lambda key: (key[1], cfg_dict, run_dir, True, report_to, role),
            timeout=max(CONFIGURE_TIMEOUT_S, cfg.worker_timeout_s),
        )
        if cfg.fanout == "node":  # the agents keep the handles now, not at the first window
            active = [k for k in keys if st.ranks[k].active]
            await self.shell.nodes.adopt(run, active, cfg.worker_timeout_s)
        await self._join_open_window(keys)
        return {
            "trainer_id": trainer_id,
            "advances_step": st.stepping_trainer == trainer_id,
            "world_size": len(world),
            "selected_ranks": [r for _, r in keys],
            "run": run.name,
            "run_dir": run_dir,
        }

    async def _join_open_window(self, keys: list[Key]) -> None:
        """Ranks registered while a window is open (a restarted driver) join it now."""
        run = self.shell.run
        rec, cur = run.state.current_window(), run.plan.current
        if rec is None or cur is None or run.plan.last_step is None:
            return
        rec.participants.update(keys)
        w, nxt = cur.to_dict(), run.plan.last_step + 1
        await fan_out(run, keys, "start_profile", lambda _: (w, nxt))

    async def start(self, trainer_id: str, first_step: int, throttled: bool) -> StepReply:
        sh = self.shell
        async with sh.lock:
            await sh.recover()
            no = self._trainer_call_problem(
                trainer_id, "start", ("first_step", first_step), ("throttled", throttled)
            )
            if no:
                return sh.step_reply(False, no)
            if sh.run.lifecycle == "stopped":
                await self.begin_run(sh.run.config, "started again after it stopped", carry=True)
            run = sh.run
            run.lifecycle, run.started_at = "running", run.started_at or time.time()
            st = run.state
            st.global_step = first_step - 1 if first_step > 0 else st.global_step
            sh.throttled = bool(throttled)
            if run.detector is not None:
                run.detector.restart(first_step)
            _say_why_cut(st.current_window(), first_step)
            await run_commands(run, run.plan.start(first_step), sh.nodes)
            reply = sh.step_reply(True)
            _expect_next_report(sh, reply, first_step, waited=True)
            sh.save()
            return reply

    async def step(
        self, trainer_id: str, k: int, waiting: bool, phases: Any = None, walls: Any = None
    ) -> StepReply:
        arrived = time.monotonic()
        async with self.shell.lock:
            await self.shell.recover()
            return await self.step_locked(trainer_id, k, waiting, phases, walls, arrived)

    async def step_locked(
        self, trainer_id: str, k: int, waiting: bool, phases: Any, walls: Any, arrived: float
    ) -> StepReply:
        """``step``, for a caller that holds the shell's lock (and recovered)."""
        sh = self.shell
        no = self._trainer_call_problem(trainer_id, "step", ("step", k), ("waiting", waiting))
        if no:
            return sh.step_reply(False, no)
        if phases is not None or walls is not None:
            sh.phases.keep(sh.run.name, (r.name for r in sh.previous), phases, walls)
        run = sh.run
        if run.lifecycle == "stopped":
            why = f"the run {run.name} stopped; start() begins a new run first"
            return sh.step_reply(False, sh.refuse("step", why))
        plan = run.plan
        fresh = plan.last_step is None or k > plan.last_step
        if waiting and fresh and sh.requests:
            await self.captures.plan_waiting()  # the trainer waits: it runs k+1 after this
        in_window = plan.current is not None
        spmd = run.state.trainers[trainer_id].spmd  # (its ranks ran every step)
        result = replay(plan, k) if spmd else plan.step(k)
        if isinstance(result, Ignored):
            run.state.counters["ignored_steps"] += 1
            run.state.counters[f"ignored_steps_{result.reason}"] += 1
            return sh.step_reply(False, ignored=result.reason)
        changed = bool(result) or run.lifecycle == "configured"
        if run.lifecycle == "configured":
            run.lifecycle, run.started_at = "running", time.time()
        run.state.global_step = k
        sh.stall_watch.observe(k, arrived)  # a stamp for the stall watchdog's timer
        await run_commands(run, result, sh.nodes)
        self._watch_for_slowdown(k, in_window or bool(result))
        reply = sh.step_reply(True)
        _expect_next_report(sh, reply, k + 1, waited=waiting)
        if changed:
            sh.save()  # a window started, stepped or stopped: the run, now
        else:
            sh.save_progress()  # only the step moved: its counters, soon
        return reply

    async def stop(self, trainer_id: str, why: str | None = None) -> StepReply:
        sh = self.shell
        async with sh.lock:
            await sh.recover()
            no = sh.not_the_stepping_trainer(trainer_id, "stop")
            if no:
                return sh.step_reply(False, no)
            run = sh.run
            if run.lifecycle != "running":
                return sh.step_reply(True)  # nothing started, or stopped already
            st = run.state
            await run_commands(run, run.plan.stop(), sh.nodes)
            why = why or f"the run stopped at step {st.global_step}"
            for w in run.plan.drop_captures():
                st.never_opened(w, f"{why} before the window opened")
                run.capture_ranks.pop(w.index, None)
            sh.end_requests(why)
            pending = sorted({k for w in st.windows.values() for k in w.summaries_pending})
            if pending:
                wait_s = min(30.0, run.config.worker_timeout_s / 2)
                await fan_out(run, pending, "dump_profiler_summary", lambda _: (wait_s,))
            run.lifecycle, run.ended_at, run.ended_reason = "stopped", time.time(), why
            sh.save()
            return sh.step_reply(True)

    def _watch_for_slowdown(self, k: int, in_window: bool) -> None:
        """Time step ``k``'s report; when the run has slowed down, ask for an auto capture
        (planned at the trainer's next waited report, so its steps are exact)."""
        run = self.shell.run
        if run.detector is None:
            return
        trigger = run.detector.observe(k, time.monotonic(), in_window)
        if trigger is None or not run.auto_enabled:
            return
        trigger["region"] = self.shell.phases.log(run.name).grown_region(*trigger["slow_steps"])
        if any(r.active for r in run.state.ranks.values()):  # someone can profile it
            self.captures.request_auto(trigger)

    def _trainer_call_problem(
        self, trainer_id: str, what: str, step: tuple[str, object], flag: tuple[str, object]
    ) -> str | None:
        """Why a ``start``/``step`` call is refused (its trainer, its step, its flag), or None."""
        if no := self.shell.not_the_stepping_trainer(trainer_id, what):
            return no
        problem = step_problem(*step) or flag_problem(*flag)
        return self.shell.refuse(what, problem) if problem else None


def _say_why_cut(open_window: WindowRecord | None, first_step: int) -> None:
    """A window open when the trainer starts again (a restarted driver or worker group) is cut
    by that start: its reason says so."""
    if open_window is not None:
        open_window.cut = f"the trainer started again at step {first_step} inside the window"


def carry_spmd(old: Run, new: Run, t: TrainerRecord, stepping: bool) -> None:
    """An SPMD trainer and its attached ranks, from ``old`` into the fresh run ``new``."""
    run_dir = trainer_run_dir(new.run_dir, new.state.trainers, t.trainer_id, t.role)
    same = TrainerRecord(t.trainer_id, t.role, [], {}, run_dir, spmd=True, world=t.world)
    new.state.register(same, stepping, lambda r: False)
    cfg = new.config
    for r in t.ranks:
        was = old.state.ranks.get((t.trainer_id, r))
        rec = RankRecord(t.trainer_id, r, bool(cfg.enable and cfg.selects(r, t.role)))
        if was is not None:
            rec.node_id, rec.pid, rec.stack_dump = was.node_id, was.pid, was.stack_dump
        new.state.ranks[(t.trainer_id, r)] = rec
    same.ranks = list(t.ranks)


def trainer_run_dir(
    run_dir: str | None, trainers: dict[str, TrainerRecord], trainer_id: str, role: str
) -> str | None:
    """Where a trainer's ranks write: the run directory, in which each window holds one
    sub-directory per role; a second trainer of a role already there gets its own run
    directory inside (``<run>/<trainer_id>``), so no two ranks share a file."""
    existing = trainers.get(trainer_id)
    if existing is not None:
        return existing.run_dir
    if run_dir is not None and any(t.role == role for t in trainers.values()):
        return child(run_dir, trainer_id)
    return run_dir


def _checked_registration(
    trainer_id: str, workers: Any, role: str, advances_step: bool | None
) -> dict[int, Any]:
    """The ``{rank: handle}`` of a registration; ValueError naming what is wrong."""
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
    problem = role_problem(role) or flag_problem("advances_step", advances_step, none_ok=True)
    if problem:
        raise ValueError(problem)
    return handles


def _expect_next_report(
    sh: CoordinatorShell, reply: StepReply, next_step: int, waited: bool
) -> None:
    """Whether the trainer will wait for its next report's answer (a capture can then be
    planned at once): always, unless it is throttled; then only if it read this answer
    before running ``next_step`` and that answer told it to wait from ``next_step``."""
    ns = reply["next_sync_step"]
    sh.next_report_waits = not sh.throttled or (waited and ns is not None and ns <= next_step)
