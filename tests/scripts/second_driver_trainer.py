"""A trainer driver: joins the cluster at RAY_ADDRESS, profiles one window, exits."""

import os
import sys

import ray

from coordinator import ProfilerConfig, get_or_create_coordinator
from tests.ray_workers import ToyWorker


def main(save_path: str) -> None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ray.init(
        address="auto",
        namespace="profiler",
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": root}},
    )
    cfg = ProfilerConfig(
        enable=True,
        save_path=save_path,
        run_name="run",
        ranks="all",
        activities=["cpu"],
        wait=0,
        warmup=1,
        active=2,
        repeat=1,
    )
    coord = get_or_create_coordinator(cfg)  # name "profiler", namespace "profiler"
    workers = [ray.remote(num_cpus=0)(ToyWorker).remote() for _ in range(2)]
    ray.get(coord.register.remote("sft", workers))
    ray.get(coord.start.remote("sft", 0))
    for k in range(4):
        ray.get([w.train_step.remote() for w in workers])
        ray.get(coord.step.remote("sft", k))
    ray.get(coord.stop.remote("sft"))
    print("TRAINER-DONE")


if __name__ == "__main__":
    main(sys.argv[1])
