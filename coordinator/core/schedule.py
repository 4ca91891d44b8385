"""The profiling schedule as pure arithmetic over absolute global steps.

``Schedule(config).action(k)`` equals ``torch.profiler.schedule(...)(k)`` by name for every k,
without importing torch, and costs O(1) whatever ``skip_first`` is.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from coordinator.protocol.replies import WindowSteps

WINDOW_KINDS = ("scheduled", "capture", "auto")


class ProfilerAction(enum.Enum):
    """Same names as ``torch.profiler.ProfilerAction``."""

    NONE = 0
    WARMUP = 1
    RECORD = 2
    RECORD_AND_SAVE = 3


@dataclass(frozen=True)
class Window:
    """One profiling window: warm-up steps ``[warmup_start, first)``, recorded ``[first, last]``."""

    index: int
    warmup_start: int
    first: int
    last: int
    kind: str = "scheduled"
    """``scheduled`` (the config's schedule), ``capture`` (an operator's) or ``auto`` (slow
    steps profiled by themselves)."""

    def action(self, step: int) -> ProfilerAction:
        """The action during ``step`` if this were the only window."""
        if step < self.warmup_start or step > self.last:
            return ProfilerAction.NONE
        if step < self.first:
            return ProfilerAction.WARMUP
        return ProfilerAction.RECORD if step < self.last else ProfilerAction.RECORD_AND_SAVE

    def shifted_to(self, warmup_start: int) -> Window:
        """The same window length, starting its warm-up at ``warmup_start``."""
        delta = warmup_start - self.warmup_start
        return Window(self.index, warmup_start, self.first + delta, self.last + delta, self.kind)

    def renumbered(self, index: int) -> Window:
        return Window(index, self.warmup_start, self.first, self.last, self.kind)

    def overlaps(self, other: Window) -> bool:
        """Whether the two windows share a warm-up or recorded step."""
        return self.warmup_start <= other.last and other.warmup_start <= self.last

    def to_dict(self) -> WindowSteps:
        return {
            "index": self.index,
            "warmup_start": self.warmup_start,
            "first": self.first,
            "last": self.last,
            "kind": self.kind,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Window:
        kind = str(d.get("kind", "scheduled"))
        if kind not in WINDOW_KINDS:
            raise ValueError(f"window {d!r:.200}: kind must be one of {list(WINDOW_KINDS)}")
        w = cls(int(d["index"]), int(d["warmup_start"]), int(d["first"]), int(d["last"]), kind)
        if not 0 <= w.warmup_start <= w.first <= w.last:
            raise ValueError(f"window {d!r}: need 0 <= warmup_start <= first <= last")
        return w


class Schedule:
    """Windows of a ``ProfilerConfig`` (or any object with the schedule fields)."""

    def __init__(self, config: Any) -> None:
        self.skip_first = int(config.skip_first)
        self.wait = int(config.wait)
        self.warmup = int(config.warmup)
        self.active = int(config.active)
        self.repeat = int(config.repeat)
        self.skip_first_wait = bool(config.skip_first_wait)
        self.disabled = bool(getattr(config, "on_demand_only", False))
        if self.active < 1 or min(self.skip_first, self.wait, self.warmup, self.repeat) < 0:
            raise ValueError("schedule: need active >= 1 and non-negative other fields")
        self.cycle = self.wait + self.warmup + self.active
        # Offset of the cycle grid: step s is cycle position (s - origin) % cycle.
        self._origin = self.skip_first - (self.wait if self.skip_first_wait else 0)

    def action(self, step: int) -> ProfilerAction:
        """The action during absolute global step ``step`` (>= 0)."""
        if step < 0:
            raise ValueError(f"schedule: step must be >= 0, got {step}")
        if self.disabled or step < self.skip_first:
            return ProfilerAction.NONE
        pos = step - self._origin
        if self.repeat > 0 and pos >= self.repeat * self.cycle:
            return ProfilerAction.NONE
        mod = pos % self.cycle
        if mod < self.wait:
            return ProfilerAction.NONE
        if mod < self.wait + self.warmup:
            return ProfilerAction.WARMUP
        return ProfilerAction.RECORD if mod < self.cycle - 1 else ProfilerAction.RECORD_AND_SAVE

    @property
    def num_windows(self) -> int | None:
        """Number of windows, or None when the schedule repeats for the whole run."""
        if self.disabled:
            return 0
        return self.repeat if self.repeat > 0 else None

    def window(self, index: int) -> Window:
        """Window ``index`` (counting from 0); IndexError past the last one."""
        n = self.num_windows
        if index < 0 or (n is not None and index >= n):
            raise IndexError(f"schedule has no window {index} (it has {n})")
        first = self._origin + index * self.cycle + self.wait + self.warmup
        return Window(index, first - self.warmup, first, first + self.active - 1)

    def windows_before(self, step: int) -> int:
        """How many windows begin their warm-up before ``step``."""
        n = self.num_windows
        if n == 0:
            return 0
        count = max(0, -(-(step - self._origin - self.wait) // self.cycle))  # ceil division
        return count if n is None else min(count, n)

    def first_window_from(self, step: int) -> Window | None:
        """The earliest window whose last recorded step is >= ``step``, or None."""
        n = self.num_windows
        if n == 0:
            return None
        w0 = self.window(0)
        if step <= w0.last:
            return w0
        index = -(-(step - w0.last) // self.cycle)  # ceil division
        if n is not None and index >= n:
            return None
        return self.window(index)

    def windows(self, limit: int | None = None) -> Iterator[Window]:
        """Windows in order; at most ``limit`` of them."""
        n = self.num_windows
        count = n if limit is None else (limit if n is None else min(n, limit))
        if count is None:
            raise ValueError("schedule repeats for the whole run; pass a limit")
        for i in range(count):
            yield self.window(i)
