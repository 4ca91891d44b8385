"""The profiling coordinator. Importing this package never imports torch or Ray.

Rooms by the process the code runs in:

- ``coordinator.core``: pure (config, schedule, window plan, runs, state, aggregation);
- ``coordinator.protocol``: what crosses Ray (replies, summary codec, rank RPCs, actor names);
- ``coordinator.service``: inside the coordinator actor;
- ``coordinator.client``: inside the trainer's process;
- ``coordinator.ops``: for operators (CLI, tables, notebook, plots, collect).

Every public name is imported on first use (``ProfilerCoordinator``, ``attach_coordinator``,
``get_or_create_coordinator`` and ``connect`` need Ray): a tool that reads traces or replies
loads only the modules it uses.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coordinator.client.connect import (
        attach_coordinator,
        connect,
        get_or_create_coordinator,
    )
    from coordinator.core.config import ProfilerConfig
    from coordinator.core.schedule import ProfilerAction, Schedule, Window
    from coordinator.service.actor import ProfilerCoordinator

_CORE_NAMES = {
    "ProfilerConfig": "coordinator.core.config",
    "ProfilerAction": "coordinator.core.schedule",
    "Schedule": "coordinator.core.schedule",
    "Window": "coordinator.core.schedule",
}

_CLIENT_NAMES = ("attach_coordinator", "get_or_create_coordinator", "connect")

__all__ = [
    "ProfilerAction",
    "ProfilerConfig",
    "ProfilerCoordinator",
    "Schedule",
    "Window",
    "attach_coordinator",
    "connect",
    "get_or_create_coordinator",
]


def __getattr__(name: str) -> Any:
    if name in _CORE_NAMES:
        import importlib

        return getattr(importlib.import_module(_CORE_NAMES[name]), name)
    if name == "ProfilerCoordinator":
        from coordinator.service.actor import ProfilerCoordinator

        return ProfilerCoordinator
    if name in _CLIENT_NAMES:
        from coordinator.client import connect

        return getattr(connect, name)
    raise AttributeError(f"module 'coordinator' has no attribute {name!r}")
