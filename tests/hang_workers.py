"""A policy rank that can be told to hang inside one step, for the stall tests: the real
training step (a gloo all-reduce over the ranks), with a sleep on one rank before it."""

from __future__ import annotations

import time
from typing import Any

import torch

from trainers.reference.workers import PolicyWorker


def slow_loader(seconds: float) -> None:
    time.sleep(seconds)


def load_batch(seconds: float) -> None:
    slow_loader(seconds)


class HangingPolicy(PolicyWorker):
    """``PolicyWorker`` whose ``train(rows, step)`` sleeps ``seconds`` on the ranks and step
    that ``hang`` names (before its all-reduce), then trains as usual."""

    hang_at: tuple[int, set[int], float] | None = None

    def hang(self, step: int, ranks: list[int], seconds: float) -> None:
        self.hang_at = (step, set(ranks), seconds)

    def train(self, rows: torch.Tensor, step: int) -> float:
        if self.hang_at is not None and step == self.hang_at[0] and self.rank in self.hang_at[1]:
            load_batch(self.hang_at[2])
        return self.sft_step(rows)


def make_hanging_group(ray: Any, n_ranks: int, seed: int = 0) -> list[Any]:
    """``n_ranks`` HangingPolicy actors forming one gloo group."""
    cls = ray.remote(num_cpus=0)(HangingPolicy)
    workers = [cls.remote(r, n_ranks, seed) for r in range(n_ranks)]
    host, port = ray.get(workers[0].address.remote())
    ray.get([w.init_group.remote(host, port) for w in workers])
    return workers
