"""The profiling coordinator. Importing this package never imports torch or Ray.

Rooms by the process the code runs in:

- ``coordinator.core``: pure (config, schedule, window plan, runs, state, aggregation);
- ``coordinator.protocol``: what crosses Ray (replies, summary codec, rank RPCs, actor names);
- ``coordinator.service``: inside the coordinator actor;
- ``coordinator.client``: inside the trainer's process;
- ``coordinator.ops``: for operators (CLI, tables, notebook, plots, collect).

``ProfilerCoordinator``, ``attach_coordinator``, ``get_or_create_coordinator`` and ``connect``
need Ray and are imported on first use.
"""

from typing import Any

from coordinator.core.config import ProfilerConfig
from coordinator.core.schedule import ProfilerAction, Schedule, Window

_CLIENT_NAMES = ("attach_coordinator", "get_or_create_coordinator", "connect")

__all__ = [
    "ProfilerAction",
    "ProfilerConfig",
    "ProfilerCoordinator",
    "Schedule",
    "Window",
    *_CLIENT_NAMES,
]


def __getattr__(name: str) -> Any:
    if name == "ProfilerCoordinator":
        from coordinator.service.actor import ProfilerCoordinator

        return ProfilerCoordinator
    if name in _CLIENT_NAMES:
        from coordinator.client import attach

        return getattr(attach, name)
    raise AttributeError(f"module 'coordinator' has no attribute {name!r}")
