"""A long-running trainer with on-demand profiling only; stops when a stop file appears.

Usage: python -m tests.scripts.capture_trainer SAVE_PATH STOP_FILE
"""

import json
import os
import sys
import time

import ray

from tests.configs import join_cluster, profiler_config
from tests.ray_workers import ToyWorker
from trainers.hooks import ProfilingHooks


def main(save_path: str, stop_file: str) -> None:
    join_cluster()  # RAY_ADDRESS, namespace "profiler"
    cfg = profiler_config(save_path, on_demand_only=True)
    workers = [ray.remote(num_cpus=0)(ToyWorker).remote() for _ in range(2)]
    hooks = ProfilingHooks.attach(cfg, workers, trainer_id="sft")
    step = 0
    with hooks.session(first_step=0):
        deadline = time.monotonic() + 240
        while not os.path.exists(stop_file) and time.monotonic() < deadline:
            ray.get([w.train_step.remote() for w in workers])
            hooks.step(step)
            step += 1
            time.sleep(0.02)
    print("RESULT " + json.dumps({"steps": step, "enabled": hooks.enabled}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
