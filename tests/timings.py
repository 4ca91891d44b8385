"""Each test's wall time and how busy the machine was meanwhile, for planning the suite's speed
(issue 55): with ``PROFILER_TEST_TIMINGS=<file>`` set, one JSON line per test phase is appended
to that file: its node id, phase (setup, call, teardown), wall seconds, and the seconds of CPU
the whole machine spent (every process's, from ``/proc/stat``; the pytest process's own apart).
A test that waits shows a low ``machine_cpu_s / wall_s``: parallel workers would gain there."""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Iterator

import pytest

TIMINGS = os.environ.get("PROFILER_TEST_TIMINGS")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_cpu_s() -> float:
    """Seconds of CPU every core spent busy since boot (user, nice, system, irq, softirq)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / _TICK


def _own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timed(item: pytest.Item, phase: str) -> Iterator[None]:
    wall, machine, own = time.monotonic(), _machine_cpu_s(), _own_cpu_s()
    yield
    row = {
        "test": item.nodeid,
        "phase": phase,
        "wall_s": round(time.monotonic() - wall, 3),
        "machine_cpu_s": round(_machine_cpu_s() - machine, 2),
        "pytest_cpu_s": round(_own_cpu_s() - own, 2),
    }
    assert TIMINGS is not None
    with open(TIMINGS, "a") as f:
        f.write(json.dumps(row) + "\n")


if TIMINGS:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
        yield from _timed(item, "setup")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
        yield from _timed(item, "call")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
        yield from _timed(item, "teardown")


def main(path: str) -> None:
    """Per module: wall seconds, and the machine's CPU over its wall (2.0: both cores busy)."""
    walls: dict[str, float] = {}
    cpus: dict[str, float] = {}
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        module = row["test"].split("::")[0]
        walls[module] = walls.get(module, 0.0) + row["wall_s"]
        cpus[module] = cpus.get(module, 0.0) + row["machine_cpu_s"]
    total = sum(walls.values())
    print(f"{'module':<48} {'wall s':>8} {'share':>6} {'cores busy':>10}")
    for module in sorted(walls, key=walls.__getitem__, reverse=True):
        w = walls[module]
        print(f"{module:<48} {w:8.1f} {w / total:6.1%} {cpus[module] / max(w, 1e-9):10.2f}")
    print(f"{'all':<48} {total:8.1f} {1:6.0%} {sum(cpus.values()) / max(total, 1e-9):10.2f}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1])
