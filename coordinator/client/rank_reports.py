"""Rank 0's step reports, for an SPMD rank (``RankSession``) or an attached one: every step's
phase record, and the step to the coordinator at most every ``REPORT_EVERY_S``, never waited for.

A step's wall time runs from the previous step's end (one clock reading a step). A step with no
``region`` in it is its wall time alone, in a compact run of them (``PhaseBuffer``: no object
made a step, and a few bytes a step on the wire, the ``walls`` of the ``step`` RPC).

>>> sent = []
>>> class Coordinator:
...     class step:
...         @staticmethod
...         def remote(*args):
...             sent.append(args)
>>> times = iter([0.0, 0.015625, 0.03125, 0.0625])
>>> reports = StepReports(Coordinator, "sft", now=lambda: next(times))
>>> reports.clock.begin_step()
>>> reports.step(0, now=False); reports.step(1, now=False); reports.step(2, now=True)
>>> trainer, step, waiting, records, (first, walls) = sent[0]
>>> step, records, first, list(walls)
(2, None, 0, [0.015625, 0.015625, 0.03125])
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from coordinator.client.phase_buffer import PhaseBuffer
from coordinator.client.phase_clock import PhaseClock

log = logging.getLogger(__name__)
REPORT_EVERY_S = 0.1
"""Rank 0 reports its step at most this often outside the steps where a window starts or stops."""


class StepReports:
    """Rank 0's phase records and step reports (see the module docstring)."""

    def __init__(
        self, coordinator: Any, trainer_id: str, now: Callable[[], float] = time.perf_counter
    ) -> None:
        self.coordinator, self.trainer_id = coordinator, trainer_id
        self.clock = PhaseClock(now)
        self.phases = PhaseBuffer()
        self.unreported: int | None = None  # the last step not yet sent
        self.sent: Any = None  # the last report's ObjectRef
        self.tail: Any = None  # an attached rank's step file (``StepTail``), else None
        self._last = 0.0  # (the clock's reading when the last report was sent)

    def step(self, step: int, now: bool, reading: float | None = None) -> None:
        """Step ``step`` has finished: its record, and the report when one is due (``now``: a
        window started or stopped on it). ``reading``: the clock, when the caller has read it
        at the step's end (``time.perf_counter``, as the clock's default)."""
        clock = self.clock
        wall = clock.lap_wall(reading)
        if wall is not None:
            self.phases.add_wall(step, wall)
        else:
            record = clock.lap(step)  # (regions in it, or the first step timed)
            if record is not None:
                self.phases.add(record)
        if self.tail is not None:  # (what its node agent reports when the process is gone)
            self.tail.step(step, wall)
        if not now and clock.lapped - self._last < REPORT_EVERY_S:
            self.unreported = step
            return
        self.send(step)

    def send(self, step: int) -> None:
        """The report of ``step``, with the records since the last (the records, then the
        compact run), not waited for; never raises."""
        self._last, self.unreported = self.clock.lapped, None
        records, walls = self.phases.take()
        try:
            self.sent = self.coordinator.step.remote(self.trainer_id, step, False, records, walls)
        except Exception as exc:  # never the training's problem
            log.warning("profiler: rank 0 could not report step %s: %s", step, exc)
            return
        if self.tail is not None:
            self.tail.sent(step)

    def flush(self) -> None:
        """The last step not yet sent, if any (the loop's end)."""
        if self.unreported is not None:
            self.send(self.unreported)
