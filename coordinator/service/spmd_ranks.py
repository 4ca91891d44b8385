"""SPMD ranks: a trainer whose every rank runs the loop and steps itself (``trainers.RankSession``:
Ray Train, torchrun-style loops in plain actors).

The coordinator never calls such a rank (``rank_calls`` skips them). Each rank attaches itself
(``attach_rank``), follows the run's window plan on its own training thread, and sends its status
(``rank_status``, never waited for) once it is configured, after each window it closed, and
when a fault disabled it. Rank 0 reports its steps as any stepping trainer does, without waiting,
at most every 0.1 s; the coordinator's plan goes over every step between two reports (``replay``
in ``RunCalls.step``), so its records open and close the same windows the ranks ran.

A rank whose close has not arrived ``worker_timeout_s`` after the coordinator's plan closed the
window is marked late for that window (its summary lost, with the reason), and the window
settles without it; a rank's close that arrives before rank 0's report moves the plan to that
step first.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from coordinator.core.attach import attached_entry, problem_entry
from coordinator.core.records import RankRecord, TrainerRecord
from coordinator.core.run import Run
from coordinator.core.validate import is_int, role_problem, step_problem, trainer_id_problem
from coordinator.core.window_plan import replay
from coordinator.protocol.replies import RankAttachReply, RankStartReply
from coordinator.service.rank_calls import run_commands
from coordinator.service.rank_exits import RankExits
from coordinator.service.runs import RunCalls, trainer_run_dir
from coordinator.service.shell import CoordinatorShell

log = logging.getLogger(__name__)
Key = tuple[str, int]
MAX_WORLD = 1 << 20
SWEEP_EVERY_S = 1.0
MAX_CATCH_UP = 10_000  # steps a rank's close may move the plan past rank 0's last report


class SpmdRanks:
    """``attach_rank``, ``rank_start`` and ``rank_status``, and the wait for the ranks' closes."""

    def __init__(
        self, shell: CoordinatorShell, runs: RunCalls, start_parts: Callable[[], Any]
    ) -> None:
        self.shell = shell
        self._runs = runs
        self.exits = RankExits(shell, runs)  # attached ranks' processes that ended
        self._starting = asyncio.Lock()  # one rank_start at a time
        self._start_parts = start_parts  # the actor's watchdog and recorder
        self._task: asyncio.Task[None] | None = None
        self._seen: tuple[str, int] = ("", -1)  # (run, the last closed window looked at)
        self._waiting: dict[int, float] = {}  # closed windows waiting for closes: since when

    async def attach_rank(
        self,
        config: dict[str, Any],
        trainer_id: str,
        rank: int,
        world_size: int,
        role: str,
        where: dict[str, Any] | None,
    ) -> RankAttachReply:
        """An SPMD rank joins the run (see the module docstring)."""
        rank, world_size = _checked(trainer_id, rank, world_size, role)
        self.start()
        await self._runs.open_run(config, trainer_id)
        sh = self.shell
        async with sh.lock:
            await sh.recover()
            run = sh.run
            st, cfg = run.state, run.config
            t = st.trainers.get(trainer_id)
            if t is None or not t.spmd or t.world != world_size or t.role != role:
                if t is not None and not t.spmd:
                    raise ValueError(
                        f"trainer {trainer_id!r} is registered with actor ranks "
                        "(ProfilingHooks): give the SPMD ranks another trainer_id"
                    )
                run_dir = trainer_run_dir(run.run_dir, st.trainers, trainer_id, role)
                t = TrainerRecord(trainer_id, role, [], {}, run_dir, spmd=True, world=world_size)
                st.register(t, None, lambda r: False)  # (its ranks come one by one)
            selected = bool(cfg.enable and cfg.selects(rank, role))
            key = (trainer_id, rank)
            if key not in st.ranks:
                bisect.insort(t.ranks, rank)
            else:
                _lost(run, key)
            t.attaches[rank] = generation = t.attaches.get(rank, 0) + 1
            st.counters["rank_attaches"] += 1  # (the trainer's part of the checkpoint changed)
            st.ranks[key] = record = RankRecord(trainer_id, rank, selected)
            if isinstance(where, dict):
                record.pid = where.get("pid") if isinstance(where.get("pid"), int) else None
                node = where.get("node_id")
                record.node_id = node if isinstance(node, str) else None
                if isinstance(where.get("actor"), ray.actor.ActorHandle):  # (stacks, liveness)
                    t.handles[rank] = where["actor"]
                record.attached = attached_entry(where.get("attached"))
            st.ranks_version += 1
            sh.save()
            return {
                "run": run.name,
                "run_dir": t.run_dir,
                "config": cfg.to_dict(),
                "report_to": sh.report_to(trainer_id),
                "selected": selected,
                "world_size": world_size,
                "generation": generation,
            }

    async def rank_start(
        self, trainer_id: str, rank: int, generation: int, first_step: int
    ) -> RankStartReply:
        """An SPMD rank's loop begins at ``first_step`` (waited for, before the loop). The first
        rank of a start (its generation and first step) starts the run's plan there, as a
        trainer's ``start`` does; every rank of it gets the same ``index_base``, so all the
        ranks' plans number their windows as the coordinator's does, after a restart too."""
        if not isinstance(trainer_id, str) or not (is_int(rank) and is_int(generation)):
            raise ValueError(f"no SPMD rank {rank!r} (generation {generation!r}) of {trainer_id!r}")
        if problem := step_problem("first_step", first_step):
            raise ValueError(problem)
        async with self._starting:
            sh, epoch = self.shell, (generation, first_step)
            t = self._trainer(trainer_id, rank)
            if sh.run.lifecycle != "stopped" and epoch in t.epochs:
                return {"run": sh.run.name, "first_step": first_step, "index_base": t.epochs[epoch]}
            reply = await self._runs.start(trainer_id, first_step, False)
            if not reply["applied"]:
                raise ValueError(f"the run did not start at step {first_step}: {reply['reason']}")
            plan, t = sh.run.plan, self._trainer(trainer_id, rank)  # (a fresh run: carried)
            base = plan.current.index if plan.current is not None else plan.next_index
            t.epochs[epoch] = base
            return {"run": sh.run.name, "first_step": first_step, "index_base": base}

    def _trainer(self, trainer_id: str, rank: int) -> TrainerRecord:
        st = self.shell.run.state
        t = st.trainers.get(trainer_id)
        if t is None or not t.spmd or (trainer_id, rank) not in st.ranks:
            raise ValueError(f"no SPMD rank {rank} of trainer {trainer_id!r} is attached")
        return t

    async def rank_status(
        self,
        trainer_id: str,
        rank: int,
        step: int | None,
        reply: dict[str, Any],
        generation: int | None = None,
    ) -> None:
        """An SPMD rank's status (``RankReply``): after it configured its profiler, after each
        window it closed (``step``: the step it closed at), when a fault disabled it. One from
        an earlier process of the rank (``generation``) is refused: it would move the plan."""
        sh = self.shell
        self.start()  # (a restarted coordinator: its first call from the ranks)
        if not isinstance(trainer_id, str) or not is_int(rank):
            sh.refuse("rank_status", f"no SPMD rank {rank!r} of trainer {trainer_id!r}")
            return
        async with sh.lock:
            await sh.recover()
            run = sh.run
            st, key = run.state, (trainer_id, rank)
            t = st.trainers.get(trainer_id)
            if t is None or not t.spmd or key not in st.ranks:
                sh.refuse("rank_status", f"no SPMD rank {rank!r} of trainer {trainer_id!r}")
                return
            if generation is not None and generation != t.attaches.get(rank):
                why = f"rank {rank}'s status from its earlier process (generation {generation!r})"
                sh.refuse("rank_status", why)
                return
            st.counters["rank_status"] += 1
            if isinstance(step, int) and is_int(step) and trainer_id == st.stepping_trainer:
                await self.catch_up(run, step)
            closed = reply.get("closed") if isinstance(reply, dict) else None
            index = closed.get("window") if isinstance(closed, dict) else None
            w = st.windows.get(index) if isinstance(index, int) else None
            if w is not None:
                w.participants.add(key)  # (a rank that attached inside the window ran it too)
            st.apply_reply(key, reply)
            self.sweep(run)
            sh.save(force=False)  # (a restart must not lose a close: within a second)

    def start(self) -> None:
        """Start the actor's watchdog and recorder, and the wait for closes (once)."""
        self._start_parts()
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        """Every ``SWEEP_EVERY_S``: the windows waiting for SPMD ranks' closes (``sweep``)."""
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            try:
                async with self.shell.lock:
                    self.sweep(self.shell.run)
            except Exception:  # (the wait must outlive its own faults)
                log.exception("the SPMD ranks' closes could not be checked")

    async def catch_up(self, run: Run, step: int) -> None:
        """Move the plan to ``step`` when a rank is already past rank 0's last report."""
        plan = run.plan
        if not plan.started or (plan.last_step is not None and step <= plan.last_step):
            return
        if step > plan.next_boundary + MAX_CATCH_UP:  # (no rank runs that far ahead of rank 0)
            self.shell.refuse("rank_status", f"step {step} is far past the run's {plan.last_step}")
            return
        commands = replay(plan, step)
        run.state.global_step = step
        if isinstance(commands, list):
            await run_commands(run, commands, self.shell.nodes)

    def sweep(self, run: Run, now: float | None = None, force: bool = False) -> None:
        """Wait for the SPMD ranks' closes: each closed window expects a summary from every
        participant that has not told its close yet; past ``worker_timeout_s`` (or with
        ``force``: the run stopped and the wait is over) such a rank is marked late."""
        st = run.state
        spmd = {t.trainer_id for t in st.trainers.values() if t.spmd}
        if not spmd:
            return
        now = time.monotonic() if now is None else now
        if self._seen[0] != run.name:
            self._seen, self._waiting = (run.name, -1), {}
        for index, w in reversed(st.windows.items()):  # (the windows closed since the last look)
            if index <= self._seen[1]:
                break
            if w.closed and w.unopened is None:
                self._waiting.setdefault(index, now)
        closed = [i for i, w in st.windows.items() if w.closed]
        self._seen = (run.name, max([self._seen[1], *closed[-1:]]))
        for index, since in list(self._waiting.items()):
            rec = st.windows.get(index)
            late = [] if rec is None else [
                k for k in rec.participants - rec.acked if k[0] in spmd and not rec.has_summary(k)
            ]  # fmt: skip
            if not late:
                del self._waiting[index]
            elif force or now - since > run.config.worker_timeout_s:
                for key in late:
                    why = (
                        f"late: rank {key[1]} had not told the coordinator that it closed "
                        f"window {index} {now - since:.0f} s after the window's last step"
                    )
                    st.summary_failed(key, index, why)
                del self._waiting[index]


def _lost(run: Run, key: Key) -> None:
    """A rank attaching again (its process restarted, as after a Ray Train worker group's
    restart) will never tell the closes of the windows its earlier process was in: each such
    window is partial for it, with the reason, at once."""
    st = run.state
    for index, w in st.windows.items():
        if key in w.participants and key not in w.acked and not w.has_summary(key):
            why = (
                f"lost: rank {key[1]} attached again (its process restarted) before it told "
                f"that it closed window {index}"
            )
            st.summary_failed(key, index, why)
            w.partial = True


def _checked(trainer_id: Any, rank: Any, world_size: Any, role: Any) -> tuple[int, int]:
    problem = trainer_id_problem(trainer_id) if isinstance(trainer_id, str) else None
    if not isinstance(trainer_id, str):
        problem = f"trainer_id must be a string, got {type(trainer_id).__name__}"
    if problem is None:
        problem = role_problem(role)
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (rank, world_size))
    if problem is None and not ints:
        problem = f"rank and world_size must be integers, got {rank!r} and {world_size!r}"
    if problem is None and not 0 < world_size <= MAX_WORLD:
        problem = f"world_size must be 1..{MAX_WORLD}, got {world_size}"
    if problem is None and not 0 <= rank < world_size:
        problem = f"rank {rank} is not in 0..{world_size - 1} (world_size {world_size})"
    if problem is not None:
        raise ValueError(problem)
    return rank, world_size


class SpmdRPCs:
    """The SPMD ranks' RPCs, mixed into the coordinator actor (which sets ``_spmd``)."""

    _spmd: SpmdRanks

    async def attach_rank(
        self,
        config: dict[str, Any],
        trainer_id: str,
        rank: int,
        world_size: int,
        role: str = "policy",
        where: dict[str, Any] | None = None,
    ) -> RankAttachReply:
        """An SPMD rank attaches itself (``RankSession.attach``): the run is joined as
        ``open_run`` joins it, the rank is recorded (``where``: its ``pid`` and ``node_id``),
        and the reply holds what the rank needs to follow the plan by itself. Raises
        ValueError for a bad rank, world size, role or trainer id, or a trainer id that
        actor ranks use."""
        return await self._spmd.attach_rank(config, trainer_id, rank, world_size, role, where)

    async def rank_start(
        self, trainer_id: str, rank: int, generation: int, first_step: int
    ) -> RankStartReply:
        """An SPMD rank's loop begins at ``first_step`` (``RankSession.session``, waited for):
        the first rank of a start starts the run's plan there, as ``start`` does for a trainer;
        every rank of it (same ``generation`` from ``attach_rank``, same ``first_step``) gets
        the same ``index_base``, the index of the first window its plan opens. Raises
        ValueError for a rank that is not attached or a bad step."""
        return await self._spmd.rank_start(trainer_id, rank, generation, first_step)

    async def rank_status(
        self,
        trainer_id: str,
        rank: int,
        step: int | None,
        reply: dict[str, Any],
        generation: int | None = None,
    ) -> None:
        """An SPMD rank's status (a ``RankReply``), sent without waiting: once its profiler is
        configured, after each window it closed (``step``: the step it closed at), and when a
        fault disabled it. A rank the run does not know, or a status from an earlier process
        of the rank (``generation``, from ``attach_rank``), is refused (counted, logged once)."""
        await self._spmd.rank_status(trainer_id, rank, step, reply, generation)

    async def rank_exited(
        self,
        trainer_id: str,
        rank: int,
        generation: int,
        last_step: int,
        walls: Any = None,
        run: str | None = None,
        pid: int | None = None,
    ) -> bool:
        """The process ``pid`` of an attached rank, of the run ``run``, has ended (its node
        agent says so, from the rank's step file): rank 0's ``last_step`` and ``walls`` (the
        steps it had not reported) are its last step report, and the run ends once Ray says
        the job has ended (``rank_exits``). False (logged once) for another run, a rank the
        run does not know, a process other than the one the rank attached (``generation``,
        ``pid``), or a run not running. Raises ValueError for a rank, generation or step that
        is not an int."""
        exits = self._spmd.exits
        return await exits.exited(trainer_id, rank, generation, last_step, walls, run, pid)

    async def attach_problem(self, where: dict[str, Any], problem: str) -> None:
        """A process of a job attached by the setup hook (``worker_ext.attach``) is not
        profiled, or an attached rank warns (``where``: its ``pid``, ``node_id``, ``job_id``,
        ``actor_class``, and ``trainer_id`` and ``rank`` when known); kept, bounded, in
        ``status()["attach_problems"]``. Sent without waiting. Raises ValueError for an
        empty problem or a ``where`` that is not a mapping."""
        entry = problem_entry(where, problem, time.time())
        self._spmd.shell.attach_problems.append(entry)
        log.warning("profiler: attached process %s: %s", entry["pid"], entry["problem"])
