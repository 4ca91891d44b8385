"""The profiling coordinator and its pure core. Importing this package never imports torch.

``ProfilerCoordinator``, ``get_or_create_coordinator`` and ``connect`` need Ray and are
imported on first use, so the pure modules stay light.
"""

from typing import Any

from coordinator.config import ProfilerConfig
from coordinator.schedule import ProfilerAction, Schedule, Window

_ACTOR_NAMES = ("ProfilerCoordinator", "attach_coordinator", "get_or_create_coordinator", "connect")

__all__ = ["ProfilerAction", "ProfilerConfig", "Schedule", "Window", *_ACTOR_NAMES]


def __getattr__(name: str) -> Any:
    if name == "ProfilerCoordinator":
        from coordinator import actor

        return actor.ProfilerCoordinator
    if name in _ACTOR_NAMES:
        from coordinator import attach

        return getattr(attach, name)
    raise AttributeError(f"module 'coordinator' has no attribute {name!r}")
