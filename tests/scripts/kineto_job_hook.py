"""A Ray job with a ``worker_process_setup_hook`` of its own, and a rank actor started with
``runtime_env={"env_vars": kineto_env(<dir>)}``: the variables must not replace the job's hook
in the actor (Ray reads the hook from that variable). The job's hook (``job_hook`` below) calls
``kineto_setup()``, as the warning ``kineto_env()`` gives asks. Prints one JSON line: the
variables ``kineto_env()`` gave and what the actor saw.

Run as a subprocess by tests/test_kineto_ray.py (a job's ``runtime_env`` needs its own driver).
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def job_hook() -> None:
    """The job's own setup hook: says it ran, and prepares kineto's directory."""
    from worker_ext.attach import kineto_setup

    os.environ["JOB_HOOK_RAN"] = "1"
    kineto_setup()


def main(directory: str) -> None:
    import ray

    from worker_ext import kineto_env

    ray.init(
        address="local",
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "worker_process_setup_hook": "tests.scripts.kineto_job_hook.job_hook",
            "env_vars": {"PYTHONPATH": ROOT, "RAY_AUTH_MODE": "disabled"},
        },
    )
    try:
        env = kineto_env(os.path.join(directory, "k"))
        os.rmdir(os.path.join(directory, "k", "requests"))  # (the actor's hook makes it again)

        class Rank:
            def seen(self) -> dict[str, str | None]:
                keys = ("JOB_HOOK_RAN", "KINETO_USE_DAEMON", "KINETO_IPC_SOCKET_DIR")
                return {k: os.environ.get(k) for k in keys}

        rank = ray.remote(num_cpus=0, runtime_env={"env_vars": env})(Rank).remote()
        seen = ray.get(rank.seen.remote(), timeout=300)
        made = os.path.isdir(os.path.join(directory, "k", "requests"))
        print("RESULT " + json.dumps({"env": sorted(env), "actor": seen, "made": made}), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
