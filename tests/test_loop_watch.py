"""The coordinator's loop watch: a stall is seen, with the loop's own CPU in it."""

from __future__ import annotations

import asyncio
import gc
import time

from coordinator.service.loop_watch import LoopWatch


def _burn(cpu_s: float) -> None:
    """Hold the thread for ``cpu_s`` of its own CPU (however long a busy machine makes it)."""
    t0 = time.thread_time()
    while time.thread_time() - t0 < cpu_s:
        pass


def test_a_stall_is_kept_with_the_loop_s_own_cpu():
    watch = LoopWatch()

    async def main() -> None:
        watch.start()
        await asyncio.sleep(0.05)
        _burn(0.12)  # a call that holds the loop
        await asyncio.sleep(0.05)

    try:
        asyncio.run(main())
    finally:
        gc.callbacks.remove(watch._gc)
        gc.unfreeze()
    entry = watch.entry()
    assert entry["max_stall_ms"] >= 100, entry
    assert any(ms >= 100 and busy >= 100 for _, ms, busy in entry["recent_stalls"]), entry
