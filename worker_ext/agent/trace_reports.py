"""A node agent's trace reports, batched: one ``traces_stored`` call for the traces it finished
together (sent when no other trace is being finished, or a second after the first report), not
one ``trace_stored`` per rank. At 10,000 ranks that is 10,000 calls a window, each
queued in Ray ahead of the trainer's step reports; measured with ``bench/scale_sim.py``
(``SCALE_SIM_TRACES``): the coordinator's CPU per window of summaries went from 1.8 s to 10.9 s
and a call that takes no lock waited up to 0.8 s.

A batch that cannot be sent is dropped, as a single report was: the trace is on disk (or in the
bucket) all the same; only the coordinator's record of where it is misses it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

LINGER_S = 1.0  # a report waits at most this long for others to go with it
MAX_BATCH = 512  # (the coordinator takes up to 4,096 in one call)
Send = Callable[[dict[str, str], list[dict[str, Any]]], Awaitable[Any]]


class TraceReports:
    """Reports by coordinator run (``report_to``), sent ``LINGER_S`` after the first came."""

    def __init__(self, send: Send, linger_s: float = LINGER_S) -> None:
        self.send, self.linger_s = send, linger_s
        self._batches: dict[tuple[str, ...], tuple[dict[str, str], list[dict[str, Any]]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.sent = 0  # calls made (tests and status)

    def add(self, report_to: dict[str, str], report: dict[str, Any]) -> None:
        """Queue one rank's report (``trace_stored``'s arguments by name); never raises."""
        key = tuple(str(report_to.get(k) or "") for k in ("namespace", "name", "trainer_id", "run"))
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = (report_to, [])
            self._spawn(self._flush_later(key))
        batch[1].append(report)
        if len(batch[1]) >= MAX_BATCH:
            self._spawn(self._flush(key))

    def send_now(self) -> None:
        """Send every batch without waiting for more (no other trace is being finished)."""
        for key in list(self._batches):
            self._spawn(self._flush(key))

    async def drain(self) -> None:
        """Send every batch now, and wait for the calls (tests)."""
        await asyncio.gather(*(self._flush(key) for key in list(self._batches)))

    async def _flush_later(self, key: tuple[str, ...]) -> None:
        await asyncio.sleep(self.linger_s)
        await self._flush(key)

    async def _flush(self, key: tuple[str, ...]) -> None:
        batch = self._batches.pop(key, None)
        if batch is None:
            return
        self.sent += 1
        with contextlib.suppress(Exception):  # (the coordinator is gone or restarting)
            await self.send(*batch)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
