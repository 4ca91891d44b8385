"""ProfilingHooks: the few lines a trainer adds to its loop to be profiled by the coordinator.

    hooks = ProfilingHooks.attach(config, workers=policy_workers, trainer_id="sft")
    with hooks.session(first_step=first_step):
        for step in range(first_step, last_step + 1):
            train_one_step(step)
            hooks.step(step)

Async trainers use ``async with hooks.session(...)`` and ``await hooks.astep(step)``. A disabled
config makes every call a no-op without a single Ray call. If the coordinator cannot be reached,
or dies mid-run, the hooks log one warning and switch profiling off; training goes on.
"""

from __future__ import annotations

import logging
from typing import Any

from coordinator.config import ProfilerConfig

log = logging.getLogger(__name__)


class ProfilingHooks:
    """Trainer-side handle on the coordinator for one trainer."""

    def __init__(
        self,
        client: Any | None,
        trainer_id: str,
        coordinator: Any | None = None,
        run: dict[str, Any] | None = None,
    ):
        self._client = client
        self.trainer_id = trainer_id
        self.coordinator = coordinator
        self.disabled_reason: str | None = None if client else "profiling is not enabled"
        self._last_step: int | None = None
        info = run or {}
        self.run: str | None = info.get("run")
        """The coordinator's run this trainer attached to."""
        self.config: ProfilerConfig | None = (
            ProfilerConfig.from_dict(info["config"], check_paths=False) if info else None
        )
        """The config the run uses: the coordinator's, when an active run kept its own."""
        self.config_mismatch: list[str] = list(info.get("mismatch", []))
        """Fields of the config given to ``attach`` that the running run does not use."""

    @classmethod
    def attach(
        cls,
        config: ProfilerConfig | dict[str, Any] | None,
        workers: list[Any] | dict[int, Any],
        trainer_id: str = "trainer",
        role: str = "policy",
        name: str = "profiler",
        namespace: str = "profiler",
        advances_step: bool | None = None,
    ) -> ProfilingHooks:
        """Create (or reach) the coordinator, attach to its run and register ``workers``.

        A coordinator whose last run stopped begins a fresh run with ``config``; a run still
        going (this trainer's, after a driver restart) keeps its config, and ``config_mismatch``
        names the fields that differ. A bad config or registration, or another active run
        with another config, raises ValueError at once; an unreachable coordinator only
        switches profiling off.
        """
        cfg = config if isinstance(config, ProfilerConfig) else ProfilerConfig.from_dict(config)
        cfg.validate()
        if not cfg.enable:
            return cls(None, trainer_id)
        import ray

        from coordinator.actor import attach_coordinator
        from coordinator.client import StepClient

        try:
            coord, run = attach_coordinator(cfg, name, namespace, trainer_id=trainer_id)
            ray.get(coord.register.remote(trainer_id, workers, role, advances_step))
        except ValueError:
            raise
        except ray.exceptions.RayTaskError as exc:
            cause = exc.as_instanceof_cause()
            if isinstance(cause, ValueError):  # a bad registration or a clash of runs
                raise ValueError(str(cause).strip().splitlines()[-1]) from None
            hooks = cls(None, trainer_id)
            hooks._switch_off("attach", exc)
            return hooks
        except Exception as exc:
            hooks = cls(None, trainer_id)
            hooks._switch_off("attach", exc)
            return hooks
        return cls(StepClient(coord, trainer_id), trainer_id, coord, dict(run))

    @property
    def enabled(self) -> bool:
        return self._client is not None

    @property
    def phase(self) -> str:
        """What the last step report said the next step does: idle, warmup or recording."""
        c = self._client
        if c is None or c.last_reply is None:
            return "off" if c is None else "idle"
        nxt = c.next_sync_step
        if self._last_step is not None and (nxt is None or self._last_step + 1 < nxt):
            return "idle"
        return c.last_reply.get("phase", "idle")

    def session(self, first_step: int = 0) -> _Session:
        """``start`` now and ``stop`` at the end, even on an exception (sync or async with)."""
        return _Session(self, first_step)

    def start(self, first_step: int = 0) -> None:
        self._call("start", lambda c: c.start(first_step))

    def step(self, step: int) -> None:
        """Global step ``step`` has finished (call it after the step, like torch.profiler)."""
        self._last_step = step
        self._call("step", lambda c: c.step(step))

    def stop(self) -> None:
        self._call("stop", lambda c: c.stop())

    async def astart(self, first_step: int = 0) -> None:
        await self._acall("start", lambda c: c.astart(first_step))

    async def astep(self, step: int) -> None:
        """The asyncio form of ``step``; never blocks the event loop."""
        self._last_step = step
        await self._acall("step", lambda c: c.astep(step))

    async def astop(self) -> None:
        await self._acall("stop", lambda c: c.astop())

    def _call(self, what: str, fn: Any) -> None:
        if self._client is None:
            return
        try:
            fn(self._client)
        except Exception as exc:
            self._switch_off(what, exc)

    async def _acall(self, what: str, fn: Any) -> None:
        if self._client is None:
            return
        try:
            await fn(self._client)
        except Exception as exc:
            self._switch_off(what, exc)

    def _switch_off(self, what: str, exc: BaseException) -> None:
        self._client = None
        self.disabled_reason = f"{what}: {type(exc).__name__}: {exc}"
        log.warning(
            "profiling switched off for trainer %r (%s); training goes on",
            self.trainer_id,
            self.disabled_reason,
        )


class _Session:
    def __init__(self, hooks: ProfilingHooks, first_step: int) -> None:
        self.hooks, self.first_step = hooks, first_step

    def __enter__(self) -> ProfilingHooks:
        self.hooks.start(self.first_step)
        return self.hooks

    def __exit__(self, *exc: Any) -> None:
        self.hooks.stop()

    async def __aenter__(self) -> ProfilingHooks:
        await self.hooks.astart(self.first_step)
        return self.hooks

    async def __aexit__(self, *exc: Any) -> None:
        await self.hooks.astop()
