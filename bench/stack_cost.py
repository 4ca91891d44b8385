"""What taking every rank's stack costs the ranks, and how long all stacks take, at 8 and 32 ranks.

N Ray actors play training ranks: each runs a loop in its main thread (0.1 ms of work, then a
1 ms wait, like a step waiting on its GPU) and records every gap between iterations longer than
its usual one, with the wall-clock time. The real coordinator has them registered; the driver
calls ``stacks()`` a few times, once a second, and notes when each call ran. Then, per rank:
  - pause: the longest gap inside a ``stacks()`` call (py-spy stops the process while it reads);
  - baseline: the longest gap inside windows as long, between the calls (the machine's own
    noise: 2 cores shared by N ranks, the coordinator and the agent).
And the time to all stacks: ``stacks()`` as the caller sees it, and each process's read on its
agent (``read_ms``, py-spy's run, which bounds the pause).

Run: RAY_AUTH_MODE=disabled .venv/bin/python bench/stack_cost.py [--ranks 8 32] [--calls 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid

import ray

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from coordinator import ProfilerConfig, get_or_create_coordinator  # noqa: E402
from tests.configs import ROOT  # noqa: E402
from worker_ext import ProfilerWorkerMixin  # noqa: E402
from worker_ext.rank.agent_link import ensure_node_agents  # noqa: E402


class Spinner(ProfilerWorkerMixin):
    """A rank whose ``spin`` loop notes every gap between its iterations over ``min_gap_ms``."""

    def spin(self, seconds: float, min_gap_ms: float = 3.0) -> list[tuple[float, float]]:
        gaps, end = [], time.perf_counter() + seconds
        last = time.perf_counter()
        while last < end:
            x = 0
            for i in range(300):  # about 0.1 ms of Python
                x += i * i
            time.sleep(0.001)
            now = time.perf_counter()
            if (now - last) * 1000 > min_gap_ms:
                gaps.append((time.time(), (now - last) * 1000))
            last = now
        return gaps


def longest(gaps: list[tuple[float, float]], windows: list[tuple[float, float]]) -> float:
    """The longest gap that ended inside one of ``windows`` (0: none over the floor)."""
    return max((g for t, g in gaps if any(a <= t <= b for a, b in windows)), default=0.0)


def measure(n: int, calls: int) -> dict[str, float]:
    cls = ray.remote(num_cpus=0)(Spinner)
    ranks = [cls.remote() for _ in range(n)]
    ray.get([r.__ray_ready__.remote() for r in ranks])
    name = f"bench-stacks-{uuid.uuid4().hex[:6]}"
    coord = get_or_create_coordinator(ProfilerConfig(enable=False), name=name)
    try:
        ray.get(coord.register.remote("bench", ranks))
        ensure_node_agents(ranks)  # as the hooks do at attach
        ray.get(coord.stacks.remote(ranks=[0]))  # the agent's first start is not measured
        spins = [r.spin.remote(calls * 1.5 + 3.0) for r in ranks]
        time.sleep(1.5)
        during, between, elapsed, read_ms = [], [], [], []
        for _ in range(calls):
            t0 = time.time()
            st = ray.get(coord.stacks.remote())
            t1 = time.time()
            during.append((t0, t1 + 0.05))  # a gap ends just after the read that caused it
            between.append((t1 + 0.3, t1 + 0.3 + (t1 - t0)))
            elapsed.append(t1 - t0)
            assert not st["unreadable"], st["unreadable"]
            time.sleep(1.0)
            read_ms += [e["read_ms"] or 0.0 for e in st["entries"] if e["who"] == "rank"]
        gaps = ray.get(spins)
    finally:
        ray.kill(coord)
        for r in ranks:
            ray.kill(r)
    pause = [longest(g, during) for g in gaps]
    base = [longest(g, between) for g in gaps]
    return {
        "ranks": n,
        "stacks_s_median": statistics.median(elapsed),
        "stacks_s_max": max(elapsed),
        "pause_ms_median": statistics.median(pause),
        "pause_ms_max": max(pause),
        "baseline_ms_median": statistics.median(base),
        "baseline_ms_max": max(base),
        "read_ms_median": statistics.median(read_ms),
        "read_ms_max": max(read_ms),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": ROOT, "RAY_AUTH_MODE": "disabled"}},
    )
    try:
        print(
            f"{'ranks':>5} {'stacks() median/max s':>22} {'pause median/max ms':>20} "
            f"{'baseline median/max ms':>23} {'read on agent median/max ms':>28}"
        )
        for n in args.ranks:
            m = measure(n, args.calls)
            print(
                f"{n:>5} {m['stacks_s_median']:>13.2f} / {m['stacks_s_max']:<6.2f} "
                f"{m['pause_ms_median']:>11.1f} / {m['pause_ms_max']:<6.1f} "
                f"{m['baseline_ms_median']:>14.1f} / {m['baseline_ms_max']:<6.1f} "
                f"{m['read_ms_median']:>19.1f} / {m['read_ms_max']:<6.1f}",
                flush=True,
            )
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
