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
from typing import Any

from coordinator.core.aggregate import WindowAggregate


class StragglerRefresh:
    """Finds the stragglers of large aggregates in ``executor``, at most one run per aggregate."""

    def __init__(self, executor: concurrent.futures.Executor) -> None:
        self.executor = executor
        self.runs = 0  # computations started (what the tests count)
        self._busy: dict[int, tuple[WindowAggregate, float, bool]] = {}

    def request(self, agg: WindowAggregate, threshold: float) -> None:
        """Have ``agg``'s stragglers found (if it is large and they are not known yet)."""
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

    def _done(self, agg: WindowAggregate, snap: WindowAggregate, fut: Any) -> None:
        if not fut.cancelled() and fut.exception() is None:
            agg.keep_stragglers(snap)
        _, threshold, again = self._busy.pop(id(agg))
        if again:
            self.request(agg, threshold)
