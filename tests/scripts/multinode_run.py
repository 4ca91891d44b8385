"""Two raylets on one machine: workers on both write traces; removing node 2 loses its ranks.

Run as a subprocess by tests/test_cluster.py (a Ray driver owns its process); prints JSON.
"""

import json
import os
import sys
import tempfile

import ray
from ray.cluster_utils import Cluster

from coordinator import get_or_create_coordinator
from tests.configs import join_cluster, profiler_config
from tests.ray_workers import ToyWorker


def main() -> None:
    save = tempfile.mkdtemp(prefix="multinode-")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 4, "resources": {"head": 8}, "include_dashboard": False},
    )
    try:
        join_cluster(cluster.address, namespace="profiler-multinode")
        cfg = profiler_config(save, wait=0, warmup=1, active=2, repeat=0, worker_timeout_s=60.0)
        coord = get_or_create_coordinator(cfg)  # created before node 2 exists: it stays on the head
        node2 = cluster.add_node(num_cpus=4, resources={"node2": 8})
        cluster.wait_for_nodes()
        Worker = ray.remote(num_cpus=0)(ToyWorker)
        workers = [Worker.options(resources={"head": 1}).remote() for _ in range(2)]
        workers += [Worker.options(resources={"node2": 1}).remote() for _ in range(2)]
        nodes = ray.get([w.node_id.remote() for w in workers])
        ray.get(coord.register.remote("t", workers))
        ray.get(coord.start.remote("t", 0))
        live = list(workers)
        for k in range(7):  # windows: warmup 0, record 1-2 | warmup 3, record 4-5 | ...
            if k == 4:
                cluster.remove_node(node2)
                live = workers[:2]
            ray.get([w.train_step.remote() for w in live])
            ray.get(coord.step.remote("t", k))
        ray.get(coord.stop.remote("t"))
        st = ray.get(coord.status.remote())
        out = {
            "distinct_nodes": len(set(nodes)),
            "ranks": {r["rank"]: r["state"] for r in st["ranks"]},
            "windows": [(w["steps"], w["ranks"]) for w in st["windows"]],
            "files": {
                d: sorted(os.listdir(os.path.join(save, "run", d)))
                for d in sorted(os.listdir(os.path.join(save, "run")))
            },
            "torch_loaded": st["process"]["torch_loaded"],
        }
        ray.kill(coord)
        print("RESULT " + json.dumps(out))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
