"""The training loops the benchmarks (and the stall regression test) run inside their ranks,
and the local Ray cluster the Ray benchmarks start."""

from __future__ import annotations

import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_local_ray() -> None:
    """A Ray cluster of this process (8 logical CPUs), this repository on its workers' path."""
    import ray

    ray.init(
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        namespace="profiler",
        runtime_env={"env_vars": {"PYTHONPATH": ROOT}},
    )


class DispatchBound:
    """12 ``Linear(64, 64)`` layers, batch 8, one intra-op thread; one training step is 4
    forward/backward/optimizer steps (about 5 ms here): dispatch-bound, as the CPU side of a
    GPU training loop is, so a 40-step window records about 100,000 trace events."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        torch.set_num_threads(1)
        self.model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(12)])
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x = torch.randn(8, 64)

    def train_step(self) -> None:
        for _ in range(4):
            loss = self.model(self.x).pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()

    def plain_window(self, warmup: int, active: int) -> torch.profiler.profile:
        """A window recorded with torch.profiler alone (CPU, ``record_shapes``), as a user
        without this project would: started, ``warmup + active`` steps, not yet stopped."""
        action = torch.profiler.ProfilerAction
        prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            record_shapes=True,
            schedule=lambda k: action.WARMUP if k < warmup else action.RECORD,
        )
        prof.start()
        for _ in range(warmup + active):
            self.train_step()
            prof.step()
        return prof
