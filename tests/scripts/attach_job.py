"""A user's driver: ``python -m tests.scripts.attach_job JOB OUT [--hook]``. It imports nothing of
this project; with ``--hook`` the job's ``runtime_env`` names the setup hook and the config
(``RAY_PROFILER_CONFIG`` from this process's environment), and nothing else changes.

JOB: ``hf``, ``lightning``, ``trl`` or ``resume`` (Ray Train, 2 workers; ``resume`` loses rank 1
once after optimizer step ``FAIL_AT`` and resumes from its checkpoint) or ``single`` (two actors
called by this driver: ``trainers.reference.unchanged``, which imports nothing of the project
either; ``GLOBAL_STEPS``, ``SLOW_FROM`` and ``SLOW_S`` in the environment make it longer, and
slower from an optimizer step on). ``PACE_S``: seconds each step sleeps.
Joins the cluster at ``RAY_ADDRESS``. Prints ``JOB-DONE`` at the end.
"""

from __future__ import annotations

import json
import os
import sys

import ray

from tests.scripts.unchanged_jobs import TRAIN
from trainers.reference.unchanged import single_controller


def main() -> None:
    job, out, hook = sys.argv[1], sys.argv[2], "--hook" in sys.argv[3:]
    pace_s = float(os.environ.get("PACE_S", "0.05"))
    os.makedirs(out, exist_ok=True)
    env = {"PYTHONPATH": os.environ["PYTHONPATH"], "RAY_AUTH_MODE": "disabled"}
    runtime_env: dict = {"env_vars": env}
    if hook:
        runtime_env["worker_process_setup_hook"] = "worker_ext.attach.setup"
        env["RAY_PROFILER_CONFIG"] = os.environ["RAY_PROFILER_CONFIG"]
    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), runtime_env=runtime_env,
             log_to_driver=False)  # fmt: skip
    if job == "single":  # (two actors, 20 global steps of 2 optimizer steps each, by default)
        steps, slow = int(os.environ.get("GLOBAL_STEPS", "20")), os.environ.get("SLOW_FROM")
        losses = single_controller(steps, pace_s=pace_s, slow_from=int(slow) if slow else None,
                                   slow_s=float(os.environ.get("SLOW_S", "0")))  # fmt: skip
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump(losses, f)
    else:
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        loop = {"out": out, "pace_s": pace_s}
        if job == "resume":  # (rank 1 dies once after this step; Ray Train restarts the group)
            loop |= {"fail_at": int(os.environ.get("FAIL_AT", "17")),
                     "marker": os.path.join(out, "failed-once")}  # fmt: skip
        failures = FailureConfig(max_failures=int(job == "resume"))
        TorchTrainer(
            TRAIN[job],
            train_loop_config=loop,
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            run_config=RunConfig(
                storage_path=os.path.join(out, "train"), name=f"{job}-job", failure_config=failures
            ),
        ).fit()
    print("JOB-DONE", flush=True)


if __name__ == "__main__":
    main()
