"""A trainer driver for the GCS-loss test: profiles a window every 5 steps from ``first_step``
with the hooks, phase times by region, ``save_path`` on local disk.

    python -m tests.scripts.gcs_loss_trainer SAVE_PATH FIRST_STEP LAST_STEP

``LAST_STEP`` -1: steps until its cluster is killed under it. Else it stops after
``LAST_STEP``, waits for its windows and the record, and prints ``RESULT {json}``.
"""

import json
import sys
import time

import ray

from tests.configs import join_cluster
from tests.ray_workers import ToyWorker
from trainers.hooks import ProfilingHooks


def main(save_path: str, first_step: int, last_step: int) -> None:
    join_cluster()  # RAY_ADDRESS, namespace "profiler"
    cfg = {"enable": True, "save_path": save_path, "run_name": "long", "ranks": "all",
           "wait": 2, "warmup": 1, "active": 2, "repeat": 0, "export_type": "none",
           "activities": ["cpu"]}  # fmt: skip
    workers = [ray.remote(num_cpus=0)(ToyWorker).remote() for _ in range(2)]
    hooks = ProfilingHooks.attach(cfg, workers, trainer_id="sft")
    k = first_step
    with hooks.session(first_step=first_step):
        while last_step < 0 or k <= last_step:
            with hooks.region("train"):
                ray.get([w.train_step.remote() for w in workers])
            time.sleep(0.02)
            hooks.step(k)
            print(f"AT {k}", flush=True)
            k += 1
    coord = hooks.coordinator
    st = ray.get(coord.status.remote())
    for w in st["windows"]:
        ray.get(coord.wait_window.remote(w["index"], timeout_s=60))
    record = ray.get(coord.flush_record.remote(60.0))
    out = {
        "status": ray.get(coord.status.remote()),
        "record": record,
        "phases": ray.get(coord.phase_times.remote(last=10_000)),
    }
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
