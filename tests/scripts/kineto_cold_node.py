"""``engine: kineto`` on a node where nothing of the profiler's exists yet, with the documented
``runtime_env={"env_vars": kineto_env()}``.

A private ``<tmp>`` (``TMPDIR``) for this driver and the two raylets it starts, short enough for
libkineto's socket paths. ``kineto_env()`` prepares the daemon directory on the driver's node;
the driver's node is not the ranks' in a real cluster, so that directory is removed again before
any rank starts: the ranks, both on the second node, find no directory and no ``client.conf``
when they import torch, as on a fresh node. Prints one JSON line: each window's cross-rank table.

Run as a subprocess by tests/test_kineto_ray.py (a Ray driver owns its process).
"""

import json
import os
import shutil
import tempfile
import uuid

tmp = tempfile.mkdtemp(prefix="kc-", dir="/tmp")
os.environ["TMPDIR"] = tmp  # (before anything asks tempfile: the raylets inherit it too)
tempfile.tempdir = None

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from tests.configs import join_cluster  # noqa: E402
from worker_ext import kineto_env  # noqa: E402


def main() -> None:
    env = kineto_env()
    root = os.path.join(tmp, f"ray-profiler-{os.getuid()}")
    assert env["KINETO_IPC_SOCKET_DIR"] == os.path.join(root, "kineto"), env
    shutil.rmtree(root)  # the ranks' node has none (see the module docstring)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"head": 8}, "include_dashboard": False},
    )
    out: dict = {"windows": [], "cold": not os.path.exists(root)}
    try:
        node2 = cluster.add_node(num_cpus=2, resources={"node2": 8})
        out["node2"] = node2.node_id
        join_cluster(cluster.address, namespace="profiler-kineto-cold")
        out["windows"] = run_windows(env)
        out["dir_mode"] = oct(os.stat(os.path.join(root, "kineto")).st_mode & 0o777)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    print("RESULT " + json.dumps(out), flush=True)


def run_windows(env: dict[str, str]) -> list[dict]:
    from tests.ray_workers import ToyWorker
    from trainers.hooks import ProfilingHooks

    class Rank(ToyWorker):
        def node(self) -> str:
            return str(ray.get_runtime_context().get_node_id())

    placed = ray.remote(num_cpus=0, resources={"node2": 1}, runtime_env={"env_vars": env})
    ranks = [placed(Rank).remote() for _ in range(2)]
    save = os.path.join(tmp, "runs")
    # libkineto polls once a second: a warm-up of 10 steps of 0.25 s is the lead a config needs.
    cfg = {"enable": True, "save_path": save, "ranks": "all", "engine": "kineto",
           "skip_first": 4, "wait": 2, "warmup": 10, "active": 3, "repeat": 2,
           "export_type": "chrome_trace", "run_name": "cold"}  # fmt: skip
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    hooks = ProfilingHooks.attach(cfg, ranks, trainer_id="sft", name=name, namespace="cold")
    coord = hooks.coordinator
    tables = []
    try:
        with hooks.session(first_step=0):
            for k in range(36):
                ray.get([w.train_step.remote(1, 0.25) for w in ranks])
                hooks.step(k)
        for i in range(2):
            done = ray.get(coord.wait_window.remote(i, timeout_s=120))
            table = ray.get(coord.kernel_summary.remote(i, 100_000, None, False))
            addmm = {k["name"]: k for k in table["kernels"]}.get("aten::addmm", {})
            tables.append({
                "done": done["done"], "ranks": table["ranks"], "bad": table["bad_ranks"],
                "steps": table["steps"], "partial": table["partial"],
                "addmm": [addmm.get("ranks_present"), addmm.get("count")],
            })  # fmt: skip
        tables.append({"nodes": sorted(set(ray.get([w.node.remote() for w in ranks])))})
    finally:
        ray.kill(coord)
    return tables


if __name__ == "__main__":
    main()
