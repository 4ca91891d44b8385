"""Holistic Trace Analysis as the oracle of the GPU figures (a test-only dependency).

``oracle_copy`` writes HTA's copy of a trace: HTA leaves a trace's last ``ProfilerStep`` out and
keeps kernels launched before the first one, so its copy gets one more, empty ``ProfilerStep``
at the end of the real ones, and loses the launches that lie outside every step (their kernels
then have no launch, and HTA drops them, as the window does). ``figures`` runs HTA on it, with
its rounding of fractional microseconds off, and returns the figures the summary also gives.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from typing import Any

import numpy as np

STEP = re.compile(r"^ProfilerStep#(\d+)$")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def oracle_copy(path: str, out_dir: str) -> str:
    """HTA's copy of ``path`` in ``out_dir`` (see the module docstring); its path."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    steps = [e for e in events if e.get("ph") == "X" and STEP.match(str(e.get("name", "")))]
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in steps]

    def in_a_step(e: dict[str, Any]) -> bool:
        return any(b <= float(e["ts"]) < end for b, end in spans)

    kept = [
        e
        for e in events
        if not (e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})) or in_a_step(e)
    ]
    last = max(steps, key=lambda e: float(e["ts"]))
    n = int(STEP.match(last["name"]).group(1)) + 1
    end = float(last["ts"]) + float(last["dur"])
    kept.append({**last, "name": f"ProfilerStep#{n}", "ts": end, "dur": 1, "args": {}})
    doc["traceEvents"] = kept
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, os.path.basename(path).removesuffix(".gz"))
    with open(out, "w") as f:
        json.dump(doc, f)
    return out


def figures(trace_dir: str) -> dict[int, dict[str, Any]]:
    """HTA's figures of each rank of ``trace_dir`` (times in us)."""
    os.environ["HTA_DISABLE_NS_ROUNDING"] = "1"
    from hta.trace_analysis import TraceAnalysis

    ta = TraceAnalysis(trace_dir=trace_dir)
    out: dict[int, dict[str, Any]] = {}
    temporal = ta.get_temporal_breakdown(visualize=False)
    for _, row in temporal.iterrows():
        out[int(row["rank"])] = {
            "window_us": float(row["kernel_time(us)"]),
            "idle_us": float(row["idle_time(us)"]),
            "compute_us": float(row["compute_time(us)"]),
        }
    overlap = ta.get_comm_comp_overlap(visualize=False)
    for _, row in overlap.iterrows():
        out[int(row["rank"])]["overlap_pctg"] = float(row["comp_comm_overlap_pctg"])
    for rank in out:
        out[rank]["kernels"] = _kernels_of(ta, rank)
        comm, memory = _unions_of(ta, rank)
        out[rank]["comm_us"], out[rank]["memcpy_us"] = comm, memory
        # HTA gives the overlap as a share of communication (rounded to 0.01%).
        out[rank]["overlap_us"] = out[rank]["overlap_pctg"] / 100.0 * comm
        stats = ta.get_cuda_kernel_launch_stats(ranks=[rank], visualize=False)[rank]
        delay = stats["launch_delay"].to_numpy(dtype=float)
        out[rank]["launch"] = {
            "kernels": len(stats),
            "delay_p50_us": float(np.percentile(delay, 50)),
            "delay_p95_us": float(np.percentile(delay, 95)),
            "short_share": float((stats["gpu_duration"] < stats["cpu_duration"]).mean()),
        }
    return out


def _kernels_of(ta: Any, rank: int) -> dict[str, float]:
    """One rank's device time per kernel (``get_gpu_kernel_breakdown``, nothing grouped)."""
    from hta.analyzers.breakdown_analysis import BreakdownAnalysis
    from hta.common.trace import Trace

    one = Trace.__new__(Trace)
    one.__dict__.update(ta.t.__dict__)
    one.traces = {rank: ta.t.traces[rank]}
    _, kernels = BreakdownAnalysis.get_gpu_kernel_breakdown(
        one, visualize=False, num_kernels=10**9, duration_ratio=1.0, include_memory_kernels=True
    )
    return {str(r["name"]): float(r["sum (us)"]) for _, r in kernels.iterrows()}


def _unions_of(ta: Any, rank: int) -> tuple[float, float]:
    """One rank's communication and memory time, merged as HTA merges compute time for its
    temporal breakdown (its kernel-type table truncates each piece to a whole microsecond)."""
    from hta.utils.utils import get_kernel_type, merge_kernel_intervals

    sym = ta.t.symbol_table.get_sym_table()
    df = ta.t.traces[rank]
    gpu = df[df["stream"].ne(-1)].copy()
    kinds = gpu["name"].map(lambda i: get_kernel_type(sym[i]))
    out = []
    for kind in ("COMMUNICATION", "MEMORY"):
        merged = merge_kernel_intervals(gpu[kinds.eq(kind)].copy())
        out.append(float(merged["end"].sum() - merged["ts"].sum()))
    return out[0], out[1]


def op_device_us(trace_dir: str, rank: int) -> dict[str, float]:
    """Device time per CPU op, by HTA's call stacks: each device event's time to the innermost
    ``cpu_op`` on the path from its launch to the root (``<no op>`` when none)."""
    os.environ["HTA_DISABLE_NS_ROUNDING"] = "1"
    from hta.common.call_stack import CallGraph
    from hta.trace_analysis import TraceAnalysis

    ta = TraceAnalysis(trace_dir=trace_dir)
    graph = CallGraph(ta.t, ranks=[rank])
    sym = ta.t.symbol_table.get_sym_table()
    df = ta.t.traces[rank]
    cpu_op = ta.t.symbol_table.get_sym_id_map()["cpu_op"]
    out: dict[str, float] = {}
    for _, k in df[df["stream"].ne(-1) & df["index_correlation"].gt(0)].iterrows():
        launch = df.loc[int(k["index_correlation"])]
        stack = graph.mapping.loc[(rank, launch["pid"], launch["tid"])]["csg_index"]
        path = graph.call_stacks[stack].get_path_to_root(int(launch["index"]))
        ops = [i for i in path if i >= 0 and i in df.index and df.loc[i, "cat"] == cpu_op]
        name = sym[df.loc[ops[0], "name"]] if ops else "<no op>"
        out[name] = out.get(name, 0.0) + float(k["dur"])
    return out
