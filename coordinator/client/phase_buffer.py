"""The phase records a trainer's process holds until its next step report: one buffer for the
single controller's ``StepClient`` and for rank 0 of SPMD and attached ranks (``StepReports``).

Records are ``[step, wall_s, {region: seconds}]``. Steps with no region can come as their wall
time alone (``add_wall``): while they follow one another they are a compact run (an ``array``,
no object made a step), which ``take`` returns apart, after the records (a record, or a step
after a gap, turns the run so far into records first, so the order holds). At most ``limit``
steps are held (a coordinator away); past it the oldest half goes, counted in ``dropped``: the
newest steps are the ones a coordinator that comes back wants.

>>> buf = PhaseBuffer(limit=4)
>>> buf.add([0, 0.5, {"train": 0.25}])
>>> for step in (1, 2, 3, 4):
...     buf.add_wall(step, 0.5)
>>> buf.dropped, buf.take()
(2, (None, (2, array('d', [0.5, 0.5, 0.5]))))
"""

from __future__ import annotations

from array import array
from typing import Any

from coordinator.core.phases import walls_records

MAX_BUFFERED = 10_000


class PhaseBuffer:
    """See the module docstring."""

    def __init__(self, limit: int = MAX_BUFFERED) -> None:
        self.limit = limit
        self.dropped = 0
        self._records: list[list[Any]] = []
        self._walls = array("d")  # wall times of steps _first, _first + 1, ...
        self._first = 0

    def add(self, record: list[Any]) -> None:
        """A step's record (after any compact run, which becomes records first)."""
        self._fold()
        self._records.append(record)
        if len(self._records) > self.limit:
            self._drop()

    def add_wall(self, step: int, wall: float) -> None:
        """Step ``step`` took ``wall`` seconds and had no region (the hot path)."""
        if self._walls and step != self._first + len(self._walls):
            self._fold()  # (a step skipped: the run so far becomes records)
        walls = self._walls
        if not walls:
            self._first = step
        walls.append(wall)
        if len(walls) + len(self._records) > self.limit:
            self._drop()

    def take(self) -> tuple[list[list[Any]] | None, tuple[int, array[float]] | None]:
        """What a report carries, and empty again: the records, then the compact run (each
        None when there is none)."""
        records, self._records = self._records or None, []
        walls = (self._first, self._walls) if self._walls else None
        self._walls = array("d")
        return records, walls

    def _fold(self) -> None:
        if self._walls:
            self._records += walls_records((self._first, self._walls))
            self._walls = array("d")

    def _drop(self) -> None:
        """The oldest half of what is held goes."""
        n = (len(self._records) + len(self._walls)) // 2
        self.dropped += n
        from_records = min(n, len(self._records))
        del self._records[:from_records]
        rest = n - from_records
        if rest:
            del self._walls[:rest]
            self._first += rest
