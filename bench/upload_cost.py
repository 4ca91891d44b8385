"""What an upload costs training: step time while a 50 MB window's trace goes to S3.

One rank (a Ray actor running the dispatch-bound loop of summary_cost.py) profiles windows of
about 50 MB of chrome trace, alternately with ``save_path: s3://...`` (moto's S3 server on
127.0.0.1) and with a local ``save_path``, in the same run. After each window closes and its
summary is in, the trainer keeps stepping; the steps are timed inside the rank:
  - upload: steps run until the node agent reports the trace uploaded;
  - no upload: as many steps at the same point of a local-path window (the baseline).
The S3 server stands in for a remote service: it runs at the lowest CPU priority, so the CPU it
spends receiving the file (which a real S3 spends elsewhere) does not count.

Run: RAY_AUTH_MODE=disabled .venv/bin/python bench/upload_cost.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid

import ray

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.summary_cost import BenchWorker  # noqa: E402
from coordinator import ProfilerConfig, get_or_create_coordinator  # noqa: E402
from tests.s3_server import s3_server  # noqa: E402

ACTIVE = 55  # about 50 MB of chrome trace with record_shapes


def one_window(w: object, cfg: ProfilerConfig, steps: int | None = None) -> dict:
    """Profile one window of ``cfg`` on rank ``w``; time the steps after its summary is in.

    With a URL save_path: the steps until the trace is uploaded; else ``steps`` steps.
    """
    cfg.run_name = f"upload-{uuid.uuid4().hex[:6]}"
    coord = get_or_create_coordinator(cfg, name=f"bench-upload-{uuid.uuid4().hex[:6]}")
    ray.get(coord.register.remote("bench", [w]))
    ray.get(coord.start.remote("bench", 0))
    k = 0

    def step() -> float:
        nonlocal k
        dt: float = ray.get(w.timed_step.remote())
        ray.get(coord.step.remote("bench", k))
        k += 1
        return dt

    def window() -> dict:
        st = ray.get(coord.status.remote())
        return next((x for x in st["windows"] if x["index"] == 0), {})

    while not window():  # wait, warm-up and recording, up to the closing step
        step()
    while not ray.get(coord.kernel_summary.remote(window=0))["ranks"]:
        step()  # the summary is being built: summary_cost.py measures this part
    t0, timed = time.perf_counter(), []
    if steps is None:
        timed.append(step())  # at least one, even when the upload was done already
        while window()["traces_pending"]:
            timed.append(step())
    else:
        timed = [step() for _ in range(max(1, steps))]
    seconds = time.perf_counter() - t0
    entry = window()
    ray.get(coord.stop.remote("bench"))
    ray.kill(coord)
    path = entry["traces"][0]["path"]
    size = os.path.getsize(path) if not path.startswith("s3://") else None
    if size is None:
        import s3fs

        from tests.s3_server import KEY, SECRET  # the bench server's credentials

        opts = cfg.storage_options
        fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, client_kwargs=opts["client_kwargs"])
        size = fs.size(path.removeprefix("s3://"))
    return {
        "median": statistics.median(timed),
        "steps": len(timed),
        "seconds": seconds,
        "mb": size / 2**20,
        "errors": entry["trace_errors"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": root}},
    )
    with s3_server() as s3:
        os.setpriority(os.PRIO_PGRP, os.getpgid(s3.proc.pid), 19)  # a remote service stand-in
        s3.make_bucket("bench")
        common = dict(
            enable=True,
            ranks="all",
            activities=["cpu"],
            record_shapes=True,
            wait=20,
            warmup=1,
            active=ACTIVE,
            repeat=0,
            export_type="chrome_trace",
        )
        remote = ProfilerConfig(
            save_path="s3://bench/runs",
            storage_options=s3.storage_options(),
            staging_path=tempfile.mkdtemp(prefix="bench-staging-"),
            **common,
        )
        local = ProfilerConfig(save_path=tempfile.mkdtemp(prefix="bench-local-"), **common)
        w = ray.remote(num_cpus=0)(BenchWorker).remote()
        rows = []
        for index in range(args.rounds):
            up = one_window(w, remote)
            base = one_window(w, local, steps=up["steps"])
            rows.append({**up, "base": base["median"]})
            r = rows[-1]
            print(
                f"round {index}: {r['mb']:.1f} MB uploaded in {r['seconds']:.2f} s, "
                f"{r['steps']} steps meanwhile, median {r['median'] * 1e3:.2f} ms vs "
                f"{r['base'] * 1e3:.2f} ms at the same point of a local window "
                f"({r['median'] / r['base']:.3f}x); errors {r['errors'] or 'none'}",
                flush=True,
            )
        ray.kill(w)
    ratio = statistics.median(r["median"] / r["base"] for r in rows)
    print()
    print("| what | median | target |")
    print("|---|---|---|")
    print(f"| trace uploaded per window | {statistics.median(r['mb'] for r in rows):.1f} MB | |")
    print(f"| upload time | {statistics.median(r['seconds'] for r in rows):.2f} s | |")
    base = statistics.median(r["base"] for r in rows) * 1e3
    what = "step at the same point of a window with a local save_path (no upload)"
    print(f"| {what} | {base:.2f} ms | |")
    print(
        f"| step while the trace uploads | "
        f"{statistics.median(r['median'] for r in rows) * 1e3:.2f} ms; {ratio:.3f}x "
        f"(median of the rounds' ratios) | <= 1.05x |"
    )
    ray.shutdown()


if __name__ == "__main__":
    main()
