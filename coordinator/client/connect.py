"""Reaching the coordinator from a trainer, a notebook or a tool: create it (or find it) and
attach to a run, or connect to one that runs."""

from __future__ import annotations

import logging
import socket
from typing import Any

import ray

from coordinator.core.config import ProfilerConfig
from coordinator.protocol.names import DEFAULT_NAME, DEFAULT_NAMESPACE
from coordinator.protocol.replies import OpenRunReply

log = logging.getLogger(__name__)

_WARNED: set[tuple[str, str, str]] = set()


def attach_coordinator(
    config: ProfilerConfig | dict[str, Any],
    name: str = DEFAULT_NAME,
    namespace: str = DEFAULT_NAMESPACE,
    trainer_id: str | None = None,
) -> tuple[Any, OpenRunReply]:
    """The named, detached coordinator (created if it does not exist), attached to a run.

    Returns the handle and the ``OpenRunReply``: a coordinator whose run stopped begins a fresh
    run with ``config``; a running one keeps its config (``mismatch`` names the fields that
    differ, logged once). See ``get_or_create_coordinator`` for the arguments and errors.
    """
    cfg = config if isinstance(config, ProfilerConfig) else ProfilerConfig.from_dict(config)
    cfg.validate()
    if not ray.is_initialized():
        raise RuntimeError("ray is not initialised: call ray.init() before creating the profiler")
    handle = coordinator_handle(cfg, name, namespace)
    info: OpenRunReply = ray.get(handle.open_run.remote(cfg.to_dict(), trainer_id))
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


def coordinator_handle(cfg: ProfilerConfig, name: str, namespace: str) -> Any:
    """The named, detached coordinator's handle, the actor created with ``cfg`` if it does not
    exist (Ray initialised; nothing asked of it yet)."""
    from coordinator.service.actor import ProfilerCoordinator

    return ProfilerCoordinator.options(
        name=name, namespace=namespace, lifetime="detached", get_if_exists=True
    ).remote(cfg.to_dict(), name, namespace)


def get_or_create_coordinator(
    config: ProfilerConfig | dict[str, Any],
    name: str = DEFAULT_NAME,
    namespace: str = DEFAULT_NAMESPACE,
    trainer_id: str | None = None,
) -> Any:
    """The named, detached coordinator, created if it does not exist, attached to a run.

    Most trainers want ``ProfilingHooks.attach``, which calls this and registers the workers.

    Args:
        config: a ``ProfilerConfig`` or a dict of its fields (a YAML or OmegaConf mapping).
        name: the coordinator actor's name; one coordinator per job that runs at the same time.
        namespace: its Ray namespace.
        trainer_id: the trainer attaching; the stepping trainer attaching again (a restarted
            driver) resumes its run instead of starting a fresh one.

    Returns:
        The coordinator's actor handle.

    Raises:
        ValueError: a bad config, or a coordinator of that name that serves another active
            run with another config (the message says how to give this job its own).
        RuntimeError: Ray is not initialised.

    Example::

        ray.init()
        h = get_or_create_coordinator({"enable": True, "save_path": "/tmp/prof"})
        ray.get(h.register.remote("sft", workers))
    """
    return attach_coordinator(config, name, namespace, trainer_id)[0]


def connect(
    name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE, address: str | None = None
) -> Any:
    """A handle to a running coordinator.

    Args:
        name: the coordinator actor's name.
        namespace: its Ray namespace.
        address: a cluster to join first (``auto`` or ``HOST:PORT``) when Ray is not
            initialised in this process; it is probed first, so a dead address fails at once.

    Returns:
        The coordinator's actor handle (call ``status``, ``kernel_summary``, ... on it).

    Raises:
        ValueError: no coordinator of that name in that namespace.
        ConnectionError: nothing answers at ``address``.
        RuntimeError: Ray is not initialised and no ``address`` was given.

    Example::

        h = connect(address="auto")
        ray.get(h.status.remote())["global_step"]
    """
    if not ray.is_initialized():
        if address is None:
            raise RuntimeError("ray is not initialised: call ray.init(address='auto') first")
        _join(address, namespace)
    where = f" on the cluster at {address}" if address else ""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        raise ValueError(
            f"no profiler coordinator named {name!r} in namespace {namespace!r}{where}"
        ) from None


def address_problem(address: str) -> str | None:
    """Why nothing can answer at ``HOST:PORT`` (None: something listens, or ``auto``).

    ``ray.init`` retries a dead address for minutes, so callers probe first and fail fast.

    >>> address_problem("auto") is None
    True
    >>> address_problem("127.0.0.1:1").startswith("no Ray cluster answers at 127.0.0.1:1")
    True
    """
    if address == "auto":
        return None
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=3).close()
    except (OSError, ValueError) as exc:
        return f"no Ray cluster answers at {address} ({exc})"
    return None


def _join(address: str, namespace: str) -> None:
    problem = address_problem(address)
    if problem:
        raise ConnectionError(problem)
    try:
        ray.init(
            address=address,
            namespace=namespace,
            log_to_driver=False,
            logging_level=logging.ERROR,
            configure_logging=False,
        )
    except ConnectionError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConnectionError(f"no Ray cluster found at {address}: {first}") from None


__all__ = [
    "DEFAULT_NAME",
    "DEFAULT_NAMESPACE",
    "address_problem",
    "attach_coordinator",
    "connect",
    "get_or_create_coordinator",
]
