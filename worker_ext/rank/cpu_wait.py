"""The training thread's wait for a CPU (issue 57's ``host_contention``): how long it was ready
to run yet not running, from Linux's per-thread scheduler statistics.

``/proc/thread-self/schedstat`` holds three numbers (Linux's Documentation/scheduler/
sched-stats.rst, "/proc/<pid>/schedstat"): time spent on the CPU, time spent waiting on a
runqueue (``run_delay``), and the timeslices run, the times in ns. A rank reads ``run_delay``
on the thread that drives its profiler as its window's recorded steps begin and as they end:
one small file read each, no thread of its own. A missing or unreadable file (not Linux, a
kernel without ``CONFIG_SCHED_INFO``) reads as None, never an exception into training; so do
two readings from different threads (their counters are not one clock). The rank sends the
mean a recorded step (``per_step``): the agent's trace may hold fewer steps than it measured.
"""

from __future__ import annotations

import threading

SCHEDSTAT = "/proc/thread-self/schedstat"
Reading = tuple[int, int]
"""A thread's native id and its ``run_delay`` (ns) then."""


def run_delay_ns() -> Reading | None:
    """The calling thread's time ready to run but waiting for a CPU so far (ns), or None."""
    tid = threading.get_native_id()
    for path in (SCHEDSTAT, f"/proc/self/task/{tid}/schedstat"):
        try:
            with open(path, "rb") as f:
                return tid, int(f.read(256).split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return None


def waited_ns(since: Reading | None) -> int | None:
    """The calling thread's wait for a CPU since the reading ``since`` (ns); None when either
    reading is missing or ``since`` is another thread's."""
    now = run_delay_ns() if since is not None else None
    if since is None or now is None or now[0] != since[0]:
        return None
    return max(now[1] - since[1], 0)


def per_step(waited: int | None, steps: tuple[int, int] | None) -> int | None:
    """``waited`` (ns, over the recorded steps ``steps``: first and last) as the mean a step;
    None when either is not known."""
    if waited is None or steps is None or steps[1] < steps[0]:
        return None
    return waited // (steps[1] - steps[0] + 1)
