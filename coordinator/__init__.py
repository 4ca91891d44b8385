"""The profiling coordinator and its pure core. Importing this package never imports torch."""

from coordinator.config import ProfilerConfig
from coordinator.schedule import ProfilerAction, Schedule, Window

__all__ = ["ProfilerAction", "ProfilerConfig", "Schedule", "Window"]
