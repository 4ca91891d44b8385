"""Summaries and node partials are folded one at a time, the event loop let go between two.

Hundreds of node partials can arrive at once (every node pushes when its window closes); each
takes a few milliseconds to decode and fold. Run as they arrive, every one of them would be
ahead of a step report that came in behind them. Queued here, a step report waits for at most
the fold in progress; a fold given as steps (``core.steps``: a relay's partial of thousands of
ranks) lets the loop go between two of them, so it waits for at most one step.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any, TypeVar

from coordinator.core.steps import Steps, run_steps_yielding

T = TypeVar("T")


class FoldQueue:
    """Runs callables in arrival order, one per turn of the event loop."""

    def __init__(self) -> None:
        self._queue: collections.deque[tuple[Callable[[], Any], bool, asyncio.Future[Any]]] = (
            collections.deque()
        )
        self._task: asyncio.Task[None] | None = None

    async def run(self, fold: Callable[[], T]) -> T:
        """``fold()``'s result, once every fold queued before it has run."""
        return await self._queued(fold, False)  # type: ignore[no-any-return]

    async def run_steps(self, fold: Callable[[], Steps[T]]) -> T:
        """The result of the steps ``fold()`` makes (``core.steps``), once every fold queued
        before it has run; the event loop goes between two of its steps."""
        return await self._queued(fold, True)  # type: ignore[no-any-return]

    async def _queued(self, fold: Callable[[], Any], steps: bool) -> Any:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        self._queue.append((fold, steps, done))
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._drain())
        return await done

    async def _drain(self) -> None:
        while self._queue:
            fold, steps, done = self._queue.popleft()
            try:
                result = fold()
                if steps:
                    result = await run_steps_yielding(result)
            except Exception as exc:
                if not done.done():
                    done.set_exception(exc)
            else:
                if not done.done():
                    done.set_result(result)
            await asyncio.sleep(0)  # a step report that arrived meanwhile goes next
