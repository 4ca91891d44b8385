"""Slowdown detection for auto captures: pure, fed by the trainer's step reports.

The coordinator already receives a report at least every 0.1 s with the step that finished.
Between two reports, ``(t1 - t0) / (k1 - k0)`` is the mean step time of the steps in between;
nothing is added to the trainer's step path. A run is slow when that estimate exceeds
``slowdown_ratio`` times its own rolling baseline (the median of the recent estimates, one per
step) for ``after_steps`` consecutive steps. Steps in a profiled window, the step after one
stops (it pays torch's stop, export and the free of its results), and the first
``ignore_first`` steps of a run are neither measured against the baseline nor added to it.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from coordinator.core.validate import section_of
from coordinator.protocol.replies import AutoTrigger

# Steps the baseline needs before anything can be called slow.
MIN_BASELINE_STEPS = 20


@dataclass
class AutoCapture:
    """When to profile slow steps by themselves (``ProfilerConfig.auto_capture``)."""

    enable: bool = False
    """Off by default; ``ray-profiler auto on|off`` switches it at run time."""
    slowdown_ratio: float = 1.5
    """A step is slow when its time exceeds this multiple of the run's baseline (> 1)."""
    after_steps: int = 10
    """Consecutive slow steps that make the run slow (and trigger a capture)."""
    active: int = 3
    """Steps an auto capture records."""
    warmup: int = 1
    """Warm-up steps before them."""
    cooldown_steps: int = 500
    """At least this many steps between two auto captures' triggers."""
    max_per_run: int = 5
    """The most auto captures in one run."""
    ignore_first: int = 50
    """Steps at the start of a run (compilation, caches warming up) never measured."""
    baseline_steps: int = 200
    """How many recent steps the rolling baseline (their median) covers."""

    @classmethod
    def from_value(cls, value: Any) -> AutoCapture:
        """From a mapping (unknown keys rejected by name), or an ``AutoCapture``."""
        return section_of(cls, value, "auto_capture")

    def validate(self) -> AutoCapture:
        """Raise ValueError naming the field and the value; returns self."""
        if not isinstance(self.enable, bool):
            raise ValueError(_bad("enable", "true or false", self.enable))
        ratio = self.slowdown_ratio
        if (
            isinstance(ratio, bool)
            or not isinstance(ratio, (int, float))
            or not math.isfinite(ratio)
            or ratio <= 1.0
        ):
            raise ValueError(_bad("slowdown_ratio", "a finite number > 1", ratio))
        for name, low in (
            ("after_steps", 1),
            ("active", 1),
            ("warmup", 0),
            ("cooldown_steps", 0),
            ("max_per_run", 0),
            ("ignore_first", 0),
            ("baseline_steps", MIN_BASELINE_STEPS),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**62:
                raise ValueError(_bad(name, f"an int >= {low}", value))
        return self


def _bad(name: str, what: str, value: Any) -> str:
    return (
        f"profiler config: 'auto_capture.{name}' must be {what}, "
        f"got {type(value).__name__}: {value!r:.80}"
    )


@dataclass
class SlowdownDetector:
    """One run's step-time estimates and its rolling baseline (see the module docstring)."""

    config: AutoCapture
    first_step: int | None = None
    last: tuple[int, float] | None = None  # (step, time) of the last report
    excluded_next: bool = False  # the next interval follows a window: not measured
    baseline: collections.deque[float] = field(default_factory=collections.deque)
    slow_since: int | None = None  # first step of the current run of slow steps
    slow_steps: int = 0
    recent_ms: float | None = None
    captures: int = 0
    last_trigger: int | None = None
    backoff_until: int = 0
    early: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=20))

    def restart(self, first_step: int) -> None:
        """A run (re)starts before ``first_step``: forget the last report and the slow run."""
        self.first_step, self.last = first_step, None
        self.slow_since, self.slow_steps, self.excluded_next = None, 0, False

    def forget_clock(self) -> None:
        """The clock the reports were timed with is gone (the coordinator restarted)."""
        self.last = None

    def observe(self, step: int, now: float, in_window: bool) -> AutoTrigger | None:
        """Step ``step`` finished at ``now`` (seconds, one monotonic clock); ``in_window``: a
        window was open during this report's steps. Returns a trigger when the run is slow and
        a capture may start now, else None."""
        if self.first_step is None:
            self.first_step = step
        last, self.last = self.last, (step, now)
        skip = in_window or self.excluded_next
        self.excluded_next = in_window
        if last is None or step <= last[0] or now <= last[1] or skip:
            return None
        self.early.append((now - last[1]) / (step - last[0]))
        if last[0] < self.first_step + self.config.ignore_first:
            return None
        per_step = (now - last[1]) / (step - last[0])
        self.recent_ms = per_step * 1e3
        base = self.baseline_s()
        slow = base is not None and per_step > self.config.slowdown_ratio * base
        self._remember(per_step, step - last[0])
        if not slow:
            self.slow_since, self.slow_steps = None, 0
            return None
        if self.slow_since is None:
            self.slow_since = last[0] + 1
        self.slow_steps += step - last[0]
        return self._trigger(step, per_step, base) if base is not None else None

    def step_s(self) -> float | None:
        """The step time as well as it is known: the baseline, else the median of the last
        steps measured, the first ones included (None: fewer than 3 yet)."""
        base = self.baseline_s()
        if base is not None or len(self.early) < 3:
            return base
        return statistics.median(self.early)

    def baseline_s(self) -> float | None:
        """The median step time of the recent measured steps (None: too few yet)."""
        if len(self.baseline) < MIN_BASELINE_STEPS:
            return None
        return statistics.median(self.baseline)

    def accepted(self, trigger: AutoTrigger) -> None:
        """The capture of ``trigger`` was planned: count it and start the cooldown."""
        self.captures += 1
        self.last_trigger = trigger["step"]
        self.slow_since, self.slow_steps = None, 0

    def refused(self, step: int) -> None:
        """It could not be planned (another window is in the way): try again later."""
        self.backoff_until = step + self.config.after_steps

    def _remember(self, per_step: float, steps: int) -> None:
        self.baseline.extend([per_step] * min(steps, self.config.baseline_steps))
        while len(self.baseline) > self.config.baseline_steps:
            self.baseline.popleft()

    def _trigger(self, step: int, per_step: float, base: float) -> AutoTrigger | None:
        cfg = self.config
        if self.slow_steps < cfg.after_steps or step < self.backoff_until:
            return None
        if self.captures >= cfg.max_per_run:
            return None
        if self.last_trigger is not None and step - self.last_trigger < cfg.cooldown_steps:
            return None
        assert self.slow_since is not None
        return {
            "step": step,
            "ratio": per_step / base,
            "baseline_ms": base * 1e3,
            "recent_ms": per_step * 1e3,
            "slow_steps": [self.slow_since, step],
            "region": None,
        }

    def to_mapping(self) -> Mapping[str, Any]:
        """What ``status()["auto_capture"]`` shows of the detector."""
        base = self.baseline_s()
        return {
            "captures": self.captures,
            "baseline_ms": None if base is None else base * 1e3,
            "recent_ms": self.recent_ms,
            "slow_steps": self.slow_steps,
            "last_trigger": self.last_trigger,
        }
