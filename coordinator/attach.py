"""Reaching the coordinator: create it (or find it) and attach to a run, or connect to it."""

from __future__ import annotations

import logging
from typing import Any

import ray

from coordinator.actor import ProfilerCoordinator
from coordinator.config import ProfilerConfig
from coordinator.replies import RunInfo

log = logging.getLogger(__name__)

DEFAULT_NAME = "profiler"
DEFAULT_NAMESPACE = "profiler"
_WARNED: set[tuple[str, str, str]] = set()


def attach_coordinator(
    config: ProfilerConfig | dict[str, Any],
    name: str = DEFAULT_NAME,
    namespace: str = DEFAULT_NAMESPACE,
    trainer_id: str | None = None,
) -> tuple[Any, RunInfo]:
    """The named, detached coordinator (created if it does not exist), attached to a run.

    Returns the handle and the ``RunInfo``: a coordinator whose run stopped begins a fresh run
    with ``config``; a running one keeps its config (``mismatch`` names the fields that differ,
    logged once); ValueError when another active run has another config. Ray must be
    initialised.
    """
    cfg = config if isinstance(config, ProfilerConfig) else ProfilerConfig.from_dict(config)
    cfg.validate()
    if not ray.is_initialized():
        raise RuntimeError("ray is not initialised: call ray.init() before creating the profiler")
    handle = ProfilerCoordinator.options(
        name=name, namespace=namespace, lifetime="detached", get_if_exists=True
    ).remote(cfg.to_dict(), name, namespace)
    info: RunInfo = ray.get(handle.open_run.remote(cfg.to_dict(), trainer_id))
    key = (namespace, name, info["run"])
    if info["mismatch"] and key not in _WARNED:
        _WARNED.add(key)
        log.warning(
            "profiler coordinator %s/%s keeps the config of its running run %s "
            "(fields that differ from yours: %s)",
            namespace,
            name,
            info["run"],
            ", ".join(info["mismatch"]),
        )
    return handle, info


def get_or_create_coordinator(
    config: ProfilerConfig | dict[str, Any],
    name: str = DEFAULT_NAME,
    namespace: str = DEFAULT_NAMESPACE,
    trainer_id: str | None = None,
) -> Any:
    """The named, detached coordinator, attached to a run (see ``attach_coordinator``)."""
    return attach_coordinator(config, name, namespace, trainer_id)[0]


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
    "attach_coordinator",
    "connect",
    "get_or_create_coordinator",
]
