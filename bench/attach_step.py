"""What the attach hook costs an optimizer step outside windows (issue 44).

A job started with the setup hook in its ``runtime_env`` (``worker_ext.attach.setup``), as a
user would: two Ray actors step a small optimizer (SGD over a 64x64 linear layer, a
deliberately tiny step so the hook's own cost shows) and are attached at their first step,
as ranks 0 and 1 of ``attached.Bench``. No window opens in the measured steps (``skip_first``
beyond them). In each actor, round by round so this shared machine's drift hits both alike:
  (a) bare: the optimizer step with the hook taken out of torch's global hook table;
  (b) attached: the same step with the hook in it (a ``RankSession`` step per optimizer step:
      rank 0 keeps a phase record per step and reports at most every 0.1 s without waiting);
  (c) the hook's own path alone: the post-hook called in a loop, no optimizer step around it;
  (d) a control: the same step with a post-hook that does nothing in place of ours (what any
      Python post-hook costs inside torch's step, before it does anything).
It prints microseconds per optimizer step (medians over rounds), the cost over the bare step
(the median of each round's difference: a drift between rounds cancels), and the ratio.

Run: RAY_AUTH_MODE=disabled .venv/bin/python bench/attach_step.py [--steps 10000] [--rounds 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import ray

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@ray.remote(num_cpus=0)
class Bench:
    """A rank's process: its optimizer and the timed loops."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.layer = torch.nn.Linear(64, 64)
        self.layer(torch.randn(2, 64)).sum().backward()  # (gradients to step with)
        self.opt = torch.optim.SGD(self.layer.parameters(), lr=1e-9)

    def attach(self) -> str:
        """The first optimizer step attaches this process; says who it is."""
        from worker_ext import attach

        self.opt.step()
        rank = getattr(attach._step, "__self__", None)
        return rank.who.describe() if rank is not None else f"not attached: {attach._step}"

    def measure(self, steps: int, rounds: int) -> dict[str, list[float]]:
        """(a) and (b) of the module docstring, alternating round by round."""
        from torch.optim.optimizer import _global_optimizer_post_hooks as hooks

        (key, hook), = hooks.items()  # fmt: skip
        out: dict[str, list[float]] = {"bare": [], "attached": [], "hook alone": [], "empty": []}
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(steps):
                hook(self.opt, (), {})
            out["hook alone"].append((time.perf_counter() - t0) / steps * 1e6)
            for label in ("bare", "attached", "empty"):
                if label == "bare":
                    del hooks[key]
                elif label == "empty":
                    hooks[key] = _empty_hook
                step = self.opt.step
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                out[label].append((time.perf_counter() - t0) / steps * 1e6)
                hooks[key] = hook
        return out


def _empty_hook(optimizer: object, args: object, kwargs: object) -> None:
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    save = tempfile.mkdtemp(prefix="attach-bench-")
    config = f"{{enable: true, save_path: {save}, skip_first: 1000000000, ranks: all, " \
             "activities: [cpu], attach: {name: attach-bench, namespace: bench}}"  # fmt: skip
    env = {"PYTHONPATH": ROOT, "RAY_AUTH_MODE": "disabled", "RAY_PROFILER_CONFIG": config}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={
        "worker_process_setup_hook": "worker_ext.attach.setup", "env_vars": env})  # fmt: skip
    ranks = [Bench.remote() for _ in range(2)]
    ray.get([r.__ray_ready__.remote() for r in ranks])
    who = ray.get([r.attach.remote() for r in ranks])
    print("\n".join(who))
    by_rank = {}
    for r in ranks:  # (one at a time: two cores)
        got = ray.get(r.measure.remote(args.steps, args.rounds))
        rank = who[ranks.index(r)].split(" rank ")[1].split(" ")[0]
        by_rank[rank] = got
    print(f"\nmedians of {args.rounds} rounds of {args.steps} optimizer steps:\n")
    print("| rank | bare us/step | attached us/step | over bare | ratio | the hook alone "
          "| an empty hook, over bare | attached, over the empty hook |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for rank in sorted(by_rank):
        got = by_rank[rank]
        bare, att = statistics.median(got["bare"]), statistics.median(got["attached"])
        over, empty, ours = (
            statistics.median(a - b for a, b in zip(got[x], got[y], strict=True))
            for x, y in (("attached", "bare"), ("empty", "bare"), ("attached", "empty"))
        )
        alone = statistics.median(got["hook alone"])
        print(f"| {rank} | {bare:.2f} | {att:.2f} | {over:+.2f} us | {att / bare:.3f}x | "
              f"{alone:.2f} us | {empty:+.2f} us | {ours:+.2f} us |")  # fmt: skip
    ray.kill(ray.get_actor("attach-bench", namespace="bench"))
    ray.shutdown()


if __name__ == "__main__":
    main()
