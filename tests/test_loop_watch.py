"""The coordinator's loop watch: a stall is seen, with the loop's own CPU in it."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

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


@pytest.mark.subprocess
def test_freeze_live_keeps_the_live_objects_out_of_the_collectors_passes():
    """After a large registration the rank records are frozen: no full pass walks them again,
    and they still go when nothing refers to them. In a subprocess: a freeze is for good."""
    import subprocess
    import sys

    code = """
import gc, weakref
from coordinator.service.loop_watch import LoopWatch
class Rec:
    pass
records = [Rec() for _ in range(1000)]
garbage = Rec(); garbage.me = garbage  # a cycle nobody refers to: collected, not frozen
gone = weakref.ref(garbage); del garbage
LoopWatch().freeze_live()
walked = {id(o) for o in gc.get_objects()}
print(gone() is None, gc.get_freeze_count() >= 1000, not any(id(r) in walked for r in records))
last = weakref.ref(records[-1]); del records
print(last() is None)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True"] * 4, out.stderr
