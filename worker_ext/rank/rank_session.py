"""RankSession: profiling for SPMD loops, where every rank runs the loop and steps itself.

    def train_loop_per_worker(cfg):
        prof = RankSession.attach(profiler_config, trainer_id="sft")
        with prof.session(first_step=start):
            for step in range(start, last + 1):
                with prof.region("train"):
                    train_one_step()
                prof.step(step)

Ray Train's workers, torchrun-style loops in plain actors, a Hugging Face or Lightning loop inside
Ray Train: nobody owns the ranks, so the coordinator cannot call them. Each rank attaches itself,
holds the run's window plan (``coordinator.core.window_plan``, the same pure plan the coordinator
keeps) and starts, steps and stops its own ``torch.profiler`` on its training thread, at the
steps the plan names; every rank computes the same windows from the same config. Outside windows
``step(k)`` is a few attribute lookups: no Ray call, no wait. Rank 0 reports its step to the
coordinator without waiting, at most every 0.1 s and at once on a step where a window starts or
stops, with each step's wall time (``coordinator.client.rank_reports``); each rank tells the
coordinator, never waiting, when it closed a window.
The node agent builds the summaries from the traces, as for actor ranks.

A disabled config makes no Ray call at all. An unreachable coordinator, no rank information,
a second session in one process or a fault in the profiler switch this rank's profiling off
with one logged error (``disabled_reason``); training never stops and nothing raises.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Any

from coordinator.client.phase_clock import Region
from coordinator.client.rank_reports import StepReports
from coordinator.core.config import ProfilerConfig
from coordinator.core.schedule import Schedule
from coordinator.core.window_plan import Command, Start, Step, Stop, WindowPlan
from coordinator.protocol.names import DEFAULT_NAME, DEFAULT_NAMESPACE
from coordinator.protocol.plan_board import board_id
from worker_ext.rank.board_reader import BoardReader
from worker_ext.rank.step_file import keep_last_steps

log = logging.getLogger(__name__)
FINISH_S = 30.0  # the most the loop's end waits for traces its process still writes
_ATTACHED: dict[int, RankSession] = {}  # pid -> the session attached in this process (one)
_ATTACHED_LOCK = threading.Lock()
_clock = time.perf_counter


class RankSession:
    """One rank's handle on the coordinator (see the module docstring)."""

    def __init__(
        self,
        trainer_id: str,
        rank: int | None = None,
        world_size: int | None = None,
        disabled_reason: str | None = "profiling is not enabled",
    ) -> None:
        self.trainer_id = trainer_id
        self.rank, self.world_size = rank, world_size
        self.disabled_reason = disabled_reason
        self.run: str | None = None
        self.run_dir: str | None = None
        self.config: ProfilerConfig | None = None
        self.coordinator: Any = None
        self._profiler: Any = None  # worker_ext.rank.rank_profiler.RankProfiler
        self._plan: WindowPlan | None = None
        self._reports: StepReports | None = None  # rank 0's
        self._last_step: int | None = None
        self._quiet_through = -1  # the plan's: steps up to it need no look at the plan
        self._said_backwards = False
        self._told_fault = False
        self._generation = 0  # this process's attach to the run (``attach_rank``)
        self._owner = (DEFAULT_NAMESPACE, DEFAULT_NAME)  # the coordinator's namespace and name
        self._report_to: dict[str, str] | None = None  # (the attach reply's)
        self._board: BoardReader | None = None  # this node's plan board, once the loop starts
        self._attached: dict[str, Any] | None = None  # set by the attach hook
        self.closed_extra: Any = None  # closed window -> fields to add (SkyRL: optimizer steps)

    # ------------------------------------------------------------------ attach

    @classmethod
    def attach(
        cls,
        config: ProfilerConfig | dict[str, Any] | None,
        trainer_id: str = "trainer",
        role: str = "policy",
        rank: int | None = None,
        world_size: int | None = None,
        name: str = DEFAULT_NAME,
        namespace: str = DEFAULT_NAMESPACE,
        attached: dict[str, Any] | None = None,
    ) -> RankSession:
        """Attach this rank to the coordinator's run (creating the coordinator if needed).

        Args:
            config: a ``ProfilerConfig``, a dict of its fields or an OmegaConf node; None or
                ``enable: false``: no Ray call at all. In Ray Train, a dict without
                ``save_path`` writes under the job's ``{storage_path}/{name}/profiler``.
            trainer_id: the job's name for its ranks; every rank passes the same one.
            role: what these ranks do (``policy``, ...): ``window_.../<role>/rank<r>...``.
            rank, world_size: this rank and the number of ranks, used only when neither Ray
                Train (``ray.train.get_context()``) nor ``torch.distributed`` says.
            name, namespace: the coordinator actor's; attached: the setup hook's account.

        Returns:
            The session; ``enabled`` says whether this rank is profiled, ``disabled_reason``
            why not.

        Raises:
            ValueError: a bad config (before any step: the user's own mistake, as for
                ``ProfilingHooks.attach``). Nothing else raises: see the module docstring.

        Example (in ``train_loop_per_worker``: ``RankSession.attach(cfg, trainer_id="sft")``):

        >>> prof = RankSession.attach({"enable": False}, trainer_id="sft")
        >>> with prof.session(first_step=0):
        ...     for step in range(3):
        ...         prof.step(step)
        >>> prof.enabled, prof.disabled_reason, prof.phase
        (False, 'profiling is not enabled', 'off')
        """
        if not isinstance(config, ProfilerConfig):
            config = ProfilerConfig.from_dict(with_train_storage(config))
        cfg = config.validate()
        if not cfg.enable:
            return cls(trainer_id)
        found = rank_and_world(rank, world_size)
        if isinstance(found, str):
            return _off(cls(trainer_id, rank, world_size, None), "attach", found)
        me, world = found
        session = cls(trainer_id, me, world, None)
        session._attached = attached
        taken = _claim(session)
        if taken is not None:
            return _off(session, "attach", taken)
        try:
            session._join(cfg, role, name, namespace)
        except Exception as exc:  # unreachable or refused: this rank goes unprofiled
            return _off(session, "attach", f"{type(exc).__name__}: {exc}")
        return session

    def _join(self, cfg: ProfilerConfig, role: str, name: str, namespace: str) -> None:
        import ray

        from coordinator.client.connect import coordinator_handle
        from worker_ext.rank.kineto_rank import profiler_class

        if not ray.is_initialized():
            raise RuntimeError("ray is not initialised in this rank's process")
        coord = coordinator_handle(cfg, name, namespace)
        where = {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}
        with contextlib.suppress(Exception):  # (not in an actor: a plain process)
            where["actor"] = ray.get_runtime_context().current_actor  # (for stacks())
        if self._attached is not None:
            where["attached"] = self._attached
        assert self.rank is not None and self.world_size is not None
        ref = coord.attach_rank.remote(
            cfg.to_dict(), self.trainer_id, self.rank, self.world_size, role, where
        )
        reply = ray.get(ref, timeout=cfg.worker_timeout_s + 60)
        self.coordinator, self.run, self.run_dir = coord, reply["run"], reply["run_dir"]
        self._owner = (namespace, name)
        self._generation, self._report_to = reply["generation"], reply["report_to"]
        self.config = ProfilerConfig.from_dict(reply["config"], check_paths=False)
        self._profiler = profiler_class(self.config)(
            self.rank, self.config, self.run_dir, report_to=reply["report_to"], role=role
        )
        self._plan = WindowPlan(Schedule(self.config))
        self._reports = StepReports(self.coordinator, self.trainer_id) if self.rank == 0 else None
        self._tell(None)  # its node, pid and stack-dump file, for stacks and stragglers

    # ------------------------------------------------------------------ the loop

    @property
    def enabled(self) -> bool:
        """This rank is profiled (a selected rank whose profiler has had no fault)."""
        p = self._profiler
        return self.disabled_reason is None and p is not None and p.fault is None

    @property
    def phase(self) -> str:
        """``idle``, ``warmup`` or ``recording`` (the next step), or ``off``."""
        p = self._profiler
        return "off" if self.disabled_reason or p is None else str(p.phase)

    def session(self, first_step: int = 0) -> _Session:
        """``start(first_step)`` now and ``stop()`` at the end; on an exception, only this
        rank's window closes (``stop(end_run=False)``) and the run goes on for a restart.

        Args:
            first_step: the first global step this loop runs (the checkpoint's on resume), so
                that windows land on the same absolute steps on every rank.
        """
        return _Session(self, first_step)

    def region(self, name: str) -> Region:
        """Time a named part of the step (``with prof.region("train"):``); rank 0's regions
        ride on its step reports (``phase_times()``, ``ray-profiler phases``)."""
        return Region(self._reports.clock if self._reports is not None else None, name)

    def start(self, first_step: int = 0) -> None:
        """Before the loop: the next step this rank runs is ``first_step``. Waits for the
        coordinator once (``rank_start``): the first rank to start starts the run's plan, and
        every rank learns how the windows from ``first_step`` on are numbered."""
        if self._plan is None or self.disabled_reason:
            return
        import ray

        try:
            ref = self.coordinator.rank_start.remote(
                self.trainer_id, self.rank, self._generation, first_step
            )
            assert self.config is not None
            begun = ray.get(ref, timeout=self.config.worker_timeout_s + 60)
        except Exception as exc:  # unreachable, or refused: this rank goes unprofiled
            _off(self, "start", f"{type(exc).__name__}: {exc}")
            return
        self._plan.next_index = begun["index_base"]
        self._last_step = first_step - 1 if first_step > 0 else None
        if self._profiler is not None and self._profiler.selected:
            self.run = begun["run"]
            bid = board_id(*self._owner, begun["run"], self.trainer_id)
            assert self.config is not None
            self._board = BoardReader(bid, int(self.rank or 0), begun["run"], self.trainer_id,
                                      self.config.max_capture_steps)  # fmt: skip
            self._look(None)  # the captures planned before this start
        self._run(self._plan.start(first_step), first_step - 1)
        if self._reports is not None:
            self._reports.clock.begin_step()

    def step(self, step: int) -> None:
        """Global step ``step`` has finished on this rank; call it once per step, after it.

        Outside windows: no Ray call and no wait. A step that does not move forward is
        ignored, with one logged error.
        """
        plan = self._plan
        if plan is None or self.disabled_reason:
            return
        last = self._last_step
        if last is not None and step <= last:
            _backwards(self, step)
            return
        self._last_step = step
        now = _clock()  # (one reading a step: the board's look and rank 0's step time)
        board = self._board
        if board is not None and now >= board.look_at:
            self._look(step + 1)
        if step <= self._quiet_through:  # (the hot path: the plan has nothing before then)
            plan.last_step = step
            commands = None
        else:
            commands = plan.step(step)
            if commands:
                self._run(commands, step)  # type: ignore[arg-type]  # (never Ignored: checked)
                now = _clock()  # (the commands' time is this step's)
            self._quiet_through = plan.quiet_through()
        reports = self._reports
        if reports is not None:
            reports.step(step, bool(commands), now)

    def stop(self, end_run: bool = True) -> None:
        """After the loop: close an open window (partial); rank 0 ends the run's steps.

        ``end_run=False`` (the loop raised: ``session`` passes it) closes this rank's window
        but leaves the run going, so ranks that Ray Train restarts after a failure attach to
        the same run and go on at the checkpoint's step.
        """
        if self._plan is None or self.disabled_reason:
            return
        self._run(self._plan.stop(), self._last_step)
        try:  # (engine kineto: libkineto writes from this process; a loop that raised: no wait)
            if self._profiler is not None:
                self._profiler.finish(FINISH_S if end_run else 0.0)
        except BaseException:  # (a second Ctrl-C while it waits: the slot is freed all the same)
            _release(self)
            raise
        if self.rank == 0 and end_run:
            _end_run(self)
        reports = self._reports
        if reports is not None and reports.tail is not None:  # (nothing left to report)
            tail, reports.tail = reports.tail, None
            tail.close()
        _release(self)

    def keep_last_steps(self) -> None:
        """For a rank 0 that no loop end stops (an attached one): its steps also go to a step
        file that its node agent reports once the process is gone, however it ends
        (``worker_ext.rank.step_file``). A failure is said once; nothing else changes."""
        if self._reports is None or self._report_to is None or self.disabled_reason:
            return
        keep_last_steps(self._reports, {"report_to": self._report_to, "rank": self.rank,
                                        "generation": self._generation})  # fmt: skip

    # ------------------------------------------------------------------ inside

    def _run(self, commands: list[Command], step: int | None) -> None:
        """Each command on this rank's profiler (on this, the training thread); the status of
        a window closed, or of a fault, goes to the coordinator."""
        p = self._profiler
        if p is None or not p.selected:
            return
        reply, closed = None, None
        for cmd in commands:
            if self._board is not None and self._board.skips(cmd):
                continue  # a capture of other ranks only
            if isinstance(cmd, Start):
                reply = p.start_window(cmd.window, cmd.step)
            elif isinstance(cmd, Step):
                reply = p.step(cmd.step)
            elif isinstance(cmd, Stop):
                reply = p.stop_window()
            closed = reply["closed"] if reply and reply["closed"] else closed
        fault = p.fault is not None and not self._told_fault
        if reply is not None and (closed or fault):
            if closed and self.closed_extra is not None:
                closed = {**closed, **self.closed_extra(closed)}
            self._told_fault = self._told_fault or fault
            self._tell(step, {**reply, "closed": closed})

    def _look(self, next_step: int | None) -> None:
        """The captures on this node's plan board that this rank has not seen (``BoardReader``);
        a rank whose windows can no longer carry the run's numbers stops profiling."""
        assert self._board is not None and self._plan is not None
        taken = self._board.look(self._plan, next_step)
        self._quiet_through = -1  # (a capture taken changes the plan: ask it again)
        if taken is not None and taken.off is not None:
            self._run(self._plan.stop(), next_step)
            _off(self, "plan", taken.off)

    def _tell(self, step: int | None, status: Any = None) -> None:
        """This rank's status to the coordinator (a window it closed, a fault), not waited for."""
        try:
            status = status if status is not None else self._profiler.status()
            self.coordinator.rank_status.remote(
                self.trainer_id, self.rank, step, status, self._generation
            )
        except Exception as exc:  # the coordinator is away: it learns at the next close
            log.warning(
                "profiler: rank %s could not send its status to the coordinator (%s: %s); a "
                "window it closed will show it as late, with no cause there",
                self.rank, type(exc).__name__, exc,
            )  # fmt: skip


def _end_run(session: RankSession) -> None:
    """Rank 0 ends the run: its last step report (answered first: an async actor may run
    two calls out of order), then ``stop``, waited for."""
    import ray

    reports = session._reports
    assert session.config is not None and reports is not None
    reports.flush()  # (with the phase records not yet sent)
    wait_s = session.config.worker_timeout_s
    try:
        if reports.sent is not None:
            ray.wait([reports.sent], timeout=wait_s)
        ray.get(session.coordinator.stop.remote(session.trainer_id), timeout=wait_s + 5)
    except Exception as exc:  # never the training's problem
        log.warning("profiler: rank 0 could not end the run at the coordinator: %s", exc)


def with_train_storage(config: Any) -> Any:
    """``config`` (a mapping), with ``save_path`` under Ray Train's storage when it enables
    profiling without one and this rank runs in Ray Train:
    ``{RunConfig.storage_path}/{RunConfig.name}/profiler``. Anything else as it is."""
    train = sys.modules.get("ray.train")
    if train is None or not hasattr(config, "keys") or not config.get("enable"):
        return config
    if config.get("save_path") is not None:
        return config
    try:
        storage = train.get_context().get_storage()
        kind = storage.storage_filesystem.type_name
        path = f"{storage.storage_fs_path}/{storage.experiment_dir_name}/profiler"
    except Exception:
        return config  # (not in a Ray Train worker: the config says what is missing)
    scheme = {"local": "", "s3": "s3://", "gcs": "gs://"}.get(kind)
    if scheme is None:
        return config
    return {**{k: config[k] for k in list(config.keys())}, "save_path": scheme + path}


def rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int] | str:
    """This process's (rank, world size): Ray Train's context, else ``torch.distributed``'s,
    else the arguments; a string says why none is known."""
    train = sys.modules.get("ray.train")  # (loaded when Ray Train runs this process)
    if train is not None:
        try:
            ctx = train.get_context()
            return int(ctx.get_world_rank()), int(ctx.get_world_size())
        except Exception:
            pass  # not inside a Ray Train worker
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    if rank is None or world_size is None:
        return (
            "no rank information: not in a Ray Train worker, torch.distributed is not "
            "initialised, and RankSession.attach was given no rank= and world_size="
        )
    if not 0 <= int(rank) < int(world_size):
        return f"rank {rank} is not in 0..{int(world_size) - 1} (world_size {world_size})"
    return int(rank), int(world_size)


def _claim(session: RankSession) -> str | None:
    """Take this process's one session slot for ``session``; says why not when another
    session has it."""
    with _ATTACHED_LOCK:
        held = _ATTACHED.get(os.getpid())
        if held is not None:
            return (
                f"a RankSession is already attached in this process (trainer "
                f"{held.trainer_id!r} rank {held.rank}); one session per rank: attach once, "
                "before the loop"
            )
        _ATTACHED[os.getpid()] = session
        return None


def _release(session: RankSession) -> None:
    """Free this process's slot, if ``session`` holds it (never another session's)."""
    with _ATTACHED_LOCK:
        if _ATTACHED.get(os.getpid()) is session:
            del _ATTACHED[os.getpid()]


def _backwards(session: RankSession, step: int) -> None:
    """A step that does not move forward: said once, then ignored."""
    if not session._said_backwards:
        session._said_backwards = True
        log.error(
            "profiler: rank %s step %d after step %d: steps must go forward; ignored "
            "(training goes on)",
            session.rank,
            step,
            session._last_step,
        )


def _off(session: RankSession, where: str, why: str) -> RankSession:
    """Switched off for good: said once, and its slot freed for a later attach."""
    session.disabled_reason = why
    _release(session)
    log.error("profiler: this rank is not profiled (%s: %s); training goes on", where, why)
    return session


class _Session:
    def __init__(self, session: RankSession, first_step: int) -> None:
        self.session, self.first_step = session, first_step

    def __enter__(self) -> RankSession:
        self.session.start(self.first_step)
        return self.session

    def __exit__(self, kind: Any, *exc: Any) -> None:
        self.session.stop(end_run=kind is None)
