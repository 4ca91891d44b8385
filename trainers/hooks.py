"""ProfilingHooks: the few lines a trainer adds to its loop to be profiled by the coordinator.

    hooks = ProfilingHooks.attach(config, workers=policy_workers, trainer_id="sft")
    with hooks.session(first_step=first_step):
        for step in range(first_step, last_step + 1):
            train_one_step(step)
            hooks.step(step)

Async trainers use ``async with hooks.session(...)`` and ``await hooks.astep(step)``. A disabled
config makes every call a no-op without a single Ray call. If the coordinator cannot be reached
at ``attach``, the hooks log one warning and switch profiling off. If it stops answering mid-run
(it died and Ray restarts it), a step pays one bounded wait once; later steps skip cheaply, and
profiling resumes when it answers again. Training never stops or raises.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from coordinator.client.phase_clock import PhaseClock, Region
from coordinator.core.config import ProfilerConfig

log = logging.getLogger(__name__)
# How much longer than worker_timeout_s a trainer waits for a report's answer.
REPORT_MARGIN_S = 5.0
FLUSH_S = 30.0  # at stop, the longest the trackers wait for the last windows' figures


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
        self._clock = PhaseClock() if client is not None else None
        self._down_since: float | None = None  # the coordinator stopped answering (monotonic)
        self._next_probe = 0.0
        self._probe: Any = None
        self._feed: Any = None  # the tracker feed (coordinator/client/tracker_feed.py)

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
        tracker: Any = None,
    ) -> ProfilingHooks:
        """Create (or reach) the coordinator, attach to its run and register ``workers``: a
        stopped run gives way to a fresh one with ``config``; a run still going keeps its own
        (``config_mismatch`` names the fields that differ).

        Args:
            config: a ``ProfilerConfig``, a dict of its fields or an OmegaConf node; None or
                ``enable: false`` gives hooks that make no Ray call at all.
            workers: the trainer's rank actors (with ``ProfilerWorkerMixin``), a list in rank
                order or ``{rank: handle}``.
            trainer_id: this trainer's name. Pass the same one when a restarted driver attaches
                again: it then resumes its run (same global step, same windows).
            role: what these workers do (``policy``, ``rollout``, ...).
            name, namespace: the coordinator actor's; give each job running at the same time
                its own ``name``.
            advances_step: whether this trainer's reports advance the global step (default:
                the first trainer to register does).
            tracker: a ``log(metrics, step)`` callable, besides the config's ``trackers``.

        Returns:
            The hooks; ``run`` names the run, ``config`` is the config it uses.

        Raises:
            ValueError: a bad config or registration, or another active run on this
                coordinator with another config. An unreachable coordinator raises nothing:
                it switches profiling off with one warning (``disabled_reason`` says why).

        Example (``ProfilingHooks.attach(cfg.profiler, workers=policy, trainer_id="sft")``):

        >>> hooks = ProfilingHooks.attach({"enable": False}, workers=[])
        >>> hooks.enabled, hooks.disabled_reason
        (False, 'profiling is not enabled')
        """
        cfg = config if isinstance(config, ProfilerConfig) else ProfilerConfig.from_dict(config)
        cfg.validate()
        if not cfg.enable:
            return cls(None, trainer_id)
        from coordinator.client.step_client import StepClient

        try:
            coord, run = _attach(cfg, workers, trainer_id, role, (name, namespace), advances_step)
        except ValueError:
            raise
        except Exception as exc:  # unreachable: profiling off, training on
            hooks = cls(None, trainer_id)
            _switch_off(hooks, "attach", exc)
            return hooks
        # The coordinator itself waits up to worker_timeout_s for the ranks of a report.
        client = StepClient(coord, trainer_id, timeout_s=cfg.worker_timeout_s + REPORT_MARGIN_S)
        return _with_feed(cls(client, trainer_id, coord, dict(run)), cfg, tracker)

    @property
    def enabled(self) -> bool:
        """Profiling is on and the coordinator answers."""
        return self._client is not None and self._down_since is None

    @property
    def phase(self) -> str:
        """What the last step report said the next step does: idle, warmup or recording."""
        c = self._client
        if c is None or self._down_since is not None:
            return "off"
        if c.last_reply is None:
            return "idle"
        nxt = c.next_sync_step
        if self._last_step is not None and (nxt is None or self._last_step + 1 < nxt):
            return "idle"
        return str(c.last_reply.get("phase", "idle"))

    def session(self, first_step: int = 0) -> _Session:
        """``start`` now and ``stop`` at the end, even on an exception (sync or async ``with``).

        Args:
            first_step: the first global step the loop runs; on resume, the step loaded from
                the checkpoint, so that windows land on the same absolute steps.

        Returns:
            A context manager for ``with`` and ``async with``; it gives the hooks.

        Example:

        >>> hooks = ProfilingHooks.attach(None, workers=[])
        >>> with hooks.session(first_step=0):
        ...     for step in range(3):
        ...         hooks.step(step)
        >>> hooks.phase
        'off'
        """
        return _Session(self, first_step)

    def region(self, name: str) -> Region:
        """Time a named part of the step: ``with hooks.region("generate"): ...`` (or
        ``async with``). Each step's regions and wall time ride on the step reports the hooks
        already send (``phase_times()``, ``ray-profiler phases``); no call of their own.

        Args:
            name: the region's name (1..64 characters; at most 32 names per run).

        Returns:
            A context manager for ``with`` and ``async with``; a no-op when profiling is off.

        Example:

        >>> hooks = ProfilingHooks.attach(None, workers=[])
        >>> with hooks.region("generate"):
        ...     pass
        """
        return Region(self._clock, name)

    def add_role(self, role: str, workers: list[Any] | dict[int, Any]) -> str | None:
        """Register another group of this trainer's workers, e.g. generation as ``rollout``:
        the ranks the config's ``roles`` selects are profiled on the same global steps as
        those ``attach`` registered. They never advance the step.

        Returns:
            Their trainer id (``<trainer_id>.<role>``), or None when profiling is off.

        Raises:
            ValueError: a bad role, or ranks the config selects that ``workers`` lack.
        """
        from coordinator.core.validate import role_problem

        if problem := role_problem(role):
            raise ValueError(problem)
        if self._client is None or self.coordinator is None:
            return None
        tid = f"{self.trainer_id}.{role}"
        try:
            _register(self.coordinator, tid, workers, role, False)
        except ValueError:
            raise
        except Exception as exc:  # unreachable: that role goes unprofiled, training goes on
            log.warning("profiler: role %r of %r not registered: %s", role, self.trainer_id, exc)
            return None
        return tid

    def start(self, first_step: int = 0) -> None:
        self._call("start", lambda c: c.start(first_step))
        if self._clock is not None:
            self._clock.begin_step()

    def step(self, step: int) -> None:
        """Global step ``step`` has finished: call it once per step, after the step, like
        ``torch.profiler``'s ``step()``.

        Outside windows it costs at most one report every 0.1 s, never waited for; when ranks
        must act it returns once they are ready for step ``step + 1``. It never raises: a
        coordinator that stops answering pauses profiling (one bounded wait, once).

        Args:
            step: the global step that finished (the same numbering on every rank).

        Example::

            train_one_step(step)
            hooks.step(step)
        """
        self._last_step = step
        record = self._close_step(step)
        self._call("step", lambda c: c.step(step))
        _feed_step(self, step, record)
        if self._clock is not None:
            self._clock.begin_step()

    def stop(self) -> None:
        self._call("stop", lambda c: c.stop())
        _feed_flush(self)

    async def astart(self, first_step: int = 0) -> None:
        await self._acall("start", lambda c: c.astart(first_step))
        if self._clock is not None:
            self._clock.begin_step()

    async def astep(self, step: int) -> None:
        """The asyncio form of ``step``; never blocks the event loop.

        Args:
            step: the global step that finished.

        Example::

            async with hooks.session(first_step=0):
                for step in range(steps):
                    await train_one_step(step)
                    await hooks.astep(step)
        """
        self._last_step = step
        record = self._close_step(step)
        await self._acall("step", lambda c: c.astep(step))
        _feed_step(self, step, record)
        if self._clock is not None:
            self._clock.begin_step()

    def _close_step(self, step: int) -> list[Any] | None:
        """Step ``step``'s phase record to the client: it rides on the next report sent (kept,
        bounded, while the coordinator is away). Returns it."""
        if self._clock is None or self._client is None:
            return None
        record = self._clock.close_step(step)
        self._client.add_phases(record)
        return record

    async def astop(self) -> None:
        await self._acall("stop", lambda c: c.astop())
        _feed_flush(self)

    # A coordinator that stops answering (it died and Ray restarts it, or it is gone) costs the
    # trainer one bounded wait, once; then reports are skipped, and a probe sent at most every
    # RECONNECT_INTERVAL_S (never waited for) tells when it is back.
    RECONNECT_INTERVAL_S = 2.0

    def _call(self, what: str, fn: Any) -> None:
        if self._client is None or not _reachable(self, what):
            return
        try:
            fn(self._client)
        except Exception as exc:
            _went_down(self, what, exc)

    async def _acall(self, what: str, fn: Any) -> None:
        if self._client is None or not _reachable(self, what):
            return
        try:
            await fn(self._client)
        except Exception as exc:
            _went_down(self, what, exc)


def _reachable(self: ProfilingHooks, what: str) -> bool:
    """True when reports can go out; while the coordinator is down, a non-blocking check
    of the last probe (and a new probe now and then). ``stop`` waits a moment for it."""
    if self._down_since is None:
        return True
    import ray

    if what == "stop" and self._probe is None and self.coordinator is not None:
        self._probe = self.coordinator.ping.remote()
    probe, now = self._probe, time.monotonic()
    if probe is not None:
        wait_s = self.RECONNECT_INTERVAL_S if what == "stop" else 0
        ready, _ = ray.wait([probe], timeout=wait_s)
        if not ready:
            return False
        self._probe = None
        try:
            ray.get(probe)
        except Exception:
            self._next_probe = now + self.RECONNECT_INTERVAL_S
            return False
        assert self._client is not None
        self._client.resync()  # the next report waits, to learn where the plan stands
        log.warning(
            "profiling for trainer %r reconnected to the coordinator after %.1f s",
            self.trainer_id,
            now - self._down_since,
        )
        self._down_since, self.disabled_reason = None, None
        return True
    if now >= self._next_probe and self.coordinator is not None:
        self._probe = self.coordinator.ping.remote()
    return False


def _with_feed(hooks: ProfilingHooks, cfg: ProfilerConfig, tracker: Any) -> ProfilingHooks:
    """The hooks with a tracker feed when the config names trackers or ``tracker`` is given; a
    tracker that cannot be set up is reported and left out, never raised."""
    from trainers.trackers import make_tracker

    sink = make_tracker(cfg.trackers, hooks.run or hooks.trainer_id, tracker)
    if sink is not None and hooks.coordinator is not None:
        from coordinator.client.tracker_feed import TrackerFeed

        hooks._feed = TrackerFeed(hooks.coordinator, sink)
    return hooks


def _feed_step(hooks: ProfilingHooks, step: int, record: list[Any] | None) -> None:
    if hooks._feed is not None and hooks._down_since is None:
        hooks._feed.on_step(step, record)


def _feed_flush(hooks: ProfilingHooks) -> None:
    """At stop: the last phase means and the windows settled by now, then the trackers this
    process opened are closed."""
    feed, hooks._feed = hooks._feed, None
    if feed is None:
        return
    if hooks._down_since is None:
        feed.flush(timeout_s=FLUSH_S)
    close = getattr(feed.sink, "close", None)
    if close is not None:
        close()


def _went_down(self: ProfilingHooks, what: str, exc: BaseException) -> None:
    """The coordinator stopped answering: pause (reports skipped, a probe now and then)."""
    self.disabled_reason = f"{what}: {type(exc).__name__}: {exc}"[:2000]
    if self._down_since is None:
        log.warning(
            "profiling paused for trainer %r: the coordinator does not answer (%s); "
            "training goes on, and profiling resumes if it comes back",
            self.trainer_id,
            self.disabled_reason,
        )
    self._down_since = time.monotonic()
    self._next_probe = self._down_since + self.RECONNECT_INTERVAL_S
    self._probe = None
    if self._client is not None:
        self._client.forget_in_flight()


def _switch_off(self: ProfilingHooks, what: str, exc: BaseException) -> None:
    """Profiling off for good in these hooks (the coordinator was unreachable at attach)."""
    self._client = None
    self.disabled_reason = f"{what}: {type(exc).__name__}: {exc}"
    log.warning(
        "profiling switched off for trainer %r (%s); training goes on",
        self.trainer_id,
        self.disabled_reason,
    )


def _attach(
    cfg: ProfilerConfig,
    workers: Any,
    trainer_id: str,
    role: str,
    where: tuple[str, str],
    advances_step: bool | None,
) -> tuple[Any, Any]:
    """The coordinator (name, namespace in ``where``) attached and the workers registered; a
    refusal from the actor (a bad registration, a clash of runs) as a plain ValueError."""
    import ray

    from coordinator.client.connect import attach_coordinator

    try:
        coord, run = attach_coordinator(cfg, where[0], where[1], trainer_id=trainer_id)
    except ray.exceptions.RayTaskError as exc:
        _raise_refusal(exc)
    _register(coord, trainer_id, workers, role, advances_step)
    return coord, run


def _register(
    coord: Any, trainer_id: str, workers: Any, role: str, advances_step: bool | None
) -> None:
    """Register ``workers`` (and this driver); a refusal as a plain ValueError."""
    import ray

    try:
        driver = _driver(workers)
        ray.get(coord.register.remote(trainer_id, workers, role, advances_step, driver))
    except ray.exceptions.RayTaskError as exc:
        _raise_refusal(exc)


def _raise_refusal(exc: Any) -> None:
    """A ValueError from the actor as a plain ValueError (its last line); else ``exc``."""
    cause = exc.as_instanceof_cause()
    if isinstance(cause, ValueError):
        line = str(cause).strip().splitlines()[-1]
        raise ValueError(line.removeprefix("ValueError: ")) from None
    raise exc


def _driver(workers: Any) -> dict[str, Any] | None:
    """This driver's pid, node and stack dump, so ``stacks()`` reads it too; and a node agent
    on its node and on every node of ``workers`` (in the background: attach does not wait)."""
    try:
        import os
        import threading

        import ray

        from worker_ext.rank.stack_dump import enable_stack_dump

        handles = list(workers.values()) if isinstance(workers, dict) else list(workers)
        threading.Thread(target=_start_agents, args=(handles,), daemon=True).start()
        node = str(ray.get_runtime_context().get_node_id())
        return {"pid": os.getpid(), "node_id": node, "dump": dict(enable_stack_dump())}
    except Exception as exc:  # stacks of the driver are a convenience; attach goes on
        log.warning("profiler: the driver's stack will not be readable: %s", exc)
        return None


def _start_agents(workers: list[Any]) -> None:
    from worker_ext.rank.agent_link import ensure_node_agents

    try:
        ensure_node_agents(workers)
    except Exception as exc:
        log.warning("profiler: node agents not started for stacks: %s", exc)


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
