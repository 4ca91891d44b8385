"""Check ``engine: kineto`` on a GPU machine, in one command (this CPU machine cannot).

    .venv/bin/python bench/kineto_check_gpu.py [--steps 40]

Starts one training process with ``worker_ext.kineto_env()`` (libkineto's daemon mode, before
torch is imported) and a kineto rank profiler whose local agent plays the daemon; a small CUDA
model trains; one window (steps 20-24, started at step 10) is recorded by libkineto. Checks:
the config asks for CUDA activities, the trace holds CUDA kernels and runtime calls, the
summary is a ``cuda`` one with the planned steps and per-kernel rows, and the closing step cost
about what a step inside the window cost. Prints each check and exits 1 if one fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import glob, json, os, sys, time
import torch
from coordinator.core.config import ProfilerConfig
from coordinator.core.schedule import Window
from coordinator.protocol.summary_codec import decode_summary
from worker_ext.rank.kineto_rank import profiler_class

run_dir, steps = sys.argv[1], int(sys.argv[2])
cfg = ProfilerConfig.from_dict({"enable": True, "ranks": "all", "engine": "kineto",
    "export_type": "chrome_trace", "save_path": os.path.dirname(run_dir)})
rp = profiler_class(cfg)(0, cfg, run_dir)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(256, 1024, device="cuda")
window, times, summaries = Window(0, 10, 20, 24), [], []
for k in range(steps):
    t = time.perf_counter()
    if k == window.warmup_start:
        rp.start_window(window, k)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    torch.cuda.synchronize()
    summaries += rp.step(k)["summaries"]
    times.append(time.perf_counter() - t)
    time.sleep(0.2)  # two of libkineto's polls within the warm-up
st = rp.wait_for_summaries(120)
summaries += st["summaries"]
s = decode_summary(summaries[0]) if summaries else None
trace = glob.glob(os.path.join(run_dir, "window_*", "policy", "rank0.pt.trace.json"))
cats = {}
if trace:
    for e in json.load(open(trace[0]))["traceEvents"]:
        cats[e.get("cat")] = cats.get(e.get("cat"), 0) + 1
print("RESULT " + json.dumps({
    "device": rp.device, "state": st["state"], "reason": st["reason"],
    "errors": [st["last_agent_error"], st["last_skip_reason"]],
    "summary": None if s is None else {"device": s.device, "steps": list(s.steps),
        "partial": s.partial, "kernels": len(s.kernels), "step_device": len(s.step_device)},
    "cats": cats, "inside": sorted(times[20:24])[1], "closing": times[24],
}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    from worker_ext import kineto_env

    tmp = tempfile.mkdtemp(prefix="kineto-gpu-")
    kdir = tempfile.mkdtemp(prefix="kg-", dir="/tmp")
    env = {**os.environ, **kineto_env(os.path.join(kdir, "k")), "PYTHONPATH": ROOT}
    got = subprocess.run(
        [sys.executable, "-c", CHILD, os.path.join(tmp, "run"), str(args.steps)],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    lines = [x for x in got.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        print(got.stdout[-3000:], got.stderr[-5000:])
        return 1
    r = json.loads(lines[-1][len("RESULT ") :])
    s = r["summary"] or {}
    checks = [
        ("the rank has a GPU", r["device"] == "cuda", r["device"]),
        ("profiling stayed on", r["state"] == "ok", r["reason"]),
        ("libkineto wrote the window's trace", bool(r["cats"]), r["errors"]),
        ("the trace holds CUDA kernels", r["cats"].get("kernel", 0) > 0, r["cats"]),
        ("and CUDA runtime calls", r["cats"].get("cuda_runtime", 0) > 0, r["cats"]),
        ("a cuda summary", s.get("device") == "cuda", s),
        ("on the planned steps, whole", s.get("steps") == [20, 24] and not s.get("partial"), s),
        (
            "with kernel rows and per-step device times",
            s.get("kernels", 0) > 0 and s.get("step_device", 0) > 0,
            s,
        ),  # fmt: skip
        (
            "the closing step about a step inside the window (<= 1.5x)",
            r["closing"] <= 1.5 * r["inside"],
            f"closing {r['closing'] * 1e3:.1f} ms, inside {r['inside'] * 1e3:.1f} ms",
        ),
    ]
    failed = 0
    for what, ok, detail in checks:
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {what}: {detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
