"""What the coordinator's one store costs, against the pickled checkpoint it replaced.

Part 1, in process, 1,024 ranks x 2,000 kernels (a settled window with every rank's summary):
- one window's file in Ray's KV (msgspec, per-rank kernel values left out, encoded on the
  writer's thread), against the same window pickled as the old checkpoint did (cloudpickle,
  per-rank values left out), in the same run;
- a save of the run with a full history of 64 such settled windows already stored: what it
  does on the event loop, and the bytes it writes, against the old checkpoint's incremental
  write (the run pickled without its windows, ranks and trainers), in the same run.

Part 2, on Ray (``--restart``): the time from ``kill -9`` of the coordinator's process to its
first answer after Ray restarted it, with 2 ranks and a few windows, for this tree and for the
old checkpoint's code (a git worktree of ``--baseline``), in alternating rounds.

    python bench/state_store_cost.py               # part 1
    python bench/state_store_cost.py --restart     # part 2 as well (about 2 minutes)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = "9aa8e6f"  # the last commit with the pickled checkpoint


def window_state(ranks: int, kernels: int):
    from coordinator.core.records import RankRecord
    from coordinator.core.schedule import Window
    from coordinator.core.state import CoordinatorState
    from coordinator.protocol.summary_codec import KernelRow, RankSummary, encode_summary

    rng = random.Random(0)
    names = [f"void gemm_kernel_{i}<float, 128, 64>(Params)" for i in range(kernels)]
    st = CoordinatorState(max_windows=64)
    keys = [("t", r) for r in range(ranks)]
    for key in keys:
        st.ranks[key] = RankRecord("t", key[1], True)
    st.stepping_trainer = "t"
    rec = st.open_window(Window(0, 9, 10, 12), keys)
    for key in keys:
        rows = [KernelRow(n, rng.uniform(1, 1000), rng.randint(1, 50), 0) for n in names]
        st.ingest_summary(
            key, encode_summary(RankSummary(key[1], 0, (10, 12), False, "cuda", rows))
        )
    rec.acked = set(keys)
    rec.steps = (10, 12)
    st.close_window(rec)
    return st, rec


def old_style_pickle(obj) -> bytes:
    import ray.cloudpickle as cloudpickle

    return bytes(cloudpickle.dumps(obj))


def without_detail(rec):
    """The window as the old checkpoint pickled it: its aggregates' per-rank values left out."""
    snap = rec.snapshot()
    for agg in snap.aggregates.values():
        agg._detail = agg._stragglers = None
    return snap


def timed(fn, n: int = 5) -> tuple[float, object]:
    times, out = [], None
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


class Sink:
    """A store that keeps the bytes it is given (the writes, without Ray's KV)."""

    def __init__(self, url: str) -> None:
        self.url, self.options, self.files = url, {}, {}

    def put(self, rel: str, blob: bytes) -> None:
        self.files[rel] = blob

    def delete(self, rel: str) -> None:
        self.files.pop(rel, None)


def part1(ranks: int, kernels: int) -> None:
    from coordinator.core import record_codec as codec
    from coordinator.core.config import ProfilerConfig
    from coordinator.core.run import new_run
    from coordinator.service import state_store

    st, rec = window_state(ranks, kernels)
    snap_s, snap = timed(rec.snapshot)
    new_s, new = timed(lambda: codec.encode(codec.window_file("run", snap, detail=False)))
    old_s, old = timed(lambda: old_style_pickle(without_detail(rec)))
    print(f"one settled window, {ranks} ranks x {kernels} kernels, per-rank values left out:")
    row("old checkpoint (cloudpickle)", f"{len(old) / 1e6:6.3f} MB", old_s, "on the loop")
    row("one store (msgspec)", f"{len(new) / 1e6:6.3f} MB", new_s,
        f"on the writer's thread (+{snap_s * 1e3:.1f} ms copy on the loop)")  # fmt: skip
    print(f"  {'ratio new/old':30} {len(new) / len(old):6.3f}x size {new_s / old_s:6.2f}x time")

    history = 64
    for i in range(1, history):
        w = copy.copy(rec)
        w.window = type(rec.window)(i, 9, 10, 12)
        st.windows[i] = w
    run = new_run(ProfilerConfig(max_windows=history), set())
    run.state = st
    saver = state_store.StateSaver("bench", "bench")
    saver.saved_windows = {(run.name, i) for i in st.windows}  # already written once each
    saver.written = set(saver.saved_windows)  # (so the state names them, as after a real save)
    regs = st.counters["registrations"] + st.counters["rank_attaches"]
    saver.saved_ranks = {run.name: (st.ranks_version, regs)}  # and these
    sinks: dict[str, Sink] = {}

    def sink_for(prefix: str) -> Sink:
        return sinks.setdefault(prefix, Sink(prefix))

    state_store.run_store = lambda ns, name, r: sink_for(f"{ns}/{name}/runs/{r}")  # type: ignore
    state_store.root = lambda ns, name: sink_for(f"{ns}/{name}")  # type: ignore
    extra = {"throttled": False, "restarts": 0}
    loop_s, _ = timed(lambda: saver.save_runs(run, [], extra), n=7)
    assert saver.flush(30)
    written = sum(len(b) for s in sinks.values() for b in s.files.values())

    def old_record():
        light_state = copy.copy(st)
        light_state.windows, light_state.ranks, light_state.trainers = {}, {}, {}
        light = copy.copy(run)
        light.state = light_state
        return old_style_pickle({"version": 2, "runs": [(light, list(st.windows))]})

    old_loop_s, old_blob = timed(old_record, n=7)
    print(f"a save with {history} settled windows stored (the old checkpoint's incremental write):")
    row("old checkpoint (cloudpickle)", f"{len(old_blob) / 1e3:6.1f} KB", old_loop_s, "on the loop")
    where = "on the loop (state, run and coordinator files, encoded on the writer's thread)"
    row("one store (msgspec)", f"{written / 1e3:6.1f} KB", loop_s, where)
    size, took = written / len(old_blob), loop_s / old_loop_s
    print(f"  {'ratio new/old':30} {size:6.3f}x size {took:6.2f}x time")


def row(label: str, size: str, seconds: float, where: str) -> None:
    print(f"  {label:30} {size}  {seconds * 1e3:7.2f} ms {where}")


RESTART_CHILD = r"""
import json, os, sys, time, uuid
sys.path.insert(0, sys.argv[1])
import ray
from coordinator import get_or_create_coordinator
import coordinator
assert coordinator.__file__.startswith(sys.argv[1]), coordinator.__file__
ray.init(address=sys.argv[2], namespace="bench", log_to_driver=False,
         runtime_env={"env_vars": {"PYTHONPATH": sys.argv[1]}})
from worker_ext import ProfilerWorkerMixin

@ray.remote(num_cpus=0)
class W(ProfilerWorkerMixin):
    def train_step(self):
        import torch
        return float(torch.ones(64, 64).sum())

cfg = {"enable": True, "save_path": sys.argv[3], "ranks": "all", "wait": 1, "warmup": 1,
       "active": 1, "export_type": "none"}
name = "restart-" + uuid.uuid4().hex[:8]
coord = get_or_create_coordinator(cfg, name=name, namespace="bench")
workers = [W.remote() for _ in range(2)]
ray.get(coord.register.remote("t", workers))
ray.get(coord.start.remote("t", 0))
for k in range(12):
    ray.get([w.train_step.remote() for w in workers])
    ray.get(coord.step.remote("t", k))
time.sleep(1.5)  # (the last save written)
pid = ray.get(coord.status.remote())["process"]["pid"]
t0 = time.perf_counter()
os.kill(pid, 9)
while True:
    try:
        st = ray.get(coord.status.remote(), timeout=60)
        if st["restarts"] >= 1:
            break
    except Exception:
        time.sleep(0.01)
took = time.perf_counter() - t0
assert st["global_step"] == 11, st["global_step"]
print(json.dumps({"seconds": took, "windows": len(st["windows"])}))
ray.kill(coord)
for w in workers:
    ray.kill(w)
"""


def part2(rounds: int, baseline: str) -> None:
    work = tempfile.mkdtemp(prefix="bench-restart-")
    old = os.path.join(work, "old")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "-q", old, baseline], check=True)
    temp = os.path.join(work, "ray")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    subprocess.run([ray_cli, "start", "--head", "--num-cpus=4", "--include-dashboard=false",
                    "--disable-usage-stats", f"--temp-dir={temp}", "--port=6391"],
                   check=True, env=env, capture_output=True)  # fmt: skip
    got: dict[str, list[float]] = {"old": [], "new": []}
    try:
        for _ in range(rounds):
            for label, code in (("old", old), ("new", ROOT)):
                out = subprocess.run(
                    [sys.executable, "-c", RESTART_CHILD, code, "127.0.0.1:6391",
                     os.path.join(work, "save")],
                    capture_output=True, text=True, env=env, timeout=300,
                )  # fmt: skip
                if out.returncode:
                    raise RuntimeError(out.stderr[-3000:])
                got[label].append(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])
    finally:
        subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True)
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", old])
    o, n = statistics.median(got["old"]), statistics.median(got["new"])
    print(f"restart after kill -9 (median of {rounds} alternating rounds, 2 ranks, 5 windows):")
    print(
        f"  old checkpoint ({baseline})     {o:6.2f} s   {sorted(round(x, 2) for x in got['old'])}"
    )
    print(
        f"  one store                      {n:6.2f} s   {sorted(round(x, 2) for x in got['new'])}"
    )
    print(f"  ratio new/old                  {n / o:6.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--kernels", type=int, default=2000)
    ap.add_argument("--restart", action="store_true", help="part 2: restart times on Ray")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", default=BASELINE)
    args = ap.parse_args()
    part1(args.ranks, args.kernels)
    if args.restart:
        part2(args.rounds, args.baseline)


if __name__ == "__main__":
    main()
