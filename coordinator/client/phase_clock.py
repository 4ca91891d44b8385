"""The trainer's side of per-step phase times: named regions timed in the trainer's process.

``Region`` is what ``hooks.region(name)`` returns: a context manager for ``with`` and
``async with`` that adds its time to the current step. ``PhaseClock.close_step(k)`` turns the
step into a record ``[k, wall_s, {region: seconds}]``; the wall time runs from the end of the
previous step report to this one, so it is the trainer's own work. A region entered twice in a
step adds up; nested regions each count their own time.

>>> clock = PhaseClock(now=lambda: 0.0)
>>> clock.begin_step()
>>> clock.add("generate", 0.25); clock.add("generate", 0.5)
>>> clock.now = lambda: 1.0
>>> clock.close_step(7)
[7, 1.0, {'generate': 0.75}]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from coordinator.core.phases import NO_REGIONS


class PhaseClock:
    """The regions of the step in progress (see the module docstring)."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now
        self._regions: dict[str, float] = {}
        self._began: float | None = None
        self.lapped = 0.0  # the clock's reading at the last ``lap``

    def begin_step(self) -> None:
        """The trainer's next step starts now (after the previous step's report returned)."""
        self._began = self.now()

    def add(self, name: str, seconds: float) -> None:
        self._regions[name] = self._regions.get(name, 0.0) + seconds

    def close_step(self, step: int) -> list[Any] | None:
        """The record of step ``step``; None before the first ``begin_step``. A step with no
        region shares one empty mapping (read, never changed): a step timed by the attach hook
        alone allocates no dict."""
        regions = self._regions
        if regions:
            self._regions = {}
        else:
            regions = NO_REGIONS
        if self._began is None:
            return None
        return [step, max(0.0, self.now() - self._began), regions]

    def lap_wall(self, reading: float | None = None) -> float | None:
        """``lap`` for a step with no region in it: its wall time alone (a compact record);
        None, reading no clock, when the step had regions or no step had begun (``lap``
        then). ``reading``: the clock read by the caller at the step's end, else ``now()``.

        >>> clock = PhaseClock(now=lambda: 2.0)
        >>> clock.begin_step(); clock.now = lambda: 2.25
        >>> clock.lap_wall(), clock.lapped
        (0.25, 2.25)
        """
        began = self._began
        if self._regions or began is None:
            return None
        now = self.lapped = self._began = self.now() if reading is None else reading
        return now - began if now > began else 0.0

    def lap(self, step: int) -> list[Any] | None:
        """``close_step(step)`` then ``begin_step()`` on one reading of the clock (kept in
        ``lapped``): steps timed back to back, whose wall times add up to the time elapsed.

        >>> clock = PhaseClock(now=lambda: 2.0)
        >>> clock.lap(0), clock.lapped
        (None, 2.0)
        >>> clock.now = lambda: 2.5
        >>> clock.lap(1)
        [1, 0.5, {}]
        """
        now = self.lapped = self.now()
        regions = self._regions
        if regions:
            self._regions = {}
        else:
            regions = NO_REGIONS
        began, self._began = self._began, now
        return None if began is None else [step, max(0.0, now - began), regions]


class Region:
    """``with hooks.region(name):`` / ``async with hooks.region(name):``."""

    __slots__ = ("clock", "name", "_t0")

    def __init__(self, clock: PhaseClock | None, name: str) -> None:
        self.clock, self.name, self._t0 = clock, name, 0.0

    def __enter__(self) -> Region:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.clock is not None:
            self.clock.add(self.name, time.perf_counter() - self._t0)

    async def __aenter__(self) -> Region:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__(*exc)
