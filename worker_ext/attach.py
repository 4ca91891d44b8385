"""Profile a Ray job with no change to its code: Ray's ``worker_process_setup_hook``.

    ray.init(runtime_env={
        "worker_process_setup_hook": "worker_ext.attach.setup",
        "env_vars": {"RAY_PROFILER_CONFIG": "/shared/profiler.yaml"},  # or the YAML text itself
    })

``setup`` runs in every worker process of the job before its first task or actor. It imports
the standard library and the config reader (``coordinator.core.attach``, with PyYAML), and
leaves torch alone (Ray sets ``OMP_NUM_THREADS`` for the worker after the hook: importing torch
here would give each rank more threads). It installs an
import watcher: when the training code imports ``torch.optim``, one optimizer step post-hook is
registered. A process that never steps an optimizer (a rollout engine, a data loader, a reward
model) is never touched: no RPC, no thread, no further import.

At its first optimizer step the process becomes a rank (``worker_ext.rank.attached``): it reads
its config from ``RAY_PROFILER_CONFIG``, says who it is (``torch.distributed``, else Ray Train, else
its actor class and index), attaches to the coordinator as an SPMD rank (``RankSession``) and
from then on steps its profiler on each optimizer step, on its own training thread. A fault,
a bad config or an unreachable coordinator switches its profiling off with one logged error
(and a line in ``status()["attach_problems"]`` where the coordinator can be reached); the
training goes on, and the hook never raises into ``optimizer.step()``.

With ``attach: {skyrl: true}`` the watcher also waits for SkyRL's profiler module: SkyRL's own
``torch_profiler_config`` and its ``start_profile`` / ``profile_step`` / ``stop_profile`` /
``dump_profiler_summary`` calls then drive the coordinator (``worker_ext.rank.skyrl_profiler``), and
optimizer steps attach nothing.

With ``enable: true`` and ``engine: kineto`` in the config (read by the same reader as the
first optimizer step's, ``coordinator.core.attach.read_source``), ``setup`` also puts
libkineto's daemon environment (``worker_ext.kineto_env()``) in the process, before torch is
imported: every worker of the job then polls the node's daemon. A process given
``kineto_env()``'s variables (an actor's ``env_vars``: ``kineto_env()`` leaves Ray's hook
variable out when the job's hook is this one) has the directory they name made instead. A
config that this kineto part cannot read turns only kineto off. ``kineto_setup`` is the hook
``kineto_env()`` names for ranks started without this one.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)
OPTIMIZER = "torch.optim.optimizer"
SKYRL_PROFILER = "skyrl.backends.skyrl_train.utils.profiler"
_lock = threading.Lock()
_installed = False
_step: Callable[[Any], None] | None = None  # what each optimizer step runs, once decided


def setup() -> None:
    """Ray's ``worker_process_setup_hook``: watch for ``torch.optim`` (see the module
    docstring). Safe to call twice; never raises."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    try:
        _kineto_part()
        os.register_at_fork(after_in_child=_forked)
        waiting = {}
        for name, loaded in WATCHED.items():
            module = sys.modules.get(name)
            if module is not None:
                loaded(module)
            else:
                waiting[name] = loaded
        if waiting:
            sys.meta_path.insert(0, _ImportWatch(waiting))
    except Exception as exc:  # never the training's problem
        log.error("profiler: the attach hook could not be set up (%s); not profiled", exc)


def _kineto_part() -> None:
    """libkineto's part of the hook, which never turns the rest of it off. A process given
    ``kineto_env()``'s variables (an actor's ``env_vars``; ``kineto_env()`` leaves Ray's hook
    variable out when the job has this hook) has its directory made or checked as
    ``kineto_setup`` does; else the config decides (``_kineto_environment``). A config this
    part cannot read (YAML nested too deep for the reader: ``RecursionError``) leaves engine
    kineto off in this process, said once here; the first optimizer step says it again."""
    if os.environ.get("KINETO_USE_DAEMON") == "1":
        kineto_setup()
        return
    try:
        _kineto_environment()
    except Exception as exc:
        log.error(
            "profiler: engine kineto is off in this process: its config could not be read (%s: %s)",
            type(exc).__name__,
            str(exc)[:200],
        )


def _kineto_environment() -> None:
    """The job's config, read by the attach hook's one reader (``read_source``), says
    ``enable: true`` and ``engine: kineto``: turn libkineto's daemon mode on in this process
    (``worker_ext.kineto_env()``), which only works before torch is imported. Every worker of
    the job then runs libkineto's polling thread; any other config leaves them untouched."""
    from coordinator.core.attach import CONFIG_ENV, engine_of

    if engine_of(os.environ.get(CONFIG_ENV)) != "kineto":
        return
    if "torch" in sys.modules:
        log.error("profiler: engine kineto, but torch was imported before the setup hook ran")
        return
    from worker_ext.agent.kineto_ipc import kineto_env

    try:
        env = kineto_env(setup_hook=False)
    except (OSError, ValueError) as exc:  # (the rank says so again when it is configured)
        log.error("profiler: engine kineto is off in this process: %s", exc)
        return
    for key, value in env.items():
        os.environ.setdefault(key, value)


def kineto_setup() -> None:
    """Ray's setup hook that ``worker_ext.kineto_env()`` names: make (or check) the daemon
    directory the process's libkineto variables name, on this node, before torch is imported
    (libkineto binds there once, at import). A directory refused turns libkineto's daemon mode
    off in this process, with the reason for the rank to report. Never raises."""
    from worker_ext.agent.kineto_ipc import prepare_process

    try:
        if "torch" in sys.modules:
            log.error("profiler: engine kineto's setup hook ran after torch was imported")
        why = prepare_process()
        if why is not None:
            log.error("profiler: %s", why)
    except Exception as exc:  # never the worker's problem
        log.error("profiler: engine kineto's setup hook failed (%s)", exc)


def on_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The optimizer step post-hook (every optimizer of the process). Never raises."""
    step = _step
    try:
        if step is not None:
            step(optimizer)
        else:
            _first(optimizer)
    except Exception as exc:  # an exception here would leave optimizer.step()
        _off(f"{type(exc).__name__}: {exc}")


def _first(optimizer: Any) -> None:
    """The process's first optimizer step: it becomes a rank, or is left alone for good."""
    global _step
    with _lock:
        if _step is not None:  # (another thread got here first)
            _step(optimizer)
            return
        from worker_ext.rank.attached import first_step

        _step = first_step(optimizer) or nothing


def _off(why: str) -> None:
    global _step
    log.error("profiler: attached profiling is off in this process (%s); training goes on", why)
    _step = nothing


def nothing(optimizer: Any) -> None:
    """What an optimizer step runs in a process that is not profiled (one function: whether a
    process is off is ``_step is nothing``)."""
    return None


def _forked() -> None:
    """A forked child shares nothing of its parent's profiling: it is never profiled (Ray and
    torch.profiler are not safe across fork)."""
    global _step
    parent = os.getppid()

    def forked(optimizer: Any) -> None:
        global _step
        _step = nothing
        log.warning(
            "profiler: an optimizer stepped in a process forked from pid %d; a forked child "
            "is not profiled (training goes on)",
            parent,
        )

    _step = forked


def driven_elsewhere(count: Callable[[Any], None] | None = None) -> None:
    """This process's profiling is driven by another path (SkyRL's profiler calls): its
    optimizer steps attach nothing; ``count``, when given, is called on each of them."""
    global _step
    with _lock:
        if _step is None or _step is nothing:
            _step = count or nothing


def _register(module: ModuleType) -> None:
    module.register_optimizer_step_post_hook(on_optimizer_step)


def _skyrl(module: ModuleType) -> None:
    """SkyRL's profiler module has run: with ``attach.skyrl``, its ``Profiler`` becomes the
    coordinated one (``worker_ext.rank.skyrl_profiler``)."""
    from worker_ext.rank.attached import skyrl_loaded

    skyrl_loaded(module, driven_elsewhere)


WATCHED: dict[str, Callable[[ModuleType], None]] = {
    OPTIMIZER: _register,
    SKYRL_PROFILER: _skyrl,
}
"""Modules whose loading the hook waits for, and what it does then."""


class _ImportWatch(importlib.abc.MetaPathFinder):
    """Finds each watched module through the other finders and runs its callback once the
    module has run; leaves ``sys.meta_path`` when it has seen them all."""

    def __init__(self, waiting: dict[str, Callable[[ModuleType], None]]) -> None:
        self.waiting = waiting

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.waiting:
            return None
        with _lock:
            loaded = self.waiting.pop(fullname, None)
            if not self.waiting and self in sys.meta_path:
                sys.meta_path.remove(self)
        if loaded is None:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec: importlib.machinery.ModuleSpec | None = (
                find(fullname, path, target) if find is not None else None
            )
            if spec is not None and spec.loader is not None:
                spec.loader = _RegisteringLoader(spec.loader, loaded)
                return spec
        return None


class _RegisteringLoader(importlib.abc.Loader):
    """The real loader, and the watcher's callback run after the module ran."""

    def __init__(self, loader: Any, loaded: Callable[[ModuleType], None]) -> None:
        self._loader, self._loaded = loader, loaded

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        module.__loader__ = self._loader  # (source lookups, tracebacks: the real loader)
        try:
            self._loaded(module)
        except Exception as exc:  # never the training's problem
            log.error("profiler: the attach hook failed on %s (%s)", module.__name__, exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
