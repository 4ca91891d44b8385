"""What the rank profiler costs a step outside and inside a window, against no profiler.

The cost of closing a window (the closing step plus every step slowed until its summary is in)
is measured by bench/summary_cost.py.

Run: .venv/bin/python bench/rank_profiler_overhead.py  (or `make bench`)
"""

from __future__ import annotations

import argparse
import gzip
import os
import statistics
import tempfile
import time

import torch

from coordinator.core.config import ProfilerConfig
from coordinator.core.schedule import Window
from worker_ext.rank.rank_profiler import RankProfiler


def make_step(width: int, depth: int, batch: int):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width)

    def step() -> None:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--active", type=int, default=10)
    ap.add_argument("--baseline-steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    step = make_step(width=512, depth=4, batch=64)
    for _ in range(20):
        step()
    tmp = tempfile.mkdtemp(prefix="bench-rank-profiler-")
    cfg = ProfilerConfig(
        enable=True,
        save_path=tmp,
        ranks="all",
        activities=["cpu"],
        export_type="chrome_trace",
        top_k=50,
    ).validate()
    rp = RankProfiler(0, cfg, os.path.join(tmp, "run"))

    base, idle, warm, rec = [], [], [], []
    summaries: list[bytes] = []
    k = 0
    w, a = args.warmup, args.active
    for i in range(args.windows):
        base += [timed(step) for _ in range(args.baseline_steps)]
        # Idle: the rank holds a configured profiler but no window is open.
        for _ in range(args.baseline_steps):
            idle.append(timed(lambda k=k: (step(), rp.step(k))))
            k += 1
        window = Window(i, k, k + w, k + w + a - 1)
        summaries += rp.start_window(window, k)["summaries"]
        for j in range(w + a):
            t0 = time.perf_counter()
            step()
            summaries.extend(rp.step(k)["summaries"])
            t = time.perf_counter() - t0
            if j < w + a - 1:  # the closing step is bench/summary_cost.py's
                (warm if j < w else rec).append(t)
            k += 1
        summaries += rp.wait_for_summaries(60)["summaries"]

    med = statistics.median
    b = med(base)
    trace = rp.status()["last_trace_path"]
    trace_bytes = os.path.getsize(trace)
    with open(trace, "rb") as f:
        gz_bytes = len(gzip.compress(f.read(), 6))
    summary_bytes = med(len(s) for s in summaries)
    print(f"4x512 MLP, batch 64, 1 thread; {args.windows} windows of warmup={w} active={a}")
    print(f"{'phase':<40}{'median ms':>10}{'x baseline':>12}")
    rows = [
        ("no profiler (baseline)", b),
        ("rank profiler idle (no window)", med(idle)),
        ("warmup step", med(warm)),
        ("recording step", med(rec)),
    ]
    for name, v in rows:
        print(f"{name:<40}{v * 1e3:>10.2f}{v / b:>12.2f}")
    print("closing a window: see bench/summary_cost.py (the closing step and the steps after it)")
    print(
        f"summary {summary_bytes} B vs trace {trace_bytes} B (gzip {gz_bytes} B): "
        f"{trace_bytes / summary_bytes:.0f}x / {gz_bytes / summary_bytes:.1f}x smaller"
    )
    print(
        f"summaries received: {len(summaries)} of {args.windows}; "
        f"rank state: {rp.status()['state']}"
    )


if __name__ == "__main__":
    main()
