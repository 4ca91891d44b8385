"""Summaries and node partials are folded one at a time, the event loop let go between two.

Hundreds of node partials can arrive at once (every node pushes when its window closes); each
takes a few milliseconds to decode and fold. Run as they arrive, every one of them would be
ahead of a step report that came in behind them. Queued here, a step report waits for at most
the fold in progress.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class FoldQueue:
    """Runs callables in arrival order, one per turn of the event loop."""

    def __init__(self) -> None:
        self._queue: collections.deque[tuple[Callable[[], Any], asyncio.Future[Any]]] = (
            collections.deque()
        )
        self._task: asyncio.Task[None] | None = None

    async def run(self, fold: Callable[[], T]) -> T:
        """``fold()``'s result, once every fold queued before it has run."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        self._queue.append((fold, done))
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._drain())
        return await done

    async def _drain(self) -> None:
        while self._queue:
            fold, done = self._queue.popleft()
            try:
                result = fold()
            except Exception as exc:
                if not done.done():
                    done.set_exception(exc)
            else:
                if not done.done():
                    done.set_result(result)
            await asyncio.sleep(0)  # a step report that arrived meanwhile goes next
