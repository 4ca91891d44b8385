"""How long the coordinator's event loop stalls: a heartbeat every 10 ms, its lateness kept.

Every call the coordinator serves shares one event loop; a call that holds it delays every
other, step reports included. ``status()["process"]["loop"]`` shows the longest stall since the
coordinator started and the recent stalls of 20 ms or more, each with the loop thread's own CPU
time in it: a stall with little CPU is a process that waited for a core (or the GIL), not work
on the loop. So a stall is seen, not guessed.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import time

from coordinator.protocol.replies import LoopEntry

BEAT_S = 0.01
KEPT_MS = 20.0  # stalls at least this long are kept (the last 256 of them)


class LoopWatch:
    """The heartbeat task; started by the first ``entry()`` or ``start()`` on the loop."""

    def __init__(self) -> None:
        self.max_ms = 0.0
        self.max_at: float | None = None
        self.stalls: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=256)
        self._task: asyncio.Task[None] | None = None
        self.gc_max_ms: dict[int, float] = {}
        self.max_busy_ms = 0.0
        self._gc_t0 = 0.0

    def start(self) -> None:
        """Start the heartbeat, once; and freeze what the process holds by then (Ray's modules
        and the coordinator's code): the garbage collector's full passes, which stop every
        thread, then walk only what the runs add (at 1,024 ranks: 229 ms without, on this
        machine's benchmark)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._beat())
            gc.callbacks.append(self._gc)
            gc.collect()
            gc.freeze()

    def freeze_live(self) -> None:
        """Collect once, then freeze what is alive: called after a large registration, whose
        rank records stay for the run (20,000 objects at 10,000 ranks, walked by every full
        pass of the collector: 1.7 ms a pass in process, 20-40 ms of the 10,000-rank
        simulation's loop). Frozen objects are still freed by reference counting when they
        go; only a reference cycle that becomes garbage among them would stay (the records
        form none), and the collection before leaves no garbage to freeze."""
        gc.collect()
        gc.freeze()

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        """Time each collection of Python's cyclic garbage collector (it stops every thread)."""
        if phase == "start":
            self._gc_t0 = time.perf_counter()
            return
        ms = (time.perf_counter() - self._gc_t0) * 1e3
        gen = info.get("generation", 0)
        self.gc_max_ms[gen] = max(self.gc_max_ms.get(gen, 0.0), ms)

    async def _beat(self) -> None:
        while True:
            t0, c0 = time.perf_counter(), time.thread_time()
            await asyncio.sleep(BEAT_S)
            late_ms = (time.perf_counter() - t0 - BEAT_S) * 1e3
            # The loop thread's own CPU in that time: work on the loop, not a starved process.
            busy_ms = (time.thread_time() - c0) * 1e3
            if late_ms >= KEPT_MS:
                self.stalls.append((time.time(), round(late_ms, 1), round(busy_ms, 1)))
            if late_ms > self.max_ms:
                self.max_ms, self.max_at = late_ms, time.time()
            self.max_busy_ms = max(self.max_busy_ms, min(busy_ms, late_ms + BEAT_S * 1e3))

    def entry(self) -> LoopEntry:
        self.start()
        return {
            "max_stall_ms": round(self.max_ms, 1),
            "max_stall_at": self.max_at,
            "max_busy_ms": round(self.max_busy_ms, 1),
            "recent_stalls": [list(s) for s in self.stalls],
            "gc_max_ms": {str(g): round(ms, 1) for g, ms in sorted(self.gc_max_ms.items())},
        }
