"""Toy Ray policy workers for tests: the mixin plus a tiny training step."""

from __future__ import annotations

import asyncio

from tests.torch_helpers import TinyMLP
from worker_ext import ProfilerWorkerMixin
from worker_ext.rank_profiler import RankProfiler


class ToyWorker(ProfilerWorkerMixin):
    def __init__(self) -> None:
        self.model = TinyMLP()

    def train_step(self, repeat: int = 1) -> float:
        for _ in range(repeat):
            loss = self.model.train_step()
        return loss

    def pid(self) -> int:
        import os

        return os.getpid()


class AsyncToyWorker(ProfilerWorkerMixin):
    def __init__(self) -> None:
        self.model = TinyMLP()

    async def train_step(self) -> float:
        await asyncio.sleep(0)
        return self.model.train_step()


class FaultyWorker(ToyWorker):
    """Injects faults (the only mocking allowed: fault injection)."""

    def inject(self, kind: str) -> None:
        import time

        import torch

        if kind == "torch_start":

            def broken_start(self):
                raise RuntimeError("injected: CUPTI_ERROR_NOT_INITIALIZED")

            torch.profiler.profile.start = broken_start
        elif kind == "garbage_summary":
            import worker_ext.rank_profiler as rp

            rp.encode_summary = lambda summary: b"\xc1garbage"
        elif kind == "slow_step_1s":
            real_step = RankProfiler.step

            def slow_1s(self, k):
                time.sleep(1.0)
                return real_step(self, k)

            RankProfiler.step = slow_1s
        elif kind == "slow":

            def slow(self, k):
                time.sleep(8)
                return {}

            RankProfiler.step = slow
        else:
            raise ValueError(kind)


def _node_id(self) -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


ToyWorker.node_id = _node_id
