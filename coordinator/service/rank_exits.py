"""Attached ranks' ends: the last steps of a process that is gone, and the run's end with its job.

An attached process has no loop end to say "the run is over". When rank 0's process ends, however
it ends, its node agent reads the steps it had not reported from its step file
(``worker_ext.agent.exit_watch``) and sends them here (``rank_exited``): the run takes them as a
step report. From then on the coordinator asks Ray's job table, every ``JOB_EVERY_S`` and
slower while it goes on, whether the job of every rank of the trainer has ended; when it has,
the run ends at its last step (``the job of <trainer> ended after step N``), its open window
closed, partial, in ``status()`` and in the record. A job that goes on (a Ray Train group
restarted after a failure attaches again) keeps its run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from coordinator.core.run import Run
from coordinator.core.validate import is_int
from coordinator.raylink.actor_table import ended_jobs
from coordinator.service.runs import RunCalls
from coordinator.service.shell import CoordinatorShell

log = logging.getLogger(__name__)
JOB_EVERY_S = 0.5
JOB_EVERY_MAX_S = 10.0
EndRun = Callable[[str, str], Awaitable[Any]]


class RankExits:
    """``rank_exited``, and the wait for the job's end (see the module docstring)."""

    def __init__(self, shell: CoordinatorShell, runs: RunCalls) -> None:
        self.shell, self._runs = shell, runs
        self._waits: dict[tuple[str, str], asyncio.Task[None]] = {}  # (run, trainer) -> its wait
        self._said: set[str] = set()

    async def exited(
        self,
        trainer_id: str,
        rank: int,
        generation: int,
        last_step: int,
        walls: Any,
        run_name: str | None = None,
        pid: int | None = None,
    ) -> bool:
        """The process ``pid`` of attached rank ``rank`` (its ``generation``), of the run
        ``run_name``, ended after ``last_step``; ``walls``: ``(first_step, [wall_s, ...])`` of
        the steps it had not reported, or None. True when the run took it; False (logged once)
        for another run, a rank the run does not know, an earlier process of the rank, or a
        run that is not running. Checked and stepped under the shell's lock."""
        if not all(is_int(v) for v in (rank, generation, last_step)):
            raise ValueError(f"rank_exited: rank {rank!r}, generation {generation!r} and "
                             f"last_step {last_step!r} must be ints")  # fmt: skip
        sh = self.shell
        async with sh.lock:
            await sh.recover()
            run = sh.run
            no = _not_this_process(run, trainer_id, rank, generation, run_name, pid)
            if no:
                self._refused(no)
                return False
            stepping, done = run.state.stepping_trainer == trainer_id, run.state.global_step
            if stepping and rank == 0 and (done is None or last_step > done):
                await self._runs.step_locked(
                    trainer_id, last_step, False, None, walls, time.monotonic()
                )
        log.info("attached rank %s of %s exited after step %s", rank, trainer_id, last_step)
        if stepping and rank == 0:
            self._wait_for_job(run, trainer_id)
        return True

    def _refused(self, why: str) -> None:
        if why not in self._said:  # (once: an agent tries a refused file no more)
            self._said = {*list(self._said)[-63:], why}
            log.warning("rank_exited refused: %s", why)

    def _wait_for_job(self, run: Run, trainer_id: str) -> None:
        key = (run.name, trainer_id)
        task = self._waits.get(key)
        if task is None or task.done():
            self._waits = {k: v for k, v in self._waits.items() if not v.done()}
            self._waits[key] = asyncio.ensure_future(self._until_job_ends(run, trainer_id))

    async def _until_job_ends(self, run: Run, trainer_id: str) -> None:
        """Ask Ray's job table until the job ends (then end the run), or the run is no longer
        this trainer's running one, or its rank 0 attached again."""
        every, generation = JOB_EVERY_S, run.state.trainers[trainer_id].attaches.get(0)
        while True:
            await asyncio.sleep(every)
            t = run.state.trainers.get(trainer_id)
            if self.shell.run is not run or run.lifecycle != "running" or t is None:
                return
            if t.attaches.get(0) != generation:  # (a new process of rank 0: the job goes on)
                return
            try:
                if await end_if_job_ended(run, self._runs.stop):
                    return
            except Exception:  # the wait must outlive its own faults
                log.exception("the wait for the job of %s failed", trainer_id)
            every = min(every * 1.5, JOB_EVERY_MAX_S)


def _not_this_process(
    run: Run, trainer_id: Any, rank: int, generation: int, run_name: Any, pid: Any
) -> str | None:
    """Why the exit of process ``pid`` (rank ``rank``'s ``generation`` of ``run_name``) is
    not one of this run's running ranks; None when it is. A step file can outlive its job,
    and the next run's generations start at 1 again: the run and pid tell them apart."""
    who = f"rank {rank} of {trainer_id!r} (pid {pid!r}, run {run_name!r})"
    if run_name != run.name:
        return f"{who}: not the current run {run.name}"
    t = run.state.trainers.get(trainer_id) if isinstance(trainer_id, str) else None
    if t is None or not t.spmd or t.attaches.get(rank) != generation:
        return f"{who}: not a process of the run"
    record = run.state.ranks.get((trainer_id, rank))
    if record is None or record.pid is None or record.pid != pid:
        return f"{who}: not the process the rank attached"
    if run.lifecycle != "running":
        return f"{who}: the run {run.name} is {run.lifecycle}"
    return None


async def end_if_job_ended(run: Run, end_run: EndRun) -> bool:
    """When the stepping trainer's ranks are all attached ones (the setup hook's) and Ray says
    the job of every one of them has ended, end the run at its last step; whether it did."""
    trainer = run.state.stepping_trainer
    ranks = [r for (t, _), r in run.state.ranks.items() if t == trainer]
    jobs = {str(r.attached["job_id"]) for r in ranks if r.attached and r.attached["job_id"]}
    if trainer is None or not ranks or not jobs or any(r.attached is None for r in ranks):
        return False
    loop = asyncio.get_running_loop()
    try:
        ended = await loop.run_in_executor(None, ended_jobs, jobs)
    except Exception as exc:  # (Ray's job table unreadable: not ended, as far as we know)
        log.warning("Ray's job table unreadable: %s", exc)
        return False
    if ended != jobs or run.lifecycle != "running":
        return False
    why = f"the job of {trainer} ended after step {run.state.global_step}"
    log.info("%s: the run ends there", why)
    await end_run(trainer, why)
    return True
