"""Toy Ray policy workers for tests: the mixin plus a tiny training step."""

from __future__ import annotations

import asyncio

from tests.torch_helpers import TinyMLP
from worker_ext import ProfilerWorkerMixin


class ToyWorker(ProfilerWorkerMixin):
    def __init__(self) -> None:
        self.model = TinyMLP()

    def train_step(self) -> float:
        return self.model.train_step()

    def pid(self) -> int:
        import os

        return os.getpid()


class AsyncToyWorker(ProfilerWorkerMixin):
    def __init__(self) -> None:
        self.model = TinyMLP()

    async def train_step(self) -> float:
        await asyncio.sleep(0)
        return self.model.train_step()
