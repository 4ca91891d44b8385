"""Both engines side by side: what one window costs a user's run with ``engine: torch`` and with
``engine: kineto``, on the same window, measured the way the user pays it.

The run of ``bench/window_cost.py`` (Ray actor ranks with ``ProfilerWorkerMixin``, each step the
dispatch-bound loop of ``bench/workloads.py``: 4 optimizer steps a global step; 40 recorded
steps of CPU activities with ``record_shapes``, about 100,000 events a rank; ``export_type:
chrome_trace``), once per engine in each round, with 1 rank (a core to spare for it: the agent
and libkineto's threads) and with 2 ranks (none to spare on this 2-core machine). The kineto
ranks are started with ``worker_ext.kineto_env()``; their warm-up is the 3 s lead a config needs
(libkineto polls once a second), the torch ranks' is 1 step.

Per run: the median step before the window and inside it; the closing step; the worst later step
and the training time lost (the closing step and every later step over the median step before
the window, until 0.5 s after ``kernel_summary()`` lists every rank); the CPU the ranks' other
threads (libkineto's, on a kineto rank) and the node agent (with its daemon) spent from the
window's start until then; and, in the same rank processes after the run, a plain
``torch.profiler`` window of the same size: its stop + export + free, torch's whole cost.

Run: RAY_AUTH_MODE=disabled .venv/bin/python bench/engine_cost.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

import psutil
import ray

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.window_cost import ACTIVE, WARMUP, TimedRank, user_config  # noqa: E402
from bench.workloads import start_local_ray  # noqa: E402
from trainers import ProfilingHooks  # noqa: E402
from worker_ext import kineto_env  # noqa: E402

SKIP_FIRST = 25
KINETO_LEAD_S = 3.0
POLL_S, AFTER_S = 0.05, 0.5


class EngineRank(TimedRank):
    """A timed rank that also reads the CPU of its threads other than the main one."""

    def other_threads_cpu(self) -> float:
        main = threading.main_thread().native_id
        total = 0.0
        for t in psutil.Process().threads():
            if t.id != main:
                total += t.user_time + t.system_time
        return total

    def pid(self) -> int:
        return os.getpid()


def agent_cpu(pid: int | None) -> float:
    """The node agent's CPU and its children's (the kineto daemon), in seconds."""
    if pid is None:
        return 0.0
    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
        return float(sum(q.cpu_times().user + q.cpu_times().system for q in procs))
    except psutil.Error:
        return 0.0


def one_run(tmp: str, engine: str, n_ranks: int, kdir: str) -> dict[str, Any]:
    """One user run: fresh ranks and coordinator, one window; every step timed."""
    name = f"ecost-{uuid.uuid4().hex[:6]}"
    config = user_config(tmp, name)
    config["engine"] = engine
    warmup = WARMUP
    env: dict[str, Any] = {}
    if engine == "kineto":
        env = {"env_vars": kineto_env(kdir)}
    make = (
        ray.remote(num_cpus=0, runtime_env=env)(EngineRank)
        if env
        else ray.remote(num_cpus=0)(EngineRank)
    )
    ranks = [make.remote() for _ in range(n_ranks)]
    ray.get([r.report.remote() for r in ranks])
    ray.get(
        [
            r.plain_torch_window.remote(os.path.join(tmp, f"{name}-w{n}.json"))
            for n, r in enumerate(ranks)
        ]
    )
    # Step time, to size the kineto warm-up as a lead in seconds.
    t0 = time.perf_counter()
    for _ in range(10):
        ray.get([r.train.remote() for r in ranks])
    step_s = (time.perf_counter() - t0) / 10
    if engine == "kineto":
        warmup = max(WARMUP, int(KINETO_LEAD_S / step_s) + 1)
    config["warmup"] = warmup
    first = SKIP_FIRST + warmup
    closing = first + ACTIVE - 1
    hooks = ProfilingHooks.attach(config, workers=ranks, trainer_id="bench", name=name)
    coord = hooks.coordinator
    assert coord is not None
    ready: list[float] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            ks = ray.get(coord.kernel_summary.remote(window=None))
            if ks["window"] == 0 and len(ks["ranks"]) == n_ranks:
                ready.append(time.perf_counter())
                return
            time.sleep(POLL_S)

    poller = threading.Thread(target=poll, daemon=True)
    steps: list[float] = []
    ends: list[float] = []
    cpu0: list[float] = []
    agent_pid: int | None = None
    try:
        with hooks.session(first_step=0):
            poller.start()
            for k in range(100_000):
                if k == SKIP_FIRST:
                    status = ray.get(ranks[0].profile_step.remote(-1))
                    agent_pid = status["agent"]["pid"]
                    cpu0 = [
                        *ray.get([r.other_threads_cpu.remote() for r in ranks]),
                        agent_cpu(agent_pid),
                    ]
                s0 = time.perf_counter()
                ray.get([r.train.remote() for r in ranks])
                hooks.step(k)
                ends.append(time.perf_counter())
                steps.append(ends[-1] - s0)
                if ready and ends[-1] > ready[0] + AFTER_S:
                    break
                if k > closing + 20_000:
                    break
        cpu1 = [*ray.get([r.other_threads_cpu.remote() for r in ranks]), agent_cpu(agent_pid)]
        table = ray.get(coord.kernel_summary.remote(0, 100_000))
    finally:
        done.set()
        poller.join(timeout=10)
        plain = ray.get(
            [
                r.plain_torch_window.remote(os.path.join(tmp, f"{name}-{n}.json"))
                for n, r in enumerate(ranks)
            ]
        )
        for h in (coord, *ranks):
            ray.kill(h)
    if not ready:
        raise RuntimeError(f"{engine}: the table never listed every rank")
    base = statistics.median(steps[5:SKIP_FIRST])
    inside = statistics.median(steps[first:closing])
    over = [t - base for t in steps]
    later = over[closing + 1 :]
    return {
        "engine": engine,
        "ranks": n_ranks,
        "base": base,
        "inside": inside,
        "closing_step": steps[closing],
        "closing_over_inside": steps[closing] / inside,
        "worst_later": max(later) if later else 0.0,
        "lost": over[closing] + sum(later),
        "summary_after": ready[0] - ends[closing],
        "rank_threads_cpu": sum(cpu1[:-1]) - sum(cpu0[:-1]),
        "agent_cpu": cpu1[-1] - cpu0[-1],
        "torch_whole": max(p["stop_export"] + p["free"] for p in plain),
        # The same window on both engines: its steps and its op calls (per rank).
        "window": f"{table['steps']}{' partial' if table['partial'] else ''}",
        "calls_per_rank": sum(k["count"] for k in table["kernels"]) // n_ranks,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-engine-cost-")
    kdir = tempfile.mkdtemp(prefix="kb-", dir="/tmp")
    start_local_ray()
    runs = []
    for i in range(args.rounds):
        for n in (1, 2):
            for engine in ("torch", "kineto"):
                r = one_run(tmp, engine, n, os.path.join(kdir, "k"))
                runs.append(r)
                print(
                    f"round {i + 1}: " + ", ".join(f"{k} {fmt(v)}" for k, v in r.items()),
                    flush=True,
                )
    ray.shutdown()
    print()
    print(table(runs))


def fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def table(runs: list[dict[str, Any]]) -> str:
    med = statistics.median

    def cell(engine: str, n: int, key: str, scale: float = 1e3, unit: str = " ms") -> str:
        vals = [r[key] * scale for r in runs if r["engine"] == engine and r["ranks"] == n]
        f = "{:.2f}" if unit == "x" else "{:.0f}"
        return f"{f.format(med(vals))} ({f.format(min(vals))}-{f.format(max(vals))}){unit}"

    rows = [
        ("median step before the window", "base", 1e3, " ms"),
        ("median step inside the window", "inside", 1e3, " ms"),
        ("closing step", "closing_step", 1e3, " ms"),
        ("closing step / a step inside the window (goal <= 1.1x)", "closing_over_inside", 1, "x"),
        ("worst later step over the median", "worst_later", 1e3, " ms"),
        ("the table listed every rank, after the closing step", "summary_after", 1e3, " ms"),
        ("training time lost (closing step + every later step)", "lost", 1e3, " ms"),
        ("CPU of the ranks' other threads (libkineto's on kineto)", "rank_threads_cpu", 1e3, " ms"),
        ("CPU of the node agent and its daemon", "agent_cpu", 1e3, " ms"),
        ("torch's stop + export + free of a plain window (same ranks)", "torch_whole", 1e3, " ms"),
    ]
    head = (
        "| what: median (range) | torch, 1 rank | kineto, 1 rank | torch, 2 ranks "
        "| kineto, 2 ranks |"
    )
    lines = [head, "|---|---|---|---|---|"]
    for label, key, scale, unit in rows:
        cells = [cell(e, n, key, scale, unit) for n in (1, 2) for e in ("torch", "kineto")]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    ratio = []
    for n in (1, 2):
        for e in ("torch", "kineto"):
            vals = [
                r["lost"] / r["torch_whole"] for r in runs if r["engine"] == e and r["ranks"] == n
            ]
            ratio.append(f"{med(vals):.2f} ({min(vals):.2f}-{max(vals):.2f})x")
    lines.append(
        "| lost / torch's stop + export + free (goal for kineto with a spare core: <= 0.3x) | "
        + " | ".join(ratio)
        + " |"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
