"""A run's record read back, with no Ray: ``ray-profiler --from PATH_OR_URL`` and ``serve --from``.

``open_record`` reads a record (``coordinator.core.record_codec``) and rebuilds the run the
coordinator kept: its windows with their aggregates, its phase log, its stalls. The
``RecordedCoordinator`` answers the coordinator's read calls from it with the coordinator's own
code (``Readers``, ``Diffs``), so its tables are the live coordinator's, byte for byte; its
calls that change a run raise ``ReadOnly``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
from typing import Any, cast

from coordinator.core.memory_record import memory_reply
from coordinator.core.phases import PhaseLog
from coordinator.core.run import Run
from coordinator.ops.recorded_status import recorded_status
from coordinator.protocol.memory_replies import MemoryReply
from coordinator.protocol.replies import (
    StatusReply,
)
from coordinator.protocol.stack_replies import StallEntry
from coordinator.service.record_reader import Recorded, locate, open_record

__all__ = ["Recorded", "RecordedCoordinator", "ReadOnly", "call", "locate", "open_record"]


class ReadOnly(Exception):
    """A call that would change a run, made on a record."""


_READS: list[concurrent.futures.ThreadPoolExecutor] = []


def _reads() -> concurrent.futures.ThreadPoolExecutor:
    """One thread for every record's tables of over 256 ranks (as the coordinator's)."""
    if not _READS:
        _READS.append(concurrent.futures.ThreadPoolExecutor(1, "record-reads"))
    return _READS[0]


class _RecordShell:
    """What ``Readers`` and ``Diffs`` read of the coordinator's shell, from a record."""

    def __init__(self, rec: Recorded) -> None:
        self.rec, self.run = rec, rec.run
        self.previous: list[Run] = []
        self.reads = self.status_parts = _reads()
        self.phases = self

    def log(self, run: str) -> PhaseLog:
        return self.rec.phases if run == self.run.name else PhaseLog()

    def find_run(self, name: str | None) -> Run | None:
        return self.run if name is None or name == self.run.name else None

    async def memory_recorded(
        self, run: str, series: bool, trainer_id: str | None
    ) -> MemoryReply | None:
        """The memory book as the record keeps it (``memory_leak``'s marks; None: it has
        none, or ``run`` is not the record's)."""
        if run != self.run.name or self.rec.memory is None:
            return None
        return memory_reply(self.rec.memory, series, trainer_id)


class RecordedCoordinator:
    """The coordinator's read calls, answered from a record (see the module docstring)."""

    def __init__(self, rec: Recorded) -> None:
        from coordinator.service import advise_reads
        from coordinator.service.diffs import Diffs
        from coordinator.service.readers import Readers
        from coordinator.service.shell import CoordinatorShell

        self.rec = rec
        shell = cast(CoordinatorShell, _RecordShell(rec))
        self._readers = readers = advise_reads.keep_findings(Readers(shell))
        self._calls: dict[str, Any] = {
            "kernel_summary": readers.kernel_summary,
            "collectives": readers.collectives,
            "advise": functools.partial(advise_reads.advise, readers),
            "kernel_diff": Diffs(shell, readers).kernel_diff,
            "phase_times": readers.phase_times,
            "step_series": readers.step_series,
            "status": self._status,
            "stalls": self._stalls,
            "memory": self._memory,
        }

    async def _status(self, ranks: str = "summary") -> StatusReply:
        if ranks not in ("summary", "all"):
            raise ValueError(f"ranks must be 'summary' or 'all', got {ranks!r:.80}")
        found = await self._readers.latest_findings(self.rec.run, wait=True)  # (offline: made)
        return recorded_status(self.rec, ranks, found)

    async def _stalls(self) -> list[StallEntry]:
        """The stalls the run recorded, with their grouped stacks."""
        return list(self.rec.stalls)

    async def _memory(self, series: bool = False, trainer_id: str | None = None) -> MemoryReply:
        """Every rank's memory as the coordinator last showed it; ValueError when the record
        holds none (written before memory was recorded) or it cannot be read."""
        rec = self.rec
        if rec.memory is None:
            raise ValueError(
                rec.memory_error
                or f"no memory in the record at {rec.url}: it was written before memory was "
                "recorded (memory needs a live coordinator for this run)"
            )
        return memory_reply(rec.memory, bool(series), trainer_id)

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` (one of ``READS``), taking the arguments the coordinator's RPC of that
        name takes, with its defaults; ReadOnly for any other; TypeError for arguments the
        RPC would not take."""
        target = self._calls.get(method)
        if target is None:
            raise ReadOnly(
                f"{method} needs a live coordinator: {self.rec.url} is a run's record (read-only)"
            )
        rpc = getattr(_actor_class(), method, None) or target
        bound = inspect.signature(rpc).bind(*([None] if rpc is not target else []), *args, **kwargs)
        bound.apply_defaults()
        takes = inspect.signature(target).parameters  # (not ``self``, nor Ray's trace context)
        return await target(**{k: v for k, v in bound.arguments.items() if k in takes})


def _actor_class() -> type:
    """The coordinator actor's class: its RPCs' signatures are the ones a record takes."""
    from coordinator.service.actor import _Coordinator

    return _Coordinator


READS = (
    "kernel_summary", "kernel_diff", "phase_times", "step_series", "status", "stalls", "memory",
    "collectives", "advise",
)  # fmt: skip
"""The calls a record answers."""


def call(h: RecordedCoordinator, method: str, *args: Any, **kwargs: Any) -> Any:
    """``method`` of a recorded coordinator, from synchronous code (the CLI)."""
    return asyncio.run(h.call(method, *args, **kwargs))
