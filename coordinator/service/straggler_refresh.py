"""A large window's stragglers, found off the event loop once its summaries are in, one
computation at a time.

``status()`` never computes the stragglers of a window of over ``CHEAP_RANKS`` ranks (O(ranks)
of Python: 23 ms at 10,000 ranks in process); they are found in the reads thread, on a snapshot,
when the window's summaries are all in. Partials can still arrive after that (a rank stops
listing a window as pending once its agent has its summary, before the relay's merge reaches
the coordinator): each asked for the computation again, 68 of them for one window at 10,000
ranks in ``bench/scale_sim.py``, every one holding the GIL against the loop. Now a request while
one runs only marks the aggregate to be done again once it ends, with what arrived meanwhile.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any

from coordinator.core.aggregate import (
    WindowAggregate,
    arriver_known,
    find_arriver,
    keep_arriver,
)

ARRIVER_QUIET_S = 1.0
log = logging.getLogger(__name__)


class StragglerRefresh:
    """Finds the stragglers of large aggregates in ``executor``, at most one run per aggregate."""

    def __init__(self, executor: concurrent.futures.Executor) -> None:
        self.executor = executor
        self.runs = 0  # computations started (what the tests count)
        self.arriver_runs = 0  # last arrivers' matchings started
        self._busy: dict[int, tuple[WindowAggregate, float, bool]] = {}
        self._arriver_timers: dict[int, asyncio.TimerHandle] = {}

    def request(self, agg: WindowAggregate, threshold: float) -> None:
        """Have ``agg``'s stragglers found (if it is large and they are not known yet), and the
        rank its collectives waited for (``request_arriver``)."""
        self.request_arriver(agg)
        if agg.cheap or agg.stragglers_known:
            return
        key = id(agg)
        if key in self._busy:  # once the run under way ends, with what arrived meanwhile
            self._busy[key] = (agg, threshold, True)
            return
        self._busy[key] = (agg, threshold, False)
        snap = agg.snapshot()
        fut = asyncio.get_running_loop().run_in_executor(self.executor, snap.stragglers, threshold)
        self.runs += 1
        fut.add_done_callback(lambda f: self._done(agg, snap, f))

    def request_arriver(self, agg: WindowAggregate) -> None:
        """Have the rank ``agg``'s collectives waited for found off the loop, once no rank's
        collectives came in for ``ARRIVER_QUIET_S``: matching a large window's is about 1 s of
        CPU, and partials keep arriving after its summaries are all in; found on each, it cost
        3-5 s a window at 1,024 ranks with 200 collectives each (``bench/collectives.md``)."""
        if agg.cheap or arriver_known(agg) or not agg.collectives:
            return
        key = id(agg)
        timer = self._arriver_timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self._arriver_timers[key] = asyncio.get_running_loop().call_later(
            ARRIVER_QUIET_S, self._find_arriver, agg
        )

    def _find_arriver(self, agg: WindowAggregate) -> None:
        self._arriver_timers.pop(id(agg), None)
        if arriver_known(agg):
            return
        snap = agg.snapshot()
        fut = asyncio.get_running_loop().run_in_executor(self.executor, find_arriver, snap)
        self.arriver_runs += 1

        def done(f: Any) -> None:
            ok = not f.cancelled() and f.exception() is None
            if not ok:  # (kept as none found: never matched again each second for ever)
                log.warning("the last arriver of a window could not be found: %s", f.exception())
            keep_arriver(agg, snap, f.result() if ok else None)
            if not arriver_known(agg):  # (collectives came in while it ran)
                self.request_arriver(agg)

        fut.add_done_callback(done)

    def _done(self, agg: WindowAggregate, snap: WindowAggregate, fut: Any) -> None:
        if not fut.cancelled() and fut.exception() is None:
            agg.keep_stragglers(snap)
        _, threshold, again = self._busy.pop(id(agg))
        if again:
            self.request(agg, threshold)
