"""The coordinator's fold queue: folds in arrival order, and a fold in steps lets the event loop
go between two steps (a step report is never held behind a whole relay's partial)."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.service.fold_queue import FoldQueue


async def test_folds_run_in_arrival_order_and_a_stepwise_fold_lets_others_in_between():
    folds, seen = FoldQueue(), []

    def stepwise(name: str, steps: int):
        for n in range(steps):
            seen.append(f"{name}{n}")
            yield
        return name

    async def reporter() -> None:  # a step report that arrives while the folds run
        await asyncio.sleep(0)
        seen.append("report")

    results = await asyncio.gather(
        folds.run_steps(lambda: stepwise("a", 4)),
        folds.run(lambda: seen.append("plain") or "p"),
        reporter(),
    )
    assert results[:2] == ["a", "p"]
    assert seen.index("a3") < seen.index("plain")  # arrival order between folds
    assert seen.index("a0") < seen.index("report") < seen.index("a3")  # the loop went


async def test_a_failing_fold_fails_its_caller_only():
    folds = FoldQueue()

    def broken():
        yield
        raise ValueError("bad partial")

    with pytest.raises(ValueError, match="bad partial"):
        await folds.run_steps(broken)
    assert await folds.run(lambda: 7) == 7
