"""A Ray Train job on gloo, profiled through the setup hook only (issue 56's collectives):
``python -m tests.scripts.collectives_train OUT``.

4 CPU workers in the default group and two groups of 2 (``dist.new_group([0, 1])``,
``dist.new_group([2, 3])``); each step an all_reduce on the default group, one on the rank's
pair, then an optimizer step of a tiny model, which ends the attached rank's step (so step
``k``'s collectives are in the trace's step ``k``). Rank 1 sleeps ``DELAY_S`` before the
default group's all_reduce of steps ``RANK1_LATE``, rank 3 before its pair's all_reduce of
steps ``RANK3_LATE``. On a local Ray cluster of its own, shut down at the end. Once the job is
done it waits for the window's traces and writes ``{OUT}/report.json``: the coordinator's
``status()``, ``collectives()`` and ``kernel_summary()``'s stragglers.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = "collectives-train"
DELAY_S = 0.1
STEPS = 14
# The window records optimizer steps 5-11. A rank held back before its pair's all_reduce holds
# its pair back at the next step's default all_reduce too: the chosen steps leave room for it.
SCHEDULE = "skip_first: 4, warmup: 1, active: 7, repeat: 1"
RANK1_LATE = (6, 9)  # steps: rank 1 sleeps before the default group's all_reduce
RANK3_LATE = (7, 11)  # steps: rank 3 sleeps before its pair's all_reduce


def train_pairs(cfg: dict[str, Any]) -> None:
    """The job's ``train_loop_per_worker``: imports nothing of the project."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t, x = torch.ones(4096), torch.randn(16, 8)
    for step in range(1, cfg["steps"] + 1):
        if rank == 1 and step in cfg["rank1_late"]:
            time.sleep(cfg["delay_s"])
        dist.all_reduce(t)
        if rank == 3 and step in cfg["rank3_late"]:
            time.sleep(cfg["delay_s"])
        dist.all_reduce(t, group=pair)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    dist.barrier()


def read_run() -> dict[str, Any]:
    """Every window's traces, then the coordinator's answers about the last one."""
    import ray

    coord = ray.get_actor(NAME, namespace="profiler")
    st = ray.get(coord.status.remote())
    for w in st["windows"]:
        ray.get(coord.wait_window.remote(w["index"], until="traces", timeout_s=60))
    report = {
        "status": ray.get(coord.status.remote()),
        "collectives": ray.get(coord.collectives.remote()),
        "stragglers": ray.get(coord.kernel_summary.remote(top_k=0))["stragglers"],
    }
    ray.kill(coord)
    return report


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    config = (
        f"{{enable: true, save_path: {out}/p, {SCHEDULE}, ranks: all, activities: [cpu], "
        f"record_shapes: true, attach: {{name: {NAME}}}}}"
    )
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    env = {"PYTHONPATH": ROOT, "RAY_AUTH_MODE": "disabled", "RAY_PROFILER_CONFIG": config}
    hook = {"env_vars": env, "worker_process_setup_hook": "worker_ext.attach.setup"}
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env=hook)  # fmt: skip
    try:
        loop = {"steps": STEPS, "delay_s": DELAY_S, "rank1_late": RANK1_LATE,
                "rank3_late": RANK3_LATE}  # fmt: skip
        TorchTrainer(
            train_pairs,
            train_loop_config=loop,
            scaling_config=ScalingConfig(num_workers=4, use_gpu=False),
            run_config=RunConfig(storage_path=os.path.join(out, "train"), name="pairs"),
        ).fit()
        report = read_run()
    finally:
        ray.shutdown()
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, default=str)
    print("JOB-DONE", flush=True)


if __name__ == "__main__":
    main()
