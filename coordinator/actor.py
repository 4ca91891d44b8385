"""ProfilerCoordinator: the named, detached Ray actor that owns the schedule and the global step.

A thin shell: it asks ``WindowDriver`` what the ranks must do, fans the calls out to the selected
ranks only, waits for their acknowledgements, and hands every reply to ``CoordinatorState``.
It never imports torch and never raises a rank's fault to a trainer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
from typing import Any

import ray

from coordinator.config import ProfilerConfig
from coordinator.metrics import CoordinatorMetrics
from coordinator.schedule import Schedule
from coordinator.state import CoordinatorState, RankRecord, TrainerRecord, WindowRecord
from coordinator.trace_layout import contained, default_run_name
from coordinator.window_driver import Begin, End, Ignored, Step, WindowDriver
from coordinator.worker_handles import install_worker_handle_stubs

log = logging.getLogger(__name__)

DEFAULT_NAME = "profiler"
DEFAULT_NAMESPACE = "profiler"
_TRAINER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# Configuring a rank warms Kineto up, which took up to 41 s on a loaded 2-core machine.
CONFIGURE_TIMEOUT_S = 120.0
_LOST = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError)


class _Coordinator:
    """The actor's implementation; use ``get_or_create_coordinator`` to make one."""

    def __init__(self, config: dict[str, Any], name: str, namespace: str) -> None:
        self._stubs = install_worker_handle_stubs()  # before any worker handle arrives
        self.config = ProfilerConfig.from_dict(config, check_paths=False)
        self.name, self.namespace = name, namespace
        cfg = self.config
        self.run_name = cfg.run_name or default_run_name()
        self.run_dir = contained(cfg.save_path, self.run_name) if cfg.save_path else None
        self.driver = WindowDriver(Schedule(cfg))
        self.state = CoordinatorState(cfg.max_windows, cfg.detail_windows, cfg.straggler_threshold)
        self._lock = asyncio.Lock()
        self._capture_ranks: dict[int, list[tuple[str, int]]] = {}
        self._metrics = CoordinatorMetrics(name)

    # ------------------------------------------------------------ trainer API

    async def register(
        self,
        trainer_id: str,
        workers: list[Any] | dict[int, Any],
        role: str = "policy",
        advances_step: bool | None = None,
    ) -> dict[str, Any]:
        """Register a trainer's workers (a list in rank order, or {rank: handle}).

        The first trainer advances the global step unless another registers with
        ``advances_step=True``. Re-registering a ``trainer_id`` replaces its handles and keeps
        the global step and the window history. Raises ValueError for a bad registration.
        """
        async with self._lock:
            handles = _rank_handles(trainer_id, workers)
            if not isinstance(trainer_id, str) or not _TRAINER_ID.match(trainer_id):
                raise ValueError(
                    f"trainer_id {trainer_id!r} must be 1-64 letters, digits, '.', '_' or '-'"
                )
            world = sorted(handles)
            cfg = self.config
            if cfg.ranks != "all":
                outside = [r for r in cfg.ranks if r not in handles]
                if outside:
                    raise ValueError(
                        f"profiler config selects ranks {outside}, which trainer {trainer_id!r} "
                        f"does not have (its ranks: {_span(world)})"
                    )
            st = self.state
            first = not st.trainers
            run_dir = self.run_dir
            existing = st.trainers.get(trainer_id)
            if existing is not None:
                run_dir = existing.run_dir
            elif not first and self.run_dir is not None:
                run_dir = contained(self.run_dir, trainer_id)  # a second trainer: own directory
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
            cfg_dict = cfg.to_dict()
            report_to = {"name": self.name, "namespace": self.namespace, "trainer_id": trainer_id}
            await self._fan_out(
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
                "run_dir": run_dir,
            }

    async def start(self, trainer_id: str, first_step: int = 0) -> dict[str, Any]:
        """Before the loop: the next step to run is ``first_step`` (the loaded step on resume)."""
        async with self._lock:
            rejected = self._reject(trainer_id, "start")
            if rejected:
                return rejected
            if isinstance(first_step, bool) or not isinstance(first_step, int) or first_step < 0:
                return self._refuse("start", f"first_step must be an int >= 0, got {first_step!r}")
            st = self.state
            st.global_step = first_step - 1 if first_step > 0 else st.global_step
            await self._run(self.driver.start(first_step))
            return self._step_reply(True)

    async def step(
        self, trainer_id: str, k: int, plan_version: int | None = None
    ) -> dict[str, Any]:
        """Global step ``k`` has finished. Returns once the ranks that act are ready for k+1.

        ``plan_version``: the latest one the trainer saw in a reply (``StepClient`` sends it);
        a capture it had not seen yet does not open on this report.
        """
        async with self._lock:
            rejected = self._reject(trainer_id, "step")
            if rejected:
                return rejected
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                return self._refuse("step", f"step must be an int >= 0, got {k!r}")
            if plan_version is not None and (
                isinstance(plan_version, bool) or not isinstance(plan_version, int)
            ):
                return self._refuse("step", f"plan_version must be an int, got {plan_version!r}")
            result = self.driver.step(k, plan_version)
            if isinstance(result, Ignored):
                self.state.counters["ignored_steps"] += 1
                self.state.counters[f"ignored_steps_{result.reason}"] += 1
                return {**self._step_reply(False), "ignored": result.reason}
            self.state.global_step = k
            await self._run(result)
            return self._step_reply(True)

    async def stop(self, trainer_id: str) -> dict[str, Any]:
        """After the loop: close an open window (partial) and collect what is pending.

        Safe to call twice, without start, and after a failure.
        """
        async with self._lock:
            rejected = self._reject(trainer_id, "stop")
            if rejected:
                return rejected
            await self._run(self.driver.stop())
            pending = {k for w in self.state.windows.values() for k in w.pending}
            if pending:
                wait_s = min(30.0, self.config.worker_timeout_s / 2)
                await self._fan_out(sorted(pending), "dump_profiler_summary", lambda _: (wait_s,))
            return self._step_reply(True)

    # ------------------------------------------------------------ readers

    async def status(self) -> dict[str, Any]:
        """Everything about the run, JSON-serialisable; the README documents every key."""
        st, drv = self.state, self.driver
        cur = drv.current
        return {
            "name": self.name,
            "namespace": self.namespace,
            "phase": self._phase(),
            "config": self.config.to_dict(),
            "run_dir": self.run_dir,
            "global_step": st.global_step,
            "current_window": cur.to_dict() if cur else None,
            "next_window": (drv.next_window().to_dict() if drv.next_window() else None),
            "windows": [w.to_dict() for w in st.closed_windows()],
            "trainers": [
                t.to_dict(t.trainer_id == st.stepping_trainer) for t in st.trainers.values()
            ],
            "ranks": [r.to_dict() for r in st.ranks.values()],
            "counters": {
                "worker_rpcs": 0,
                "ignored_steps": 0,
                "rejected_steps": 0,
                "skipped_windows": drv.skipped_windows,
                **dict(st.counters),
            },
            "metrics": self._metrics.snapshot(),
            "process": {
                "pid": os.getpid(),
                "torch_loaded": "torch" in sys.modules,
                "worker_handle_stubs": self._stubs,
            },
        }

    async def kernel_summary(
        self,
        window: int | None = None,
        top_k: int = 20,
        trainer_id: str | None = None,
        per_rank: bool = False,
    ) -> dict[str, Any]:
        """Cross-rank kernel table for the latest closed window, or for ``window``.

        ``per_rank=True`` adds each top kernel's self time on every rank (recent windows only).
        """
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")
        return self.state.kernel_summary(window, top_k, trainer_id, per_rank)

    async def request_capture(
        self,
        active: int = 1,
        warmup: int = 1,
        ranks: list[int] | None = None,
        start_step: int | None = None,
    ) -> dict[str, Any]:
        """Profile ``active`` steps from ``start_step`` (default: as soon as possible).

        Answers at once: ``{"accepted": True, "window", "steps": [first, last], "ranks"}`` or
        ``{"accepted": False, "reason"}``. ``ranks=None`` means the configured ranks.
        """
        async with self._lock:
            for name, value, low in (("active", active, 1), ("warmup", warmup, 0)):
                if isinstance(value, bool) or not isinstance(value, int) or value < low:
                    return _refused(f"{name} must be an int >= {low}, got {value!r}")
            if start_step is not None and (
                isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0
            ):
                return _refused(f"start_step must be an int >= 0 or None, got {start_step!r}")
            st = self.state
            tid = st.stepping_trainer
            if tid is None:
                return _refused("no trainer is registered with the coordinator")
            if not self.config.enable:
                return _refused("profiling is disabled in this coordinator's config")
            world = st.trainers[tid].ranks
            if ranks is None:
                wanted = [r for r in world if self.config.selects(r)]
            else:
                if not isinstance(ranks, (list, tuple)) or not all(
                    isinstance(r, int) and not isinstance(r, bool) for r in ranks
                ):
                    return _refused(f"ranks must be a list of ints or None, got {ranks!r}")
                unknown = sorted(set(ranks) - set(world))
                if unknown:
                    return _refused(
                        f"unknown ranks {unknown}: trainer {tid!r} has ranks {_span(world)}"
                    )
                wanted = sorted(set(ranks))
            keys = [(tid, r) for r in wanted]
            down = [
                r for (t, r) in keys if st.ranks[(t, r)].selected and not st.ranks[(t, r)].active
            ]
            if down:
                return _refused(
                    f"ranks {down} cannot profile: "
                    + "; ".join(f"rank {r} is {st.ranks[(tid, r)].state}" for r in down)
                )
            planned = self.driver.request_capture(warmup, active, start_step)
            if isinstance(planned, str):
                st.counters["captures_refused"] += 1
                return _refused(planned)
            await self._configure_for_capture(keys)
            self._capture_ranks[planned.index] = keys
            st.counters["captures_requested"] += 1
            return {
                "accepted": True,
                "window": planned.index,
                "steps": [planned.first, planned.last],
                "warmup_start": planned.warmup_start,
                "ranks": wanted,
            }

    async def cancel_capture(self, window: int) -> dict[str, Any]:
        """Drop a requested capture that has not opened yet."""
        async with self._lock:
            why = self.driver.cancel_capture(window)
            if why is not None:
                return {"cancelled": False, "reason": why}
            self._capture_ranks.pop(window, None)
            self.state.counters["captures_cancelled"] += 1
            return {"cancelled": True, "window": window}

    async def _configure_for_capture(self, keys: list[tuple[str, int]]) -> None:
        """Ranks the config does not select are configured for this capture only."""
        st = self.state
        fresh = [k for k in keys if not st.ranks[k].selected]
        if not fresh:
            return
        for key in fresh:
            st.ranks[key].selected = True
        tid = fresh[0][0]
        report_to = {"name": self.name, "namespace": self.namespace, "trainer_id": tid}
        run_dir = st.trainers[tid].run_dir
        base = self.config.to_dict()
        await self._fan_out(
            fresh,
            "configure_profiler",
            lambda key: (key[1], {**base, "ranks": [key[1]]}, run_dir, False, report_to),
            timeout=max(CONFIGURE_TIMEOUT_S, self.config.worker_timeout_s),
        )

    async def ingest_summary(self, trainer_id: str, rank: int, blob: bytes) -> bool:
        """A rank pushes its summary here as soon as it is built (off its training thread)."""
        key = (trainer_id, rank)
        if key not in self.state.ranks:
            self.state.counters["unexpected_summaries"] += 1
            return True  # nobody will ever want it: do not make the rank keep it
        self.state.counters["summaries_pushed"] += 1
        self.state.ingest_summary(key, blob)
        self._metrics.export(self.state)
        return True

    async def summary_failed(
        self, trainer_id: str, rank: int, window: int, reason: dict[str, Any]
    ) -> bool:
        """A rank's node agent could not build its summary of ``window`` (or died): say why."""
        key = (trainer_id, rank)
        if key not in self.state.ranks or not isinstance(reason, dict):
            self.state.counters["unexpected_summaries"] += 1
            return False
        reason = {str(k): str(v)[:1000] for k, v in list(reason.items())[:8]}
        return self.state.summary_failed(key, window, reason)

    async def trace_stored(
        self, trainer_id: str, rank: int, window: int, path: str | None, error: Any = None
    ) -> bool:
        """The node agent finished a rank's trace of ``window``: its final ``path``, or why not."""
        key = (trainer_id, rank)
        if key not in self.state.ranks or not (path is None or isinstance(path, str)):
            self.state.counters["unexpected_trace_reports"] += 1
            return False
        if error is not None:
            if not isinstance(error, dict):
                error = {"message": str(error)}
            error = {str(k): str(v)[:1000] for k, v in list(error.items())[:8]}
        return self.state.trace_stored(key, window, path and path[:4096], error)

    async def get_config(self) -> dict[str, Any]:
        return self.config.to_dict()

    # ------------------------------------------------------------ internals

    async def _join_open_window(self, keys: list[tuple[str, int]]) -> None:
        """Ranks registered while a window is open (a restarted driver) join it now."""
        rec, cur = self.state.current_window(), self.driver.current
        if rec is None or cur is None or self.driver.last_step is None:
            return
        rec.participants.update(keys)
        w, nxt = cur.to_dict(), self.driver.last_step + 1
        await self._fan_out(keys, "start_profile", lambda _: (w, nxt))

    def _reject(self, trainer_id: str, what: str) -> dict[str, Any] | None:
        st = self.state
        if trainer_id == st.stepping_trainer:
            return None
        if st.stepping_trainer is None:
            why = f"no trainer is registered; call register({trainer_id!r}, workers) first"
        else:
            why = (
                f"trainer {trainer_id!r} does not advance the global step; "
                f"{st.stepping_trainer!r} does (register with advances_step=True to take over)"
            )
        st.counters["rejected_steps" if what == "step" else f"rejected_{what}"] += 1
        if st.counters[f"warned_{trainer_id}"] == 0:
            log.warning("%s rejected: %s", what, why)
            st.counters[f"warned_{trainer_id}"] += 1
        return {**self._step_reply(False), "rejected": why}

    def _refuse(self, what: str, why: str) -> dict[str, Any]:
        self.state.counters[f"refused_{what}"] += 1
        return {**self._step_reply(False), "rejected": why}

    def _step_reply(self, applied: bool) -> dict[str, Any]:
        self._metrics.export(self.state)
        cur = self.driver.current
        return {
            "applied": applied,
            "global_step": self.state.global_step,
            "phase": self._phase(),
            "window": cur.index if cur else None,
            "next_sync_step": self._next_sync_step(),
            "plan_version": self.driver.plan_version,
        }

    def _next_sync_step(self) -> int | None:
        """The first step k whose ``step(k)`` makes ranks act, so the trainer must wait for it.

        Reports of earlier steps change no rank's state, and a client may send them without
        waiting (``coordinator.client.StepClient`` does). None: no window is planned.
        """
        drv = self.driver
        nxt = (drv.last_step + 1) if drv.last_step is not None else 0
        if drv.current is not None:
            return nxt
        upcoming = drv.next_window()
        if upcoming is None:
            return None
        return max(nxt, upcoming.warmup_start - 1)

    def _phase(self) -> str:
        cur = self.driver.current
        if cur is None:
            return "idle"
        nxt = (self.driver.last_step + 1) if self.driver.last_step is not None else 0
        return "warmup" if nxt < cur.first else "recording"

    async def _run(self, commands: list) -> None:
        """Send each command to the ranks of the open window, in order, and record replies."""
        st = self.state
        for cmd in commands:
            if isinstance(cmd, Begin):
                keys = self._capture_ranks.pop(cmd.window.index, None)
                if keys is None:  # a scheduled window: the ranks the config selects
                    keys = [
                        k for k, r in st.ranks.items() if r.active and self.config.selects(k[1])
                    ]
                keys = [k for k in keys if st.ranks[k].active]
                rec = st.open_window(cmd.window, keys)
                w = cmd.window.to_dict()
                await self._fan_out(keys, "start_profile", lambda _, w=w, s=cmd.step: (w, s))
                continue
            rec = st.current_window()
            if rec is None:
                continue
            keys = sorted(rec.participants)
            if isinstance(cmd, Step):
                await self._fan_out(keys, "profile_step", lambda _, k=cmd.step: (k,))
                if cmd.closes:
                    self._closed(rec)
            elif isinstance(cmd, End):
                await self._fan_out(keys, "stop_profile", lambda _: ())
                self._closed(rec)

    def _closed(self, rec: WindowRecord) -> None:
        self.state.close_window(rec)

    async def _fan_out(
        self,
        keys: list[tuple[str, int]],
        method: str,
        args_for: Any,
        timeout: float | None = None,
    ) -> None:
        """Call ``method`` on every active rank in ``keys``; wait up to the worker timeout."""
        st = self.state
        tasks: dict[tuple[str, int], asyncio.Future] = {}
        for key in keys:
            if not st.ranks[key].active:
                continue
            handle = st.trainers[key[0]].handles[key[1]]
            try:
                ref = getattr(handle, method).remote(*args_for(key))
            except Exception as exc:
                st.rank_failed(key, "disabled", _reason("coordinator", exc))
                continue
            st.counters["worker_rpcs"] += 1
            st.counters[f"worker_rpcs_{method}"] += 1
            tasks[key] = asyncio.ensure_future(_await(ref))
        if not tasks:
            return
        timeout = timeout or self.config.worker_timeout_s
        _, late = await asyncio.wait(tasks.values(), timeout=timeout)
        for key, task in tasks.items():
            if task in late:
                task.cancel()
                st.rank_failed(
                    key,
                    "unresponsive",
                    {
                        "where": method,
                        "type": "Timeout",
                        "message": f"no answer to {method} within {timeout:g} s",
                    },
                )
            elif task.exception() is not None:
                exc = task.exception()
                state = "lost" if isinstance(exc, _LOST) else "disabled"
                st.rank_failed(key, state, _reason(method, exc))
            else:
                st.apply_reply(key, task.result())


def _refused(reason: str) -> dict[str, Any]:
    return {"accepted": False, "reason": reason}


async def _await(ref: Any) -> Any:
    return await ref


def _reason(where: str, exc: BaseException) -> dict[str, str]:
    return {"where": where, "type": type(exc).__name__, "message": str(exc)[:1000]}


def _span(ranks: list[int]) -> str:
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return str(ranks)


def _rank_handles(trainer_id: str, workers: Any) -> dict[int, Any]:
    if isinstance(workers, dict):
        handles = {}
        for r, h in workers.items():
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise ValueError(f"trainer {trainer_id!r}: worker rank {r!r} is not an int >= 0")
            handles[r] = h
    elif isinstance(workers, (list, tuple)):
        handles = dict(enumerate(workers))
    else:
        raise ValueError(
            f"trainer {trainer_id!r}: workers must be a list of actor handles in rank order "
            f"or a dict rank -> handle, got {type(workers).__name__}"
        )
    if not handles:
        raise ValueError(f"trainer {trainer_id!r}: no workers given")
    return handles


ProfilerCoordinator = ray.remote(num_cpus=0)(_Coordinator)


def get_or_create_coordinator(
    config: ProfilerConfig | dict[str, Any],
    name: str = DEFAULT_NAME,
    namespace: str = DEFAULT_NAMESPACE,
) -> Any:
    """The named, detached coordinator, created if it does not exist (Ray must be initialised).

    An existing coordinator keeps its own config; a different one passed here is logged.
    """
    cfg = config if isinstance(config, ProfilerConfig) else ProfilerConfig.from_dict(config)
    cfg.validate()
    if not ray.is_initialized():
        raise RuntimeError("ray is not initialised: call ray.init() before creating the profiler")
    handle = ProfilerCoordinator.options(
        name=name, namespace=namespace, lifetime="detached", get_if_exists=True
    ).remote(cfg.to_dict(), name, namespace)
    existing = ray.get(handle.get_config.remote())
    if existing != cfg.to_dict():
        log.warning(
            "profiler coordinator %s/%s already exists with another config; it keeps its own",
            namespace,
            name,
        )
    return handle


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
    "connect",
    "get_or_create_coordinator",
]
