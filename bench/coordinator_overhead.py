"""Trainer-side cost of the coordinator, and cross-rank aggregation at scale.

Part 1 (real Ray, this machine): time per training step outside windows with
  (a) no profiling, (b) this coordinator through StepClient, (c) the pattern it replaces,
  a blocking ray.get of profile_step on every rank on every step, and (d) as (b), with the
  step timed as a region and its phase record riding on the reports (what hooks.region does);
  plus the trainer-side latency of a window's first and last step; and how long an
  operator's request_capture waits for its answer while a StepClient trainer steps (the
  request waits for the trainer's next report).
Part 2 (in process): ingest and query of 1,024 ranks x 2,000 kernels.

Run: .venv/bin/python bench/coordinator_overhead.py [--ranks 2 4 8] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import threading
import time
import tracemalloc

import ray

from coordinator import ProfilerConfig, get_or_create_coordinator
from coordinator.client.phase_clock import PhaseClock, Region
from coordinator.client.step_client import StepClient
from coordinator.core.records import RankRecord
from coordinator.core.schedule import Window
from coordinator.core.state import CoordinatorState, kernel_summary
from coordinator.protocol.summary_codec import KernelRow, RankSummary, encode_summary
from worker_ext import ProfilerWorkerMixin


class BenchWorker(ProfilerWorkerMixin):
    """A rank whose training step is a short, fixed piece of work."""

    def __init__(self) -> None:
        import torch

        torch.manual_seed(0)
        self.a = torch.randn(64, 64)

    def train_step(self) -> float:
        return float((self.a @ self.a).sum())


def loop(workers, steps: int, after_step, clock: PhaseClock | None = None) -> float:
    """Mean seconds per step of a trainer that runs every rank, then reports the step; with
    ``clock``, the ranks' work is timed as the region ``train``, as ``hooks.region`` does."""
    t0 = time.perf_counter()
    for k in range(steps):
        with Region(clock, "train"):
            ray.get([w.train_step.remote() for w in workers])
        after_step(k)
    return (time.perf_counter() - t0) / steps


def bench_ranks(n: int, steps: int, rounds: int) -> dict[str, float]:
    tmp = tempfile.mkdtemp(prefix="bench-coord-")
    # No window for the whole measured stretch: skip_first beyond the run.
    cfg = ProfilerConfig(
        enable=True,
        save_path=tmp,
        ranks="all",
        activities=["cpu"],
        skip_first=10**9,
        warmup=1,
        active=2,
        repeat=1,
    )
    Worker = ray.remote(num_cpus=0)(BenchWorker)
    workers = [Worker.remote() for _ in range(n)]
    coord = get_or_create_coordinator(cfg, name=f"bench-{n}", namespace="bench")
    ray.get(coord.register.remote("t", workers))
    client = StepClient(coord, "t")
    client.start(0)
    k0 = [0]

    def coordinator_step(k):
        client.step(k0[0])
        k0[0] += 1

    clock = PhaseClock()
    clock.begin_step()

    def phases_step(k):
        client.add_phases(clock.close_step(k0[0]))
        client.step(k0[0])
        k0[0] += 1
        clock.begin_step()

    def fan_out_step(k):
        ray.get([w.profile_step.remote(k) for w in workers])

    def nothing(k):
        pass

    loop(workers, 20, nothing)  # warm the actors up
    res = {"a": [], "b": [], "c": [], "d": []}
    for _ in range(rounds):  # interleaved, so drift on this shared machine hits all four
        res["a"].append(loop(workers, steps, nothing))
        res["b"].append(loop(workers, steps, coordinator_step))
        res["c"].append(loop(workers, steps, fan_out_step))
        res["d"].append(loop(workers, steps, phases_step, clock))
    client.stop()  # (it sends the last report, with the records still waiting for one)
    out_phases = ray.get(coord.phase_times.remote(last=0))["steps_seen"]
    assert out_phases == rounds * steps, out_phases  # every step's record arrived
    out = {key: statistics.median(v) for key, v in res.items()}

    # Window edges: a fresh coordinator whose window opens at step 1 and closes at step 3.
    cfg2 = ProfilerConfig(
        enable=True,
        save_path=tmp,
        ranks="all",
        activities=["cpu"],
        wait=1,
        warmup=1,
        active=2,
        repeat=0,
    )
    coord2 = get_or_create_coordinator(cfg2, name=f"bench-edge-{n}", namespace="bench")
    ray.get(coord2.register.remote("t", workers))
    ray.get(coord2.start.remote("t", 0))
    first, last = [], []
    for k in range(4 * 6):
        ray.get([w.train_step.remote() for w in workers])
        t0 = time.perf_counter()
        ray.get(coord2.step.remote("t", k))
        dt = time.perf_counter() - t0
        if k % 4 == 0 and k >= 4:  # opens the window (warm-up at step k+1)
            first.append(dt)
        elif k % 4 == 3 and k >= 4:  # closes it (stop + export on every rank)
            last.append(dt)
    ray.get(coord2.stop.remote("t"))
    out["first"] = statistics.median(first)
    out["last"] = statistics.median(last)
    for h in (coord, coord2, *workers):
        ray.kill(h)
    return out


def capture_latency(n: int, requests: int, step_s: float) -> dict[str, float]:
    """Seconds request_capture takes to answer while a StepClient trainer keeps stepping."""
    tmp = tempfile.mkdtemp(prefix="bench-capture-")
    cfg = ProfilerConfig(
        enable=True, save_path=tmp, ranks="all", activities=["cpu"], on_demand_only=True
    )
    Worker = ray.remote(num_cpus=0)(BenchWorker)
    workers = [Worker.remote() for _ in range(n)]
    coord = get_or_create_coordinator(cfg, name=f"bench-capture-{n}", namespace="bench")
    ray.get(coord.register.remote("t", workers))
    client = StepClient(coord, "t")
    client.start(0)
    done = threading.Event()

    def train() -> None:
        k = 0
        while not done.is_set():
            ray.get([w.train_step.remote() for w in workers])
            time.sleep(step_s)
            client.step(k)
            k += 1
        client.stop()

    trainer = threading.Thread(target=train)
    trainer.start()
    waits = []
    try:
        while len(waits) < requests:
            time.sleep(random.uniform(0.05, 0.3))
            t0 = time.perf_counter()
            answer = ray.get(coord.request_capture.remote(active=1, warmup=0))
            if answer["accepted"]:
                waits.append(time.perf_counter() - t0)
    finally:
        done.set()
        trainer.join()
    for h in (coord, *workers):
        ray.kill(h)
    return {"median": statistics.median(waits), "max": max(waits)}


def bench_aggregation(ranks: int, kernels: int, top: int) -> dict[str, float]:
    rng = random.Random(0)
    names = [f"void gemm_kernel_{i}<float, 128, 64>(Params)" for i in range(kernels)]
    blobs = []
    for r in range(ranks):
        rows = [KernelRow(n, rng.uniform(1, 1000), rng.randint(1, 50), 0) for n in names]
        blobs.append(encode_summary(RankSummary(r, 0, (10, 12), False, "cuda", rows)))
    keys = [("t", r) for r in range(ranks)]

    def fresh_state():
        st = CoordinatorState(max_windows=8)
        for key in keys:
            st.ranks[key] = RankRecord("t", key[1], True)
        st.stepping_trainer = "t"
        return st, st.open_window(Window(0, 9, 10, 12), keys)

    st, rec = fresh_state()
    t0 = time.perf_counter()
    for key, blob in zip(keys, blobs, strict=True):
        st.ingest_summary(key, blob)
    ingest = (time.perf_counter() - t0) / ranks
    st.close_window(rec)
    # Memory on a second, identical pass (tracemalloc slows allocation down).
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    st2, rec2 = fresh_state()
    for key, blob in zip(keys, blobs, strict=True):
        st2.ingest_summary(key, blob)
    st2.close_window(rec2)
    retained, peak = tracemalloc.get_traced_memory()
    retained -= before
    tracemalloc.stop()
    del st2
    queries = []
    for _ in range(20):
        t0 = time.perf_counter()
        table = kernel_summary(st, None, top, None)
        queries.append(time.perf_counter() - t0)
    assert len(table["ranks"]) == ranks and len(table["kernels"]) == top
    return {
        "ingest_ms_per_rank": ingest * 1e3,
        "query_ms": statistics.median(queries) * 1e3,
        "retained_mb": retained / 2**20,
        "peak_mb": (peak - before) / 2**20,
        "payload_kb_per_rank": statistics.mean(len(b) for b in blobs) / 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--agg-ranks", type=int, default=1024)
    ap.add_argument("--agg-kernels", type=int, default=2000)
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=32, include_dashboard=False, log_to_driver=False)
    print("trainer-side ms per step outside windows (median of interleaved rounds)")
    print(
        f"{'ranks':>5} {'(a) none':>9} {'(b) coord':>10} {'(c) fan-out':>12} "
        f"{'b-a':>7} {'c-a':>7} {'(b-a)/(c-a)':>12} {'first':>7} {'last':>7} "
        f"{'(d) phases':>11} {'d-b':>7}"
    )
    for n in args.ranks:
        r = bench_ranks(n, args.steps, args.rounds)
        ba, ca = r["b"] - r["a"], r["c"] - r["a"]
        ratio = ba / ca if ca > 0 else float("nan")
        print(
            f"{n:>5} {r['a'] * 1e3:>9.3f} {r['b'] * 1e3:>10.3f} {r['c'] * 1e3:>12.3f} "
            f"{ba * 1e3:>7.3f} {ca * 1e3:>7.3f} {ratio:>12.3f} "
            f"{r['first'] * 1e3:>7.1f} {r['last'] * 1e3:>7.1f} "
            f"{r['d'] * 1e3:>11.3f} {(r['d'] - r['b']) * 1e3:>7.3f}"
        )
    for step_s in (0.01, 0.3):
        lat = capture_latency(max(args.ranks), 10, step_s)
        print(
            f"request_capture answered in {lat['median'] * 1e3:.0f} ms median, "
            f"{lat['max'] * 1e3:.0f} ms max ({max(args.ranks)} ranks, steps of "
            f"{step_s * 1e3:.0f} ms + the ranks' work, StepClient reporting every 0.1 s)"
        )
    ray.shutdown()
    agg = bench_aggregation(args.agg_ranks, args.agg_kernels, 20)
    print(
        f"aggregation {args.agg_ranks} ranks x {args.agg_kernels} kernels: "
        f"ingest {agg['ingest_ms_per_rank']:.2f} ms/rank "
        f"({agg['payload_kb_per_rank']:.0f} KB msgpack each), "
        f"top-20 query {agg['query_ms']:.2f} ms, retained {agg['retained_mb']:.2f} MB "
        f"(peak {agg['peak_mb']:.1f} MB while ingesting); its store's cost: "
        f"bench/state_store_cost.py"
    )


if __name__ == "__main__":
    main()
