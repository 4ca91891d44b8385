"""``ray-profiler summarise`` against Holistic Trace Analysis on the same GPU traces, each run as a
whole process: wall time and peak resident memory.

Ours: ``python -m coordinator summarise PATH --json`` (read, summarise, fold, the cross-rank
table). HTA: ``TraceAnalysis(trace_dir)`` and the four analyses whose figures ours gives
(``get_gpu_kernel_breakdown``, ``get_temporal_breakdown``, ``get_comm_comp_overlap``,
``get_cuda_kernel_launch_stats``). The traces: the shared ones (``tests/data/gpu-traces``), and the
all-reduce trace repeated ``--repeat`` times in one file (a long window: steps, times and
correlations shifted), where the interpreter's own memory no longer hides the trace's.

Peak memory is the largest resident set of the process or any process it waited for; for ours
also above a run on a trace of three events (the interpreter, its imports and what a run loads
lazily), against the window's uncompressed traces (goal: at most 2x). Goal for time: HTA at least
5x slower on every trace.

Run: .venv/bin/python bench/summarise_cost.py [--rounds 3] [--repeat 10]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = os.path.join(ROOT, "tests", "data", "gpu-traces")
HTA = """
import sys
from hta.trace_analysis import TraceAnalysis
ta = TraceAnalysis(trace_dir=sys.argv[1])
ta.get_gpu_kernel_breakdown(visualize=False)
ta.get_temporal_breakdown(visualize=False)
ta.get_comm_comp_overlap(visualize=False)
ta.get_cuda_kernel_launch_stats(ranks=sorted(ta.t.traces), visualize=False)
"""


def tiny_trace(out_dir: str) -> str:
    """A trace of three events (a step, a launch, its kernel): a run's fixed cost."""
    events = [
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": "ProfilerStep#1",
            "pid": 1,
            "tid": 1,
            "ts": 1.0,
            "dur": 100.0,
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "pid": 1,
            "tid": 1,
            "ts": 2.0,
            "dur": 5.0,
            "args": {"correlation": 1},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "k",
            "pid": 0,
            "tid": 7,
            "ts": 10.0,
            "dur": 5.0,
            "args": {"device": 0, "stream": 7, "correlation": 1},
        },
    ]
    path = os.path.join(out_dir, "tiny.json")
    with open(path, "w") as f:
        json.dump({"traceEvents": events}, f)
    return path


LAUNCHER = """
import json, resource, subprocess, sys, time
t0 = time.perf_counter()
done = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
wall = time.perf_counter() - t0
if done.returncode:
    sys.exit(done.stderr.decode()[-2000:])
print(json.dumps([wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024]))
"""


def measure(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak resident MB of ``cmd`` (the largest of it and its children).

    Started by a small launcher process: Linux carries a process's peak resident set across
    ``exec``, so a child of this (large) process would report this one's peak as its own."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run(
        [sys.executable, "-c", LAUNCHER, *cmd], capture_output=True, text=True, env=env
    )
    if out.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed: {out.stderr[-2000:]}")
    wall, peak = json.loads(out.stdout)
    return float(wall), float(peak)


def long_trace(out_dir: str, repeat: int) -> str:
    """The all-reduce trace's events ``repeat`` times over, one after the other."""
    src = os.path.join(TRACES, "one-rank-nccl", "nccl_rank0_of_2.json.gz")
    with gzip.open(src, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    timed = [e for e in events if "ts" in e]
    span = max(float(e["ts"]) + float(e.get("dur", 0)) for e in timed) - min(
        float(e["ts"]) for e in timed
    )
    out = [e for e in events if "ts" not in e]
    for i in range(repeat):
        for e in timed:
            c = dict(e, ts=float(e["ts"]) + i * (span + 1000.0))
            if "args" in e:
                args = dict(e["args"])
                for key in ("correlation", "External id"):
                    if isinstance(args.get(key), int):
                        args[key] += i * 10_000_000
                c["args"] = args
            if isinstance(c.get("id"), int):
                c["id"] += i * 10_000_000
            name = str(c.get("name", ""))
            if name.startswith("ProfilerStep#"):
                c["name"] = f"ProfilerStep#{int(name.split('#')[1]) + 3 * i}"
            out.append(c)
    path = os.path.join(out_dir, "nccl_long.json")
    with open(path, "w") as f:  # in Kineto's layout: one event per "\n  {\n ... }" block
        f.write("{\n")
        for key, value in doc.items():
            if key != "traceEvents":
                f.write(f"  {json.dumps(key)}: {json.dumps(value)},\n")
        f.write('  "traceEvents": [')
        for i, e in enumerate(out):
            f.write(("," if i else "") + "\n  {\n    " + json.dumps(e)[1:-1] + "\n  }")
        f.write("\n  ]\n}\n")
    return path


def cases(tmp: str, repeat: int) -> list[tuple[str, list[str], str, int]]:
    """(label, our paths, HTA's directory, uncompressed bytes of the window's traces)."""
    out = []
    for job in ("two-ranks", "one-rank-nccl"):
        d = os.path.join(TRACES, job)
        files = sorted(os.path.join(d, f) for f in os.listdir(d))
        size = sum(_unzipped(f) for f in files)
        out.append((job, [d], d, size))
    if repeat > 0:
        d = os.path.join(tmp, "long")
        os.makedirs(d)
        path = long_trace(d, repeat)
        out.append((f"all-reduce x{repeat}", [path], d, os.path.getsize(path)))
    return out


def _unzipped(path: str) -> int:
    with gzip.open(path) as f:
        return len(f.read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=10, help="the long trace's repeats (0: none)")
    args = ap.parse_args()
    py = sys.executable
    tmp = tempfile.mkdtemp(prefix="bench-summarise-")
    try:
        tiny = [py, "-m", "coordinator", "summarise", tiny_trace(tmp), "--json"]
        base = statistics.median(measure(tiny)[1] for _ in range(args.rounds))
        print(f"a run on a trace of three events: {base:.0f} MB")
        print()
        print(
            "| trace | uncompressed | ours | HTA | HTA / ours | our peak | HTA's peak | "
            "our peak above a three-event run / trace |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for label, paths, hta_dir, size in cases(tmp, args.repeat):
            ours = [
                measure([py, "-m", "coordinator", "summarise", *paths, "--json"])
                for _ in range(args.rounds)
            ]
            theirs = [measure([py, "-c", HTA, hta_dir]) for _ in range(args.rounds)]
            t_ours, t_hta = (statistics.median(t for t, _ in r) for r in (ours, theirs))
            m_ours, m_hta = (max(m for _, m in r) for r in (ours, theirs))
            mb = size / 2**20
            print(
                f"| {label} | {mb:.1f} MB | {t_ours:.2f} s | {t_hta:.2f} s | "
                f"{t_hta / t_ours:.1f}x | {m_ours:.0f} MB | {m_hta:.0f} MB | "
                f"{(m_ours - base) / mb:.2f}x |",
                flush=True,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
