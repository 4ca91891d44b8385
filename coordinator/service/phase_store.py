"""Where the coordinator keeps per-step phase times: one ``PhaseLog`` per run, for the current
run and the runs kept for reading; records are checked as they arrive with a step report
(``[step, wall_s, regions]`` records, and a compact run of steps timed with no region)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from coordinator.core.phases import PhaseLog, check_records, check_walls, walls_records


class PhaseStore:
    """Phase logs by run name (see the module docstring)."""

    def __init__(self, refuse: Callable[[str, str], str], export: Callable[[Any], None]) -> None:
        self._refuse, self._export = refuse, export
        self._logs: dict[str, PhaseLog] = {}

    def keep(self, run: str, kept: Iterable[str], records: Any, walls: Any = None) -> None:
        """``run``'s phase records from a step report, then its compact run of them
        (``walls``, the later steps); malformed ones are refused (counted, logged once), never
        the step. ``kept``: the runs whose logs stay."""
        problem = check_records(records) if records is not None else None
        problem = problem or (check_walls(walls) if walls is not None else None)
        if problem:
            self._refuse("phases", problem)
            return
        records = [*(records or ()), *(walls_records(walls) if walls is not None else ())]
        log = self._logs.get(run)
        if log is None:
            keep = {run, *kept}
            self._logs = {n: v for n, v in self._logs.items() if n in keep}
            log = self._logs[run] = PhaseLog()
        if log.add(records):
            self._export(log.last_step())

    def adopt(self, run: str, log: PhaseLog) -> None:
        """``run``'s log, as a run's record kept it (a run continued after its cluster)."""
        self._logs[run] = log

    def log(self, run: str) -> PhaseLog:
        """``run``'s log (an empty one when it has none)."""
        return self._logs.get(run) or PhaseLog()
