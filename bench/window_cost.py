"""What one window costs a user's training run, measured the way the user pays it.

The run, as a user sets it up: 2 Ray actor ranks with ``ProfilerWorkerMixin``, each step the
dispatch-bound loop of ``bench/workloads.py`` (12 ``Linear(64, 64)``, 4 forward/backward/optimizer
steps, one thread); ``skip_first=25, wait=0, warmup=1, active=40, repeat=1``, CPU activities,
``record_shapes``, ``export_type: chrome_trace``. The driver times every step: the ranks' ``train``
call, then ``hooks.step(k)``; nothing else runs in the training loop. A thread of the driver polls
``kernel_summary()`` every 50 ms until the table lists both ranks, as a user's notebook would, and
training goes on until 0.5 s after that.

Training time lost is the sum over steps of (step time - the median step before the window), from
the closing step until 0.5 s after the table was ready. It is compared with torch's own ``stop()``
and trace export in that closing step (timed inside each rank; the slower rank's, since the step
waits for both). Each rank also times its own ``train`` calls and its garbage collections, read
after the round (outside the loop), to say where a slow step went.

Run: RAY_AUTH_MODE=disabled .venv/bin/python bench/window_cost.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

import ray
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.workloads import DispatchBound, start_local_ray  # noqa: E402
from trainers import ProfilingHooks  # noqa: E402
from worker_ext import ProfilerWorkerMixin  # noqa: E402

SKIP_FIRST, WARMUP, ACTIVE = 25, 1, 40
CLOSING_STEP = SKIP_FIRST + WARMUP + ACTIVE - 1  # the step whose report stops the window
POLL_S, AFTER_S = 0.05, 0.5


class TimedRank(DispatchBound, ProfilerWorkerMixin):
    """A rank that times its own steps, torch's stop (with the export inside it) and its
    garbage collections, all in its own process."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[float, float]] = []  # (start, seconds), time.time() clock
        self.stops: list[float] = []
        self.calls: list[tuple[float, float]] = []  # profile_step RPCs: (start, seconds)
        self.collections: list[tuple[float, int, float, int]] = []  # (start, gen, s, collected)
        self._gc_t0 = 0.0
        real_stop = torch.profiler.profile.stop

        def timed_stop(prof: Any) -> None:
            t0 = time.perf_counter()
            try:
                real_stop(prof)
            finally:
                self.stops.append(time.perf_counter() - t0)

        torch.profiler.profile.stop = timed_stop
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
            return
        took = time.perf_counter() - self._gc_t0
        if took > 0.005:
            self.collections.append(
                (time.time() - took, info["generation"], took, info["collected"])
            )

    def profile_step(self, step: int) -> Any:
        t0, p0 = time.time(), time.perf_counter()
        try:
            return super().profile_step(step)
        finally:
            self.calls.append((t0, time.perf_counter() - p0))

    def train(self) -> None:
        t0, p0 = time.time(), time.perf_counter()
        self.train_step()
        self.steps.append((t0, time.perf_counter() - p0))

    def plain_torch_window(self, path: str) -> dict[str, float]:
        """The same window with torch.profiler alone (its own stop + export,
        then the free of its results, which a plain user pays at some later collection)."""
        prof = self.plain_window(WARMUP, ACTIVE)
        t0 = time.perf_counter()
        prof.stop()
        prof.export_chrome_trace(path)
        t1 = time.perf_counter()
        prof.profiler.kineto_results = None  # what the collection that frees it would run
        t2 = time.perf_counter()
        os.unlink(path)
        return {"stop_export": t1 - t0, "free": t2 - t1}

    def report(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "stops": self.stops,
            "collections": self.collections,
            "calls": self.calls,
        }

    def leftover(self) -> dict[str, Any]:
        """After the round: torch profilers whose results are still alive (garbage no
        collection has reached yet), and what a full collection costs now; that cost would
        have landed on some later training step."""
        held = sum(
            1
            for o in gc.get_objects()
            if isinstance(o, torch.profiler.profile)
            and getattr(getattr(o, "profiler", None), "kineto_results", None) is not None
        )
        t0 = time.perf_counter()
        gc.collect()
        return {"held": held, "full_collection": time.perf_counter() - t0}


def user_config(save_path: str, run_name: str, skip_first: int = SKIP_FIRST) -> dict[str, Any]:
    """The user's config: one window of warm-up 1 and 40 recorded steps, CPU, shapes."""
    return {
        "enable": True,
        "save_path": save_path,
        "run_name": run_name,
        "ranks": "all",
        "activities": ["cpu"],
        "record_shapes": True,
        "skip_first": skip_first,
        "wait": 0,
        "warmup": WARMUP,
        "active": ACTIVE,
        "repeat": 1,
        "export_type": "chrome_trace",
    }


def one_round(tmp: str) -> dict[str, Any]:
    """One run: fresh ranks, a fresh coordinator, one window; every step timed."""
    name = f"wcost-{uuid.uuid4().hex[:6]}"
    config = user_config(tmp, name)
    ranks = [ray.remote(num_cpus=0)(TimedRank).remote() for _ in range(2)]
    ray.get([r.report.remote() for r in ranks])  # both up (torch imported) before the clock
    # One plain window first, not counted: its freed memory warms each rank's heap, so that the
    # window measured and the plain window after the round both start from a warm one.
    ray.get(
        [
            r.plain_torch_window.remote(os.path.join(tmp, f"{name}-w{n}.json"))
            for n, r in enumerate(ranks)
        ]
    )
    hooks = ProfilingHooks.attach(config, workers=ranks, trainer_id="bench", name=name)
    coord = hooks.coordinator
    ready: list[float] = []
    done = threading.Event()

    def poll() -> None:  # the user's notebook, on a thread of the driver
        while not done.is_set():
            ks = ray.get(coord.kernel_summary.remote(window=None))
            if ks["window"] == 0 and len(ks["ranks"]) == 2:
                ready.append(time.perf_counter())
                return
            time.sleep(POLL_S)

    poller = threading.Thread(target=poll, daemon=True)
    steps: list[float] = []
    reports: list[float] = []  # of each step, the time in hooks.step (the rest: the ranks' train)
    ends: list[float] = []
    try:
        with hooks.session(first_step=0):
            poller.start()
            for k in range(5000):
                t0 = time.perf_counter()
                ray.get([r.train.remote() for r in ranks])
                t1 = time.perf_counter()
                hooks.step(k)
                ends.append(time.perf_counter())
                reports.append(ends[-1] - t1)
                steps.append(ends[-1] - t0)
                if ready and ends[-1] > ready[0] + AFTER_S:
                    break
    finally:
        done.set()
        poller.join(timeout=10)
        timings = ray.get([r.report.remote() for r in ranks])
        leftovers = ray.get([r.leftover.remote() for r in ranks])
        plain = ray.get(
            [
                r.plain_torch_window.remote(os.path.join(tmp, f"{name}-{n}.json"))
                for n, r in enumerate(ranks)
            ]
        )
        for h in (coord, *ranks):
            ray.kill(h)
    if not ready:
        raise RuntimeError("the table never listed both ranks within 5,000 steps")
    base = statistics.median(steps[5:SKIP_FIRST])
    over = [t - base for t in steps]
    later = over[CLOSING_STEP + 1 :]
    # Steps that ended before the table listed both ranks (the node agent was still at work).
    before_table = [
        o for o, end in zip(later, ends[CLOSING_STEP + 1 :], strict=True) if end <= ready[0]
    ]
    after_table = later[len(before_table) :]
    worst_at = max(range(len(later)), key=later.__getitem__)
    torch_s = max(rep["stops"][-1] for rep in timings)
    closing_rpc = max(rep["calls"][-1][1] for rep in timings)  # the stop_profile's RPC, in-rank
    # Each rank's own view: its worst train call after the close, and its slowest collection.
    rank_views = []
    for rep in timings:
        own = [s for _, s in rep["steps"]]
        own_base = statistics.median(own[5:SKIP_FIRST])
        worst_own = max(own[CLOSING_STEP + 1 :]) - own_base
        gcs = sorted(rep["collections"], key=lambda c: -c[2])
        rank_views.append((worst_own, gcs[0] if gcs else None))
    return {
        "base": base,
        "closing": over[CLOSING_STEP],
        "later_steps": len(later),
        "worst_later": later[worst_at],
        "worst_later_after": worst_at + 1,
        "worst_later_report": reports[CLOSING_STEP + 1 + worst_at],
        "lost": over[CLOSING_STEP] + sum(later),
        "torch": torch_s,
        "closing_rpc": closing_rpc,
        "table_after": ready[0] - ends[CLOSING_STEP],
        "ranks": rank_views,
        "before_table": (len(before_table), statistics.median(before_table or [0.0])),
        "after_table": (len(after_table), statistics.median(after_table or [0.0])),
        "leftovers": leftovers,
        # Torch alone, both ranks at once as in the closing step: the slower rank's figures.
        "plain": max(p["stop_export"] for p in plain),
        "plain_all": max(p["stop_export"] + p["free"] for p in plain),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-window-cost-")
    start_local_ray()
    rounds = []
    for i in range(args.rounds):
        r = one_round(tmp)
        rounds.append(r)
        print(round_line(i + 1, r), flush=True)
    ray.shutdown()
    print()
    print(summary_table(rounds))


def round_line(n: int, r: dict[str, Any]) -> str:
    ranks = "; ".join(
        f"rank {i}: worst own step +{w * 1e3:.0f} ms"
        + (f", slowest collection gen {g[1]} {g[2] * 1e3:.0f} ms ({g[3]} freed)" if g else "")
        + f", after the round {x['held']} window results alive and a full collection "
        f"{x['full_collection'] * 1e3:.0f} ms"
        for i, ((w, g), x) in enumerate(zip(r["ranks"], r["leftovers"], strict=True))
    )
    return (
        f"round {n}: median step {r['base'] * 1e3:.2f} ms; closing step "
        f"+{r['closing'] * 1e3:.0f} ms (torch's stop + export in it {r['torch'] * 1e3:.0f} ms, the "
        f"slower rank's whole RPC {r['closing_rpc'] * 1e3:.0f} ms); "
        f"worst of {r['later_steps']} later steps +{r['worst_later'] * 1e3:.1f} ms "
        f"({r['worst_later_after']} steps after the close, {r['worst_later_report'] * 1e3:.1f} ms "
        f"of it in hooks.step); the table {r['table_after'] * 1e3:.0f} ms after the closing step "
        f"ended; later steps over the median: {r['before_table'][0]} before the "
        f"table +{r['before_table'][1] * 1e3:.2f} ms each, {r['after_table'][0]} after it "
        f"+{r['after_table'][1] * 1e3:.2f} ms; lost {r['lost'] * 1e3:.0f} ms; plain torch "
        f"window: stop + export {r['plain'] * 1e3:.0f} ms, with the free of its results "
        f"{r['plain_all'] * 1e3:.0f} ms; {ranks}"
    )


def summary_table(rounds: list[dict[str, Any]]) -> str:
    med = statistics.median

    def span(vals: list[float], fmt: str = "{:.0f}") -> str:
        return f"{fmt.format(med(vals))} ({fmt.format(min(vals))}-{fmt.format(max(vals))})"

    def ms(key: str, fmt: str = "{:.0f}") -> str:
        return span([r[key] * 1e3 for r in rounds], fmt) + " ms"

    def ratio(key: str, base: str) -> str:
        return span([r[key] / r[base] for r in rounds], "{:.2f}") + "x"

    rows = [
        (f"median step before the window ({len(rounds)} rounds)", ms("base", "{:.2f}"), ""),
        ("torch's stop + export inside the closing step (the slower rank)", ms("torch"), ""),
        ("plain torch.profiler, same window, same ranks: stop + export", ms("plain"), ""),
        ("the same with the free of its results (torch's whole cost)", ms("plain_all"), ""),
        (
            "the slower rank's closing RPC (stop, export, free, reply), in the rank",
            ms("closing_rpc"),
            "",
        ),
        ("closing step over the median", ms("closing"), ""),
        (
            "worst later step over the median (to 0.5 s after the table)",
            ms("worst_later", "{:.1f}"),
            "<= 20 ms",
        ),
        ("the table listed both ranks, after the closing step", ms("table_after"), ""),
        ("training time lost (closing step + every later step)", ms("lost"), ""),
        ("lost / torch's stop + export in the closing step", ratio("lost", "torch"), "<= 1.1x"),
        ("lost / plain torch's stop + export", ratio("lost", "plain"), ""),
        ("lost / plain torch's stop + export + free", ratio("lost", "plain_all"), ""),
    ]
    lines = ["| what: median (range) | figure | goal |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
