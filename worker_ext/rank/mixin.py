"""ProfilerWorkerMixin: inherit it in a Ray actor class to make that actor profilable.

It implements the rank RPCs declared in ``coordinator.protocol.rank_rpc`` (the coordinator's
handle stubs share those signatures, so it calls workers without loading their classes). This
module imports no torch; ``RankProfiler`` loads it on the first ``configure_profiler``.
"""

from __future__ import annotations

from typing import Any, Protocol

from coordinator.core.config import ProfilerConfig
from coordinator.core.schedule import Window
from coordinator.core.validate import role_problem
from coordinator.protocol.rank_rpc import RankRPC
from coordinator.protocol.replies import Phase, RankReply, rank_reply


class RankSide(Protocol):
    """What the RPCs drive: ``RankProfiler`` (torch.profiler in this process) or ``EngineRank``
    (an inference engine's own profiler)."""

    @property
    def phase(self) -> Phase: ...
    def start_window(self, window: Window, step: int) -> RankReply: ...
    def step(self, k: int) -> RankReply: ...
    def stop_window(self) -> RankReply: ...
    def wait_for_summaries(self, timeout_s: float) -> RankReply: ...
    def status(self) -> RankReply: ...
    def _disable(self, where: str, exc: BaseException) -> None: ...


class ProfilerWorkerMixin(RankRPC):
    """Adds the RPCs the coordinator calls. Needs no ``__init__`` call and no other change.

    Every RPC answers a ``RankReply`` (see ``RankProfiler.status``): ``state`` is ``ok``,
    ``disabled`` (with ``reason``), ``not_selected`` or ``not_configured``; encoded summaries
    that are ready ride along in ``summaries``. No RPC raises a profiling fault.
    """

    _rank_profiler: RankSide | None = None

    def configure_profiler(
        self,
        rank: int,
        config: dict[str, Any] | ProfilerConfig,
        run_dir: str | None,
        warm_up: bool = True,
        report_to: dict[str, str] | None = None,
        role: str = "policy",
    ) -> RankReply:
        """Set this actor's global rank, the config and the run directory.

        ``report_to`` (``name``, ``namespace``, ``trainer_id``) names the coordinator that the
        node agent pushes summaries to as soon as they are built; without it they ride on replies.
        ``role``: its trainer's role (``window_.../<role>/rank<r>...`` in each window).
        """
        from worker_ext.rank.kineto_rank import profiler_class

        old = self._rank_profiler
        if old is not None and old.phase != "idle":
            old.stop_window()  # a re-configure never leaves a profiler running
        try:
            cfg = config if isinstance(config, ProfilerConfig) else ProfilerConfig.from_dict(config)
            refuse = _threaded_actor_reason() or role_problem(role)
        except Exception as exc:
            cfg, refuse = ProfilerConfig(enable=True, ranks="all"), f"bad config: {exc}"
        if role_problem(role):
            role, cfg.roles = "policy", {}  # refused above; selected so that it says why
        rp = profiler_class(cfg)(
            int(rank),
            cfg,
            run_dir,
            warm_up=warm_up,
            refuse_reason=refuse,
            report_to=report_to,
            role=role,
        )
        self._rank_profiler = rp
        return rp.status()

    def start_profile(self, window: dict[str, Any], step: int) -> RankReply:
        """Start a window (``Window.to_dict()``); ``step`` is the next training step to run."""
        rp = self._rank_profiler
        if rp is None:
            return _not_configured()
        try:
            w = Window.from_dict(window)
        except Exception as exc:
            rp._disable("start_profile", exc)
            return rp.status()
        return rp.start_window(w, step)

    def profile_step(self, step: int) -> RankReply:
        """Global step ``step`` has finished."""
        rp = self._rank_profiler
        return _not_configured() if rp is None else rp.step(step)

    def stop_profile(self) -> RankReply:
        """Stop an open window now (partial). Safe to call any number of times."""
        rp = self._rank_profiler
        return _not_configured() if rp is None else rp.stop_window()

    def dump_profiler_summary(self, wait_s: float = 0.0) -> RankReply:
        """The status with every ready summary; waits up to ``wait_s`` for pending ones."""
        rp = self._rank_profiler
        return _not_configured() if rp is None else rp.wait_for_summaries(wait_s)


def _not_configured() -> RankReply:
    return rank_reply(state="not_configured")


def _threaded_actor_reason() -> str | None:
    """A reason to refuse profiling in a threaded Ray actor, whose calls hop between threads."""
    try:
        import ray

        worker = ray._private.worker.global_worker
        core = worker.core_worker
        if worker.mode != ray.WORKER_MODE or core.get_actor_id().is_nil():
            return None
        concurrency = int(core.current_actor_max_concurrency())
        if concurrency > 1 and not core.current_actor_is_asyncio():
            return (
                f"threaded actor (max_concurrency={concurrency}): torch.profiler must be "
                "driven from one thread; use max_concurrency=1 or an async actor"
            )
    except Exception:
        return None  # not in a Ray actor, or an API we do not know: the thread guard still holds
    return None
