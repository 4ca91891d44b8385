"""A large window's stragglers are found off the loop one run at a time: partials that arrive
while a run is under way make one more run, with what they brought, not one run each."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

from coordinator.core.aggregate import CHEAP_RANKS, WindowAggregate, arriver_known, arriver_now
from coordinator.protocol.collective_replies import CollectiveBlock, RankCollective
from coordinator.protocol.summary_codec import RankSummary
from coordinator.service.straggler_refresh import ARRIVER_QUIET_S, StragglerRefresh
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


def late_block(rank: int, ranks: int, late: int, steps: int = 4) -> CollectiveBlock:
    """Rank ``rank``'s all-reduces of ``steps`` steps in a group of ``ranks``, rank ``late``
    arriving 20 ms after the others at each."""
    calls = tuple(
        RankCollective(
            "0",
            None,
            "all_reduce",
            4096,
            "float",
            s,
            t + (20_000.0 * (rank == late)),
            100.0,
            t + 20_100.0,
        )  # fmt: skip
        for s, t in ((s, 1e9 + s * 1e5) for s in range(steps))
    )
    return CollectiveBlock(calls, (), 0, (("0", tuple(range(ranks))),), ())


async def test_a_large_window_s_last_arriver_is_found_once_its_collectives_stop_coming():
    n = CHEAP_RANKS + 4
    agg = WindowAggregate(0)
    with concurrent.futures.ThreadPoolExecutor(1) as reads:
        refresh = StragglerRefresh(reads)
        for r in range(n):  # partials arriving: each asks, none is matched yet
            s = summary(r, step_us=1e5)
            s.collectives = late_block(r, n, late=7)
            agg.add(s)
            refresh.request(agg, 1.25)
        assert refresh.arriver_runs == 0 and arriver_now(agg) is None
        for _ in range(300):  # quiet for ARRIVER_QUIET_S: matched once, off the loop
            if arriver_known(agg):
                break
            await asyncio.sleep(0.01)
        await settled(refresh)
        assert refresh.arriver_runs == 1 and arriver_known(agg)
        found = arriver_now(agg)
        assert found is not None and found["rank"] == 7 and found["arrived_last"] == 4, found
        assert agg.stragglers(1.25)["last_arriver"]["rank"] == 7
        refresh.request(agg, 1.25)  # known: nothing more
        await asyncio.sleep(ARRIVER_QUIET_S + 0.2)
        assert refresh.arriver_runs == 1


async def test_a_last_arriver_that_cannot_be_found_is_kept_as_none_not_retried(monkeypatch):
    from coordinator.service import straggler_refresh as module

    def broken(agg):  # (fault injection: the matching raises)
        raise RuntimeError("injected")

    monkeypatch.setattr(module, "find_arriver", broken)
    n = CHEAP_RANKS + 4
    agg = WindowAggregate(0)
    with concurrent.futures.ThreadPoolExecutor(1) as reads:
        refresh = StragglerRefresh(reads)
        for r in range(n):
            s = summary(r, step_us=1e5)
            s.collectives = late_block(r, n, late=7)
            agg.add(s)
        refresh.request(agg, 1.25)
        for _ in range(300):
            if arriver_known(agg):
                break
            await asyncio.sleep(0.01)
        assert arriver_known(agg) and arriver_now(agg) is None
        await asyncio.sleep(ARRIVER_QUIET_S + 0.3)
        assert refresh.arriver_runs == 1  # not once a second for ever
