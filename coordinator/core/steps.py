"""Work in steps: a generator that yields between bounded pieces of work and returns a result.

The pure core folds large inputs (a relay's node partial can hold thousands of ranks) as such
generators, so that the coordinator's event loop can let other calls go between two pieces
(``service.fold_queue``); callers that do not care run them through at once.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeVar

T = TypeVar("T")
Steps = Generator[None, None, T]


def run_steps(steps: Steps[T]) -> T:
    """Every step of ``steps`` at once; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


async def run_steps_yielding(steps: Steps[T]) -> T:
    """Every step of ``steps``, letting the event loop go between two; its result."""
    import asyncio  # (here: the pure core's readers, ``ray-profiler summarise`` too, need none)

    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        await asyncio.sleep(0)
