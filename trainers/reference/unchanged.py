"""A job as its user wrote it, for ``make demo DEMO_ARGS="--attach"``: nothing of this project is
imported or called here. A single controller: policy actors with an optimizer each, called by
the driver; each global step runs ``minibatches`` optimizer steps on every actor. Profiled only
through the setup hook in the job's ``runtime_env`` (``worker_ext.attach.setup``).
"""

from __future__ import annotations

import time

import ray


@ray.remote
class PolicyWorker:
    """One policy rank: a small MLP, Adam, and its own data stream."""

    def __init__(
        self, seed: int, pace_s: float = 0.0, slow_from: int | None = None, slow_s: float = 0.0
    ) -> None:
        import torch

        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.data = torch.Generator().manual_seed(seed)
        self.pace_s, self.slow_from, self.slow_s = pace_s, slow_from, slow_s
        self.steps = 0

    def train_step(self, minibatches: int) -> list[float]:
        import torch

        losses = []
        for _ in range(minibatches):
            x = torch.randn(16, 32, generator=self.data)
            loss = self.model(x).pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            losses.append(float(loss.detach()))
            self.steps += 1
            slow = self.slow_from is not None and self.steps >= self.slow_from
            time.sleep(self.pace_s + (self.slow_s if slow else 0.0))
        return losses


def single_controller(
    global_steps: int, ranks: int = 2, minibatches: int = 2, pace_s: float = 0.0,
    on_step: object = None, slow_from: int | None = None, slow_s: float = 0.0,
) -> list[float]:  # fmt: skip
    """Train; returns rank 0's loss of every optimizer step. ``on_step(step, loss, seconds)``,
    when given, is called after each global step; from optimizer step ``slow_from`` on, each
    optimizer step takes ``slow_s`` longer (a run that slows down)."""
    workers = [PolicyWorker.remote(seed, pace_s, slow_from, slow_s) for seed in range(ranks)]
    losses: list[float] = []
    for step in range(global_steps):
        t0 = time.perf_counter()
        got = ray.get([w.train_step.remote(minibatches) for w in workers])[0]
        losses += got
        if callable(on_step):
            on_step(step, got[-1], time.perf_counter() - t0)
    for w in workers:
        ray.kill(w)
    return losses
