"""An attached process's first optimizer step, and every step after it (``worker_ext.attach``).

The first step reads the config (``RAY_PROFILER_CONFIG``), says who the process is
(``coordinator.core.attach.identify``) and attaches a ``RankSession`` for it. From then on each
optimizer step is a step of that session: step ``k`` is the process's ``k``-th optimizer step
(as Hugging Face's ``global_step`` counts them), so the first step, spent attaching, is never
in a window. Windows, captures and the step reports are ``RankSession``'s.

What the windows count: the steps of one optimizer, the first the process stepped; a second
optimizer's steps are not counted (said once, in the log and ``status()``); when the counted
optimizer is gone (freed), the next one stepped takes its place. Steps from a thread other
than the first step's never touch the profiler (torch.profiler is not safe across threads).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from coordinator.core.attach import CONFIG_ENV, Attach, Identity, identify, read_source
from coordinator.core.config import ProfilerConfig
from coordinator.protocol.names import DEFAULT_NAME, DEFAULT_NAMESPACE
from worker_ext.rank.process_place import actor_rank, dist_rank, process_where, train_rank
from worker_ext.rank.rank_session import RankSession, with_train_storage

log = logging.getLogger(__name__)
Step = Callable[[Any], None]
_thread_id = threading.get_ident


def first_step(optimizer: Any) -> Step | None:
    """Attach this process at its first optimizer step; returns what each later step runs, or
    None when the process is left alone (the hook's own ``nothing`` then: this module never
    imports the hook, which Ray runs below trainers)."""
    try:
        mapping = read_source(os.environ.get(CONFIG_ENV))
        if not mapping.get("enable") or skyrl_switch(mapping):
            return None  # (off; or SkyRL's profiler calls drive it: worker_ext.rank.skyrl_profiler)
        cfg = ProfilerConfig.from_dict(with_train_storage(mapping))
    except ValueError as exc:
        _refused(str(exc), process_where(), DEFAULT_NAME, DEFAULT_NAMESPACE)
        return None
    who = identify(cfg.attach, dist_rank(), train_rank(), actor_rank())
    name, namespace = cfg.attach.name, cfg.attach.namespace
    if isinstance(who, str):
        if cfg.attach.actor_classes is not None and "attach.actor_classes" in who:
            log.info("profiler: not attached: %s", who)  # (left alone, as asked)
            return None
        _refused(who, process_where(), name, namespace)
        return None
    attached = {**process_where(), "source": who.source, "optimizer": type(optimizer).__name__}
    session = RankSession.attach(
        cfg, who.trainer_id, cfg.attach.role, who.rank, who.world_size, name, namespace, attached
    )
    if _is_off(session):
        return None  # (RankSession said why, once)
    done = steps_taken(optimizer) or 1  # (resumed from a checkpoint: its count goes on)
    session.start(first_step=done + 1)  # (this first step was spent attaching)
    if _is_off(session):
        return None
    session.keep_last_steps()  # (its process ends with no loop end: its agent reports it)
    log.info("profiler: attached as %s at optimizer step %d, counting %s steps",
             who.describe(), done, attached["optimizer"])  # fmt: skip
    return AttachedRank(session, who, optimizer, done).step


class AttachedRank:
    """The steps of an attached rank (see the module docstring)."""

    def __init__(self, session: RankSession, who: Identity, optimizer: Any, done: int) -> None:
        self.session, self.who = session, who
        self.count = done  # optimizer steps done (the last one attached)
        self._counted = weakref.ref(optimizer)
        self._thread = threading.get_ident()
        self._said: set[str] = set()

    def step(self, optimizer: Any) -> None:
        """One optimizer step has finished: a step of the session when it is the counted
        optimizer's, on the training thread."""
        if optimizer is self._counted() and _thread_id() == self._thread:
            self.count += 1
            self.session.step(self.count)
        else:
            self._other(optimizer)

    def _other(self, optimizer: Any) -> None:
        if _thread_id() != self._thread:
            self._once(
                "thread",
                f"an optimizer ({type(optimizer).__name__}) stepped on another thread than the "
                "training thread: its steps are not counted and never touch the profiler",
            )
        elif self._counted() is None:  # the counted optimizer is gone: this one counts now
            self._counted = weakref.ref(optimizer)
            self.step(optimizer)
        else:
            counted = type(self._counted()).__name__
            self._once(
                "optimizer",
                f"a second optimizer ({type(optimizer).__name__}) steps in this process: the "
                f"windows count the steps of the first one ({counted}) only",
            )

    def _once(self, kind: str, what: str) -> None:
        if kind in self._said:
            return
        self._said.add(kind)
        log.warning("profiler: %s: %s", self.who.describe(), what)
        tell_problem(self.session.coordinator, process_where(self.who), what)


def steps_taken(optimizer: Any, look_at: int = 64) -> int | None:
    """How many steps ``optimizer`` has taken, this one included, as its own state counts
    them: the ``step`` that Adam, AdamW, RMSprop, Adagrad and most others keep per
    parameter, which ``load_state_dict`` restores, so a process resumed from a checkpoint
    (a Ray Train worker group restarted after a failure) goes on counting where the
    checkpoint was. None when the state has no count (SGD), or it cannot be read; only the
    first ``look_at`` parameters are looked at (those without a gradient have no state).
    Read once, at the process's first optimizer step."""
    try:
        state = optimizer.state
        params = (p for group in optimizer.param_groups for p in group["params"])
        for _, param in zip(range(look_at), params, strict=False):
            count = state.get(param, {}).get("step")
            if count is not None:
                value = float(count.item() if hasattr(count, "item") else count)
                return int(value) if value >= 1 and value.is_integer() else None
    except Exception as exc:  # (an optimizer of its own kind: count from this step)
        log.debug("profiler: the optimizer's step count is unreadable: %r", exc)
    return None


def skyrl_loaded(module: Any, driven_elsewhere: Callable[[Step], None]) -> None:
    """SkyRL's profiler module has run in this process: with ``attach.skyrl`` on, its
    ``Profiler`` (what ``build_profiler_from_policy_cfg`` builds) becomes the coordinated one,
    which hands the hook's ``driven_elsewhere`` its optimizer step count; otherwise it is left
    as SkyRL ships it."""
    try:
        mapping = read_source(os.environ.get(CONFIG_ENV))
        on = bool(mapping.get("enable")) and skyrl_switch(mapping)
    except ValueError as exc:  # (SkyRL's profiler, as shipped, is built; the log says why)
        log.error("profiler: SkyRL's profiler is left as it is: %s", exc)
        return
    if on:
        from worker_ext.rank import skyrl_profiler

        skyrl_profiler.optimizer_steps_to = driven_elsewhere
        module.Profiler = skyrl_profiler.SkyRLProfiler


def skyrl_switch(mapping: Any) -> bool:
    """``attach.skyrl`` of a config mapping, read from its ``attach`` section alone (SkyRL's
    config brings the rest, ``save_path`` included). Raises ValueError for a bad section."""
    return Attach.from_value(mapping.get("attach") or {}).validate().skyrl


def tell_problem(coordinator: Any, where: dict[str, Any], problem: str) -> None:
    """One line for ``status()["attach_problems"]``, not waited for; never raises."""
    try:
        coordinator.attach_problem.remote(where, problem)
    except Exception as exc:  # the coordinator is away: the log has it
        log.debug("profiler: attach problem not sent: %s", exc)


def _refused(problem: str, where: dict[str, Any], name: str, namespace: str) -> None:
    """Not profiled: one error in this worker's log, and in the coordinator's ``status()``
    when one is running (none is started for it)."""
    log.error("profiler: this process is not profiled (%s); training goes on", problem)
    try:
        import ray

        if ray.is_initialized():
            tell_problem(ray.get_actor(name, namespace=namespace), where, problem)
    except ValueError as exc:  # no coordinator of that name: the log has it
        log.debug("profiler: no coordinator %s/%s to tell: %s", namespace, name, exc)
    except Exception as exc:  # (anything else is a fault of ours: said, never raised)
        log.warning("profiler: could not tell coordinator %s/%s: %r", namespace, name, exc)


def _is_off(session: RankSession) -> bool:
    return session.disabled_reason is not None
