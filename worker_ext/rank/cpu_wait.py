"""The training thread's wait for a CPU (issue 57's ``host_contention``): how long it was ready
to run yet not running, from Linux's per-thread scheduler statistics.

``/proc/thread-self/schedstat`` holds three numbers (Linux's Documentation/scheduler/
sched-stats.rst, "/proc/<pid>/schedstat"): time spent on the CPU, time spent waiting on a
runqueue (``run_delay``), and the timeslices run, the times in ns. A rank reads ``run_delay``
on the thread that drives its profiler as its window's recorded steps begin and as they end:
one small file read each, no thread of its own. A missing or unreadable file (not Linux, a
kernel without ``CONFIG_SCHED_INFO``) reads as None, never an exception into training.
"""

from __future__ import annotations

import threading

SCHEDSTAT = "/proc/thread-self/schedstat"


def run_delay_ns() -> int | None:
    """The calling thread's time ready to run but waiting for a CPU so far (ns), or None."""
    paths = (SCHEDSTAT, f"/proc/self/task/{threading.get_native_id()}/schedstat")
    for path in paths:
        try:
            with open(path, "rb") as f:
                return int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return None


def waited_ns(since: int | None) -> int | None:
    """The calling thread's wait for a CPU since the reading ``since`` (ns); None when either
    reading is missing."""
    if since is None:
        return None
    now = run_delay_ns()
    return None if now is None else max(now - since, 0)
