"""An auto capture on a real run, for the docs: a trainer on 2 Ray ranks whose steps slow down
at step 300 because its batches grow 4x (as a data shard with longer sequences would); the
coordinator notices from the step reports alone and profiles the slow steps by themselves.

Prints the status of the run's windows (a scheduled one at steps 101-102, the auto one), why
the auto capture was taken, and the top kernels of both windows side by side.

    RAY_AUTH_MODE=disabled .venv/bin/python bench/auto_capture_run.py
"""

from __future__ import annotations

import argparse
import os
import tempfile

import ray
import torch

from coordinator.ops.tables import trigger_text
from trainers import ProfilingHooks
from worker_ext import ProfilerWorkerMixin


class Rank(ProfilerWorkerMixin):
    """A small MLP rank; ``grow`` multiplies its batch (the step slows down by as much)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def train_step(self, batch: int) -> float:
        x = torch.randn(batch, 256)
        loss = self.model(x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return float(loss)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--slow-from", type=int, default=300)
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    save = tempfile.mkdtemp(prefix="auto-capture-")
    config = {
        "enable": True,
        "save_path": save,
        "run_name": "run",
        "ranks": "all",
        "activities": ["cpu"],
        "skip_first": 100,
        "warmup": 1,
        "active": 2,
        "repeat": 1,
        "auto_capture": {"enable": True, "active": 2, "warmup": 1},
    }
    ranks = [ray.remote(num_cpus=0)(Rank).remote() for _ in range(2)]
    hooks = ProfilingHooks.attach(config, workers=ranks, trainer_id="sft")
    with hooks.session(first_step=0):
        for k in range(args.steps):
            batch = 256 * (4 if k >= args.slow_from else 1)
            ray.get([r.train_step.remote(batch) for r in ranks])
            hooks.step(k)
    coord = hooks.coordinator
    st = ray.get(coord.status.remote())
    windows = {w["kind"]: w for w in st["windows"] if w["steps"]}
    print(f"trace dir: {save}/run")
    for w in st["windows"]:
        print(f"window {w['index']} {w['kind']}: steps {w['steps']}, ranks {w['ranks']}")
        print(f"  {w['trace_dir']}")
        if w["trigger"]:
            print(f"  why: {trigger_text(w['trigger'])}")
    tables = {
        kind: ray.get(coord.kernel_summary.remote(window=w["index"], top_k=6))
        for kind, w in windows.items()
    }
    print()
    print(
        f"{'scheduled window (steps ' + str(windows['scheduled']['steps']) + ')':<46} "
        f"{'auto window (steps ' + str(windows['auto']['steps']) + ')':<46}"
    )
    rows = zip(tables["scheduled"]["kernels"], tables["auto"]["kernels"], strict=False)
    for a, b in rows:
        print(
            f"{a['name'][:28]:<28} {a['mean_us']:>9.0f} us   {b['name'][:28]:<28} "
            f"{b['mean_us']:>9.0f} us"
        )
    ray.kill(coord)
    ray.shutdown()


if __name__ == "__main__":
    main()
