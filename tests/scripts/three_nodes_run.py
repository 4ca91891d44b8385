"""Three raylets on one machine: window commands through the node agents, node partials, a
node removed mid-window, stacks read on every node (and the removed node's said), and agents
that exit once idle with no live run.

Ranks 0-1 on node 1 (the head), 2-3 on node 2, 4-5 on node 3. Windows: warm-up 0, record 1-2 |
warm-up 3, record 4-5 | warm-up 6, record 7-8, with node 3 removed after step 7.

Run as a subprocess by tests/test_cluster.py (a Ray driver owns its process); prints JSON.
"""

import json
import sys
import tempfile
import time

import ray
from ray.cluster_utils import Cluster

from coordinator import get_or_create_coordinator
from coordinator.protocol.names import AGENT_NAMESPACE
from tests.configs import join_cluster, profiler_config
from tests.fault_cases import wait_for_windows
from tests.ray_workers import ToyWorker


def agents() -> list[str]:
    found = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"] for a in found if a["namespace"] == AGENT_NAMESPACE)


def main() -> None:
    save = tempfile.mkdtemp(prefix="three-nodes-")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 4,
            "resources": {"n1": 8},
            "include_dashboard": False,
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3},
        },
    )
    try:
        join_cluster(cluster.address, namespace="profiler-three")
        cfg = profiler_config(
            save, wait=0, warmup=1, active=2, repeat=3, worker_timeout_s=30.0, agent_idle_exit_s=2.0
        )
        coord = get_or_create_coordinator(cfg)  # on the head, before the other nodes exist
        node3 = None
        for n in ("n2", "n3"):
            node3 = cluster.add_node(num_cpus=4, resources={n: 8})
        cluster.wait_for_nodes()
        Worker = ray.remote(num_cpus=0)(ToyWorker)
        workers = [
            Worker.options(resources={n: 1}).remote() for n in ("n1", "n1", "n2", "n2", "n3", "n3")
        ]
        nodes = ray.get([w.node_id.remote() for w in workers])
        ray.get(coord.register.remote("t", workers))
        ray.get(coord.start.remote("t", 0))
        live = list(workers)
        tables = {}
        for k in range(9):
            ray.get([w.train_step.remote() for w in live])
            ray.get(coord.step.remote("t", k))
            if k == 5:  # two whole windows through the agents: their tables, complete
                st = wait_for_windows(ray, coord, timeout=120)
                for w in st["windows"]:
                    ks = ray.get(coord.kernel_summary.remote(window=w["index"], top_k=5))
                    tables[w["index"]] = ks["ranks"]
                paths = st["nodes"]
                counters = dict(st["counters"])
                stacks = ray.get(coord.stacks.remote())
            if k == 7:
                cluster.remove_node(node3)
                live = workers[:4]
                gone = ray.get(coord.stacks.remote())
        ray.get(coord.stop.remote("t"))
        st = wait_for_windows(ray, coord, timeout=120)
        last = st["windows"][-1]
        last_table = ray.get(coord.kernel_summary.remote(window=last["index"], top_k=5))
        before_exit = agents()
        deadline = time.monotonic() + 60
        while agents() and time.monotonic() < deadline:  # the run stopped: idle agents leave
            time.sleep(0.5)
        out = {
            "distinct_nodes": len(set(nodes)),
            "paths": paths,
            "counters": counters,
            "tables": tables,
            "ranks": {r["rank"]: r["state"] for r in st["ranks"]},
            "lost_reasons": [r["reason"]["type"] for r in st["ranks"] if r["state"] == "lost"],
            "last": {
                "steps": last["steps"],
                "ranks": last["ranks"],
                "table": last_table["ranks"],
                "pending": last_table["summaries_pending"],
            },
            "nodes_after": st["nodes"],
            "agents_before_exit": len(before_exit),
            "agents_after": agents(),
            "torch_loaded": st["process"]["torch_loaded"],
            "stacks": {
                "nodes": len({e["node_id"] for e in stacks["entries"]}),
                "methods": sorted({str(e["method"]) for e in stacks["entries"]}),
                "groups": [(g["ranks"], g["kind"]) for g in stacks["groups"]],
                "lines": stacks["lines"],
            },
            "stacks_after_removal": {
                e["rank"]: e["error"] for e in gone["entries"] if e["error"] is not None
            },
        }
        ray.kill(coord)
        print("RESULT " + json.dumps(out))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
