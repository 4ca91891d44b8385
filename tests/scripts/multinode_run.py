"""Two raylets on one machine, each with its own staging directory.

1. A URL save_path (moto S3 at the endpoint given as argv[1]): ranks on both nodes stage their
   traces locally and the node agents upload every one; window 0 merged into one trace.
2. A node-local save_path: ranks on both nodes write traces; node 2 is removed mid-run, which
   loses its ranks; collecting a window then gets node 1's traces and names node 2's missing.

Run as a subprocess by tests/test_cluster.py (a Ray driver owns its process); prints JSON.
"""

import gzip
import json
import os
import sys
import tempfile

import ray
from ray.cluster_utils import Cluster

from coordinator import get_or_create_coordinator
from coordinator.ops.collect import collect_window
from coordinator.ops.timeline import merge_window
from coordinator.raylink.node_names import node_names
from tests.configs import join_cluster, profiler_config
from tests.fault_cases import wait_for_windows
from tests.ray_workers import ToyWorker


def files_under(root):
    return sorted(
        os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root) for n in names
    )


def _top_twice(coord, record: str, endpoint: str) -> tuple[str, str]:
    """``top --json`` of window 0 from the live coordinator, then from the run's record in the
    bucket (``--from``, in a process of its own with no cluster address: credentials and the
    endpoint from the environment, as a user's shell has them)."""
    import subprocess
    import sys

    live = json.dumps(ray.get(coord.kernel_summary.remote(window=0, top_k=20, run="run")))
    env = {
        **os.environ, "RAY_ADDRESS": "127.0.0.1:1", "AWS_ACCESS_KEY_ID": "testing-key",
        "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_ENDPOINT_URL": endpoint,
        "AWS_DEFAULT_REGION": "us-east-1",
    }  # fmt: skip
    argv = ["top", "--window", "0", "--k", "20", "--from", record, "--json"]
    got = subprocess.run(
        [sys.executable, "-m", "coordinator", *argv], env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    return live + "\n", got.stdout if got.returncode == 0 else got.stderr


def main(endpoint: str) -> None:
    save = tempfile.mkdtemp(prefix="multinode-")
    staging = {n: tempfile.mkdtemp(prefix=f"staging-{n}-") for n in ("head", "node2")}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 4,
            "resources": {"head": 8},
            "include_dashboard": False,
            "env_vars": {"RAY_PROFILER_STAGING": staging["head"]},
            # notice a removed node within a second or two, not half a minute
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3},
        },
    )
    try:
        join_cluster(cluster.address, namespace="profiler-multinode")
        s3_opts = {
            "key": "testing-key",
            "secret": "testing-secret",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        }
        # Both coordinators are created before node 2 exists: they stay on the head.
        s3_coord = get_or_create_coordinator(
            profiler_config(
                "s3://traces/multi",
                export_type="chrome_trace_gz",
                wait=0,
                warmup=1,
                active=2,
                repeat=2,
                storage_options=s3_opts,
            ),
            name="profiler-s3",
        )
        cfg = profiler_config(save, wait=0, warmup=1, active=2, repeat=0, worker_timeout_s=60.0)
        coord = get_or_create_coordinator(cfg)
        node2 = cluster.add_node(
            num_cpus=4, resources={"node2": 8}, env_vars={"RAY_PROFILER_STAGING": staging["node2"]}
        )
        cluster.wait_for_nodes()
        Worker = ray.remote(num_cpus=0)(ToyWorker)
        workers = [Worker.options(resources={"head": 1}).remote() for _ in range(2)]
        workers += [Worker.options(resources={"node2": 1}).remote() for _ in range(2)]
        nodes = ray.get([w.node_id.remote() for w in workers])

        # 1. Upload from both nodes.
        ray.get(s3_coord.register.remote("t", workers))
        ray.get(s3_coord.start.remote("t", 0))
        for k in range(6):  # windows: warmup 0, record 1-2 | warmup 3, record 4-5
            ray.get([w.train_step.remote() for w in workers])
            ray.get(s3_coord.step.remote("t", k))
        ray.get(s3_coord.stop.remote("t"))
        s3_st = wait_for_windows(ray, s3_coord, timeout=120)
        import s3fs

        fs = s3fs.S3FileSystem(
            key="testing-key", secret="testing-secret", client_kwargs=s3_opts["client_kwargs"]
        )
        s3_record = ray.get(s3_coord.flush_record.remote(60.0))
        found = sorted(fs.find("traces/multi"))
        uploaded = [p for p in found if "/record/" not in p]
        recorded = [p.split("/record/", 1)[1] for p in found if "/record/" in p]
        # The record read back from the bucket with no cluster: the live table, byte for byte.
        live_top, from_record = _top_twice(s3_coord, "s3://traces/multi/run", endpoint)
        s3_nodes = {str(r): t["node"] for w in s3_st["windows"] for r, t in w["traces"].items()}
        merged = merge_window(
            s3_coord, 0, os.path.join(save, "w0.json.gz"), storage_options=s3_opts
        )
        with gzip.open(os.path.join(save, "w0.json.gz")) as f:
            timeline = json.load(f)
        shift = timeline["baseTimeNanoseconds"] / 1000
        aligned = {}  # rank -> |merged - original| of its first step's start, wall clock (us)
        for pid, r in enumerate(range(4), start=1):
            with fs.open(f"traces/multi/run/window_0000_steps_1-2/policy/rank{r}.pt.trace.json.gz",
                         "rb") as f:  # fmt: skip
                original = json.loads(gzip.decompress(f.read()))
            first = next(e for e in original["traceEvents"] if e.get("name") == "ProfilerStep#1")
            mine = next(e for e in timeline["traceEvents"]
                        if e["pid"] == pid and e["name"] == "ProfilerStep#1")  # fmt: skip
            wall = first["ts"] + original["baseTimeNanoseconds"] / 1000
            aligned[str(r)] = abs(mine["ts"] + shift - wall)

        # 2. Node-local traces, node 2 removed, then collected.
        ray.get(coord.register.remote("t", workers))
        ray.get(coord.start.remote("t", 0))
        live = list(workers)
        for k in range(7):  # windows: warmup 0, record 1-2 | warmup 3, record 4-5 | ...
            if k == 4:  # window 0 merged by both nodes' agents, joined here; then node 2 goes
                local = merge_window(coord, 0, os.path.join(save, "local0.json"))
                cluster.remove_node(node2)
                live = workers[:2]
            ray.get([w.train_step.remote() for w in live])
            ray.get(coord.step.remote("t", k))
        ray.get(coord.stop.remote("t"))
        st = wait_for_windows(ray, coord, timeout=120)
        after = merge_window(coord, 0, os.path.join(save, "local0-after.json.gz"))
        with open(os.path.join(save, "local0.json")) as f:
            joined = json.load(f)
        local_aligned = {}  # rank -> |merged - its own trace| of its first step's start (us)
        for r in range(4):
            path = os.path.join(
                save, "run", "window_0000_steps_1-2", "policy", f"rank{r}.pt.trace.json"
            )
            with open(path) as f:
                original = json.load(f)
            first = next(e for e in original["traceEvents"] if e.get("name") == "ProfilerStep#1")
            mine = next(e for e in joined["traceEvents"]
                        if e["pid"] == r + 1 and e["name"] == "ProfilerStep#1")  # fmt: skip
            wall = first["ts"] + original["baseTimeNanoseconds"] / 1000
            local_aligned[str(r)] = abs(mine["ts"] + joined["baseTimeNanoseconds"] / 1000 - wall)
        dest = tempfile.mkdtemp(prefix="collected-")
        collected = collect_window(coord, 0, dest)
        out = {
            "distinct_nodes": len(set(nodes)),
            "nodes": nodes,
            "node_addresses": node_names(),
            "uploaded": uploaded,
            "s3_trace_errors": [w["trace_errors"] for w in s3_st["windows"]],
            "s3_record": s3_record,
            "recorded": recorded,
            "record_top_same": live_top == from_record,
            "record_top_window": json.loads(from_record)["window"],
            "s3_nodes": s3_nodes,
            "merged": {
                "names": {
                    str(e["pid"]): e["args"]["name"]
                    for e in timeline["traceEvents"]
                    if e["name"] == "process_name"
                },  # fmt: skip
                "kept": [[c["rank"], c["kept"], c["events"]] for c in merged["ranks"]],
                "spread_us": {str(k): v for k, v in merged["step_start_spread_us"].items()},
                "aligned_us": aligned,
                "missing": merged["missing"],
            },
            "staging_files": {n: files_under(d) for n, d in staging.items()},
            "staging_dirs": {n: sorted(os.listdir(d)) for n, d in staging.items()},
            "ranks": {r["rank"]: r["state"] for r in st["ranks"]},
            "windows": [(w["steps"], w["ranks"]) for w in st["windows"]],
            "files": {
                d: sorted(os.listdir(os.path.join(save, "run", d, "policy")))
                for d in sorted(os.listdir(os.path.join(save, "run")))
                if d.startswith("window_")
            },
            "local_merge": {
                "ranks": [[c["rank"], c["pid"], c["kept"], c["events"]] for c in local["ranks"]],
                "missing": local["missing"],
                "aligned_us": local_aligned,
                "pids": sorted({e["pid"] for e in joined["traceEvents"]}),
                "after": [c["rank"] for c in after["ranks"]],
                "after_missing": after["missing"],
            },
            "collected": {str(k): v for k, v in collected["files"].items()},
            "collected_dir": sorted(os.listdir(dest)),
            "missing": {str(k): v for k, v in collected["missing"].items()},
            "torch_loaded": st["process"]["torch_loaded"],
        }
        for h in (coord, s3_coord):
            ray.kill(h)
        print("RESULT " + json.dumps(out))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
