"""When the stepping trainer's steps stop coming: the stall watchdog's clock. Pure: no Ray, no I/O.

A stall begins when no step was reported for ``max(factor x median recent step time, min_s)``
after the first step of a run. Stacks are taken then, and again with backoff (the threshold,
doubled each time, at most ``MAX_RETAKE_S`` apart, ``MAX_TAKES`` in all) while it lasts; the next
step report ends it.

>>> w = StallWatch(factor=5.0, min_s=60.0)
>>> for k, t in enumerate([0.0, 1.0, 2.0, 3.0]): _ = w.observe(k, t)
>>> w.threshold_s(), w.due(62.9), w.due(63.0)
(60.0, None, 'stall')
>>> w.took(63.0); w.due(100.0), w.due(183.0)
(None, 'retake')
>>> w.observe(4, 200.0)
True
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field
from typing import Literal

RECENT_STEPS = 32
MAX_TAKES = 8
MAX_RETAKE_S = 1800.0
Due = Literal["stall", "retake"]


@dataclass
class StallWatch:
    """The watchdog's view of one run's stepping trainer (times in monotonic seconds)."""

    factor: float
    min_s: float
    intervals: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=RECENT_STEPS)
    )
    last_step: int | None = None
    last_at: float | None = None
    stalled_at: float | None = None
    takes: int = 0
    next_take_at: float | None = None
    resumed: tuple[int, float] | None = None  # the step that ended the last stall, and when

    def observe(self, step: int, now: float) -> bool:
        """A step report arrived; True when it ends a stall. O(1): it is on the step path."""
        if self.last_at is not None and self.last_step is not None and step > self.last_step:
            self.intervals.append((now - self.last_at) / (step - self.last_step))
        self.last_step, self.last_at = step, now
        if self.stalled_at is None:
            return False
        self.stalled_at, self.takes, self.next_take_at = None, 0, None
        self.resumed = (step, now)
        return True

    def median_step_s(self) -> float | None:
        return statistics.median(self.intervals) if self.intervals else None

    def threshold_s(self) -> float:
        """Seconds without a step that make a stall: max(factor x median step time, min_s)."""
        median = self.median_step_s()
        return max(self.factor * median if median is not None else 0.0, self.min_s)

    def due(self, now: float) -> Due | None:
        """``stall`` when a stall begins now, ``retake`` when its stacks are due again."""
        if self.last_at is None:
            return None  # no step yet: a run's start may take as long as it likes
        if self.stalled_at is None:
            return "stall" if now - self.last_at >= self.threshold_s() else None
        if self.takes < MAX_TAKES and self.next_take_at is not None and now >= self.next_take_at:
            return "retake"
        return None

    def took(self, now: float) -> None:
        """Stacks were taken for the stall (its first take marks it)."""
        if self.stalled_at is None:
            self.stalled_at = now
        self.takes += 1
        wait = min(self.threshold_s() * 2 ** (self.takes - 1), MAX_RETAKE_S)
        self.next_take_at = now + wait
