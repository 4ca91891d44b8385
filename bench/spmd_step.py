"""What an SPMD rank's step costs outside windows, beside the bare loop and the single-controller
hooks (issue 30).

In one Ray actor (a rank's process), the same loop of a small fixed piece of work (a 64x64
matmul) runs, interleaved round by round so this shared machine's drift hits each alike:
  (a) bare: the work only;
  (b) ``RankSession.step`` on rank 0, which reports its step without waiting at most every 0.1 s;
  (c) ``RankSession.step`` on rank 1, which sends nothing outside windows;
  ((b) and (c) look at their plan board, which holds a capture planned far ahead;)
  (d) today's single controller, ``ProfilingHooks.step`` with one actor rank registered (its
      ``StepClient`` reports without waiting at most every 0.1 s).
No window opens in the measured steps (``skip_first`` beyond them). It prints microseconds per
step, the cost over the bare loop, and each ratio to (a).

Run: RAY_AUTH_MODE=disabled .venv/bin/python bench/spmd_step.py [--steps 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import ray


def _idle_rank() -> Any:
    """A registered actor rank for (d), never called outside windows."""
    from worker_ext import ProfilerWorkerMixin

    return ray.remote(num_cpus=0)(type("IdleRank", (ProfilerWorkerMixin,), {})).remote()


@ray.remote(num_cpus=0)
class Rank:
    """One rank process running the loops."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.a = torch.randn(64, 64)

    def measure(self, cfg: dict[str, Any], worker: Any, steps: int, rounds: int) -> dict[str, Any]:
        from trainers.hooks import ProfilingHooks
        from worker_ext.rank.rank_session import RankSession

        r0 = RankSession.attach(cfg, trainer_id="spmd", rank=0, world_size=2, namespace="bench")
        import worker_ext.rank.rank_session as rs

        rs._release(r0)  # (two sessions in one process, for this benchmark only: ranks 0 and 1)
        r1 = RankSession.attach(cfg, trainer_id="spmd", rank=1, world_size=2, namespace="bench")
        assert r0.disabled_reason is None and r1.disabled_reason is None
        hooks = ProfilingHooks.attach(
            {**cfg, "run_name": "single"}, [worker], trainer_id="single", name="profiler-single",
            namespace="bench",
        )  # fmt: skip
        a = self.a
        out: dict[str, list[float]] = {"a": [], "b": [], "c": [], "d": []}
        k = {"b": 0, "c": 0, "d": 0}

        def run(key: str, step: Any) -> float:
            t0 = time.perf_counter()
            for _ in range(steps):
                (a @ a).sum()
                if step is not None:
                    step(k[key])
                    k[key] += 1
            return (time.perf_counter() - t0) / steps * 1e6

        r0.start(0)
        r1.start(0)
        hooks.start(0)
        # A capture far ahead: each SPMD rank's node-local plan board exists and is looked at
        # (one os.stat, at most every 0.1 s) in the measured steps, as in a run with captures.
        ref = r0.coordinator.request_capture.remote(active=1, warmup=0, start_step=10**8)
        while not ray.wait([ref], timeout=0)[0]:
            for key, session in (("b", r0), ("c", r1)):
                session.step(k[key])
                k[key] += 1
            time.sleep(0.01)
        planned = ray.get(ref)
        assert planned["accepted"] and planned["missed"] == [], planned
        run("a", None)  # warm up
        for _ in range(rounds):
            out["a"].append(run("a", None))
            out["b"].append(run("b", r0.step))
            out["c"].append(run("c", r1.step))
            out["d"].append(run("d", hooks.step))
        r0.stop()
        r1.stop()
        hooks.stop()
        return {key: statistics.median(v) for key, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    ray.init(
        address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="bench"
    )
    cfg = {"enable": True, "save_path": tempfile.mkdtemp(prefix="bench-spmd-"), "ranks": "all",
           "activities": ["cpu"], "skip_first": 10**9, "active": 2}  # fmt: skip
    worker = _idle_rank()
    rank = Rank.remote()
    res = ray.get(rank.measure.remote(cfg, worker, args.steps, args.rounds))
    for name in ("profiler", "profiler-single"):
        ray.kill(ray.get_actor(name, namespace="bench"))
    a = res["a"]
    print(f"steps {args.steps} x {args.rounds} rounds (medians), microseconds per step")
    labels = {
        "a": "bare loop",
        "b": "RankSession.step, rank 0 (reports <= every 0.1 s)",
        "c": "RankSession.step, rank 1 (sends nothing)",
        "d": "ProfilingHooks.step, single controller",
    }
    for key, label in labels.items():
        v = res[key]
        print(f"  ({key}) {label:<52} {v:8.2f} us  +{v - a:6.2f} us  {v / a:5.3f}x")


if __name__ == "__main__":
    main()
