"""The fault matrix's node case: a node holding one rank (or both) is removed mid-window.

cluster_utils starts a head and, for each scope, a doomed node; the SFT ranks on it go with it
at step 6 (inside window 1, which records steps 6-7) while the rest train on. Prints JSON.
"""

import json
import os
import sys
import tempfile
import uuid

import ray
from ray.cluster_utils import Cluster

from coordinator import attach_coordinator
from tests import fault_cases as fc
from tests.configs import join_cluster, profiler_config
from trainers.hooks import ProfilingHooks
from trainers.reference.workers import PolicyWorker


def main() -> None:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 4,
            "resources": {"head": 8},
            "include_dashboard": False,
            # notice a removed node within a second or two, not half a minute
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3},
        },
    )
    out = {}
    try:
        join_cluster(cluster.address, namespace="fm-node")
        for scope, doomed in (("one rank", [1]), ("all ranks", [0, 1])):
            save = tempfile.mkdtemp(prefix="node-fault-")
            cfg = profiler_config(save, **fc.SCHEDULE, worker_timeout_s=20.0)
            name = f"fm-node-{uuid.uuid4().hex[:6]}"
            coord, _ = attach_coordinator(cfg, name=name)  # before the doomed node: on the head
            node = cluster.add_node(num_cpus=2, resources={"doomed": 4})
            cluster.wait_for_nodes()
            cls = ray.remote(num_cpus=0)(PolicyWorker)
            workers = [
                cls.options(resources={"doomed" if r in doomed else "head": 1}).remote(
                    r, 1, fc.SEED
                )
                for r in range(2)
            ]
            ray.get([w.reset.remote(fc.SEED) for w in workers])
            before = fc.alive_actors(ray, starting_too=True)
            hooks = ProfilingHooks.attach(cfg, workers, trainer_id="sft", name=name)
            res = fc.train(ray, workers, hooks, {6: lambda node=node: cluster.remove_node(node)})
            st = fc.wait_for_windows(ray, coord)
            healthy = [r for r in range(2) if r not in doomed]
            problems = []
            for w in st["windows"]:
                if w["steps"]:
                    problems += fc.traces_parse(w, [r for r in healthy if r in w["ranks"]])
            leftover = fc.alive_actors(ray) - before - {coord._actor_id.hex()}
            out[scope] = {
                "steps_run": res.steps_run,
                "losses": {str(r): v for r, v in res.losses.items()},
                "ranks": {str(r["rank"]): r for r in st["ranks"]},
                "trace_problems": problems,
                "profiler_running": {str(r): v for r, v in res.profiler_running.items()},
                "leftover": sorted(leftover),
            }
            for h in (coord, *workers):
                ray.kill(h)
        print("RESULT " + json.dumps(out))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    sys.exit(main())
