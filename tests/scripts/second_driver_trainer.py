"""A trainer driver: joins the cluster at RAY_ADDRESS, profiles one window, exits."""

import sys

import ray

from coordinator import get_or_create_coordinator
from tests.configs import join_cluster, profiler_config
from tests.ray_workers import ToyWorker


def main(save_path: str) -> None:
    join_cluster()  # RAY_ADDRESS, namespace "profiler"
    cfg = profiler_config(
        save_path, export_type="chrome_trace_gz", wait=0, warmup=1, active=2, repeat=1
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
