"""A large window's stragglers are found off the loop one run at a time: partials that arrive
while a run is under way make one more run, with what they brought, not one run each."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

from coordinator.core.aggregate import CHEAP_RANKS, WindowAggregate
from coordinator.protocol.summary_codec import RankSummary
from coordinator.service.straggler_refresh import StragglerRefresh
from tests.test_aggregate import summary as rank_summary


def summary(rank: int, step_us: float = 1e6) -> RankSummary:
    return rank_summary(rank, [("aten::mm", 1000.0 + rank % 7, 1)], steps_us=(step_us, step_us))


async def settled(refresh: StragglerRefresh) -> None:
    for _ in range(500):
        if not refresh._busy:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the refresh never ended")


async def test_requests_during_a_run_make_one_more_run_with_what_they_brought():
    n = CHEAP_RANKS + 44
    agg = WindowAggregate(0)
    for r in range(n):
        agg.add(summary(r))
    with concurrent.futures.ThreadPoolExecutor(1) as reads:
        gate = threading.Event()
        reads.submit(gate.wait, 10)  # the reads thread is busy (a table being built)
        refresh = StragglerRefresh(reads)
        refresh.request(agg, 1.25)
        for r in range(n, n + 10):  # ten late partials, the last from a slow rank
            agg.add(summary(r, step_us=5e6 if r == n + 9 else 1e6))
            refresh.request(agg, 1.25)
        assert refresh.runs == 1
        gate.set()
        await settled(refresh)
        assert refresh.runs == 2  # not eleven
        assert agg.stragglers_known
        assert agg.flagged(1.25) == [n + 9]
        refresh.request(agg, 1.25)  # known: nothing to do
        assert refresh.runs == 2 and not refresh._busy


async def test_a_small_window_is_left_to_status():
    agg = WindowAggregate(0)
    for r in range(CHEAP_RANKS):
        agg.add(summary(r))
    with concurrent.futures.ThreadPoolExecutor(1) as reads:
        refresh = StragglerRefresh(reads)
        refresh.request(agg, 1.25)
        assert refresh.runs == 0 and not refresh._busy
