"""Toy Ray policy workers for tests: the mixin plus a tiny training step."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

from tests.torch_helpers import TinyMLP
from trainers.reference.workers import PolicyWorker, make_policy_group
from worker_ext import ProfilerWorkerMixin
from worker_ext.rank.rank_profiler import RankProfiler


class ToyWorker(ProfilerWorkerMixin):
    def __init__(self) -> None:
        self.model = TinyMLP()

    def train_step(self, repeat: int = 1, sleep_s: float = 0.0) -> float:
        for _ in range(repeat):
            loss = self.model.train_step()
        if sleep_s:
            import time

            time.sleep(sleep_s)  # a slower step (data loading, a throttled node)
        return loss

    def pid(self) -> int:
        import os

        return os.getpid()

    def reset(self) -> bool:
        """Back to a fresh worker for the next test: close any window, forget the config."""
        rp = self._rank_profiler
        if rp is not None and rp.phase != "idle":
            rp.stop_window()
        self._rank_profiler = None
        return True


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
        elif kind == "garbage_summary":  # the agent answers with bytes that are not a summary
            from concurrent.futures import Future

            from worker_ext.agent.trace_jobs import JobResult
            from worker_ext.rank.hand_off import HandOff

            def garbage_submit(self, job):
                done = Future()
                done.set_result(JobResult(window=job.window, pid=0, summary=b"\xc1garbage"))
                self.done(job, done)

            HandOff.submit = garbage_submit
        elif kind == "slow_step_1s":
            real_step = RankProfiler.step

            def slow_1s(self, k):
                time.sleep(1.0)
                return real_step(self, k)

            RankProfiler.step = slow_1s
        elif kind == "slow":

            def slow(self, k):
                time.sleep(5)
                return {}

            RankProfiler.step = slow
        else:
            raise ValueError(kind)


def _node_id(self) -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


ToyWorker.node_id = _node_id


class ProfiledPolicyWorker(PolicyWorker):
    """A reference-trainer rank that also profiles a window itself, to compare with key_averages."""

    def profile_window(self, path: str, steps: int, with_stack: bool = False) -> dict:
        """Profile ``steps`` SFT + RL steps; key_averages() of them (or why it failed)."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        from tests.trace_equality import key_averages_table
        from trainers.reference.model import ModelConfig, sft_batch, sft_corpus

        corpus, seq = sft_corpus(), ModelConfig().seq_len
        with profile(
            activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=with_stack
        ) as prof:
            for step in range(steps):
                rows = sft_batch(corpus, step, 8, seq, 0)
                self.sft_step(rows)
                adv = torch.linspace(-1, 1, rows.shape[0])
                self.rl_step(rows, adv)
                prof.step()
        prof.export_chrome_trace(path)
        try:
            return key_averages_table(prof)
        except UnicodeDecodeError as exc:  # torch 2.13 on some with_stack windows
            return {"key_averages failed": str(exc)}


class SlowOpPolicyWorker(PolicyWorker):
    """A reference policy rank whose step also runs one op of its own (``torch.special.i0``
    on a cache-sized buffer, twice per row of its batch: about 45% of the busy time, a fifth of
    the step, scaling with the batch and compute-bound) that a test can make slower."""

    def sft_step_and_op(self, rows, op_scale: float) -> float:
        import torch

        loss = self.sft_step(rows)
        if getattr(self, "_buf", None) is None:
            self._buf, self._out = torch.rand(8192), torch.empty(8192)
        for _ in range(round(2 * len(rows) * op_scale)):
            torch.special.i0(self._buf, out=self._out)
        return loss


@contextlib.contextmanager
def gloo_pair(ray: Any, worker_cls: type) -> Iterator[list[Any]]:
    """Two ranks of a reference policy worker class in one gloo group, killed after."""
    workers = make_policy_group(2, worker_cls=worker_cls)
    try:
        yield workers
    finally:
        for w in workers:
            ray.kill(w)


class LeakyWorker(ToyWorker):
    """A ToyWorker that can leak host memory at a known rate, or rise once and stay."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[bytes] = []
        self.leak_from: float | None = None

    def leaky_step(self, bytes_per_s: int, rise_bytes: int = 0) -> int:
        """One training step, then keep what the rate owes since the first leaky step
        (touched, so resident) and, once, ``rise_bytes``; the bytes kept."""
        import time

        self.train_step()
        time.sleep(0.05)
        now = time.monotonic()
        if self.leak_from is None:
            self.leak_from = now
        owed = int(bytes_per_s * (now - self.leak_from)) - sum(len(b) for b in self.kept)
        if owed > 0:
            self.kept.append(b"x" * owed)
        if rise_bytes and not getattr(self, "risen", False):
            self.risen = b"y" * rise_bytes
        return sum(len(b) for b in self.kept)

    def reset(self) -> bool:
        self.kept, self.leak_from = [], None
        if hasattr(self, "risen"):
            del self.risen
        return super().reset()

    def fake_cuda_snapshots(self, rank: int, out_dir: str, on: list[str]) -> bool:
        """Arm this rank's CUDA memory snapshots with torch's CUDA memory calls replaced (this
        machine has no GPU; the only mocking: the GPU calls)."""
        from pathlib import Path

        import torch

        from coordinator.core.memory_config import MemorySnapshot
        from worker_ext.rank import memory_snapshot as ms

        class FakeCudaMemory:
            def _record_memory_history(self, *args: object, **kwargs: object) -> None:
                return None

            def _dump_snapshot(self, path: str) -> None:
                Path(path).write_bytes(b"snapshot")

        ms._cuda_memory = FakeCudaMemory  # type: ignore[assignment]
        self.oom_observers: list = []
        torch._C._cuda_attach_out_of_memory_observer = self.oom_observers.append  # type: ignore[attr-defined]
        self.snapshots = ms.MemorySnapshots(MemorySnapshot(on=on).validate(), "cuda", rank, out_dir)
        return True

    def fake_oom(self) -> int:
        """What the CUDA allocator does on an OOM: call its observers, then raise."""
        for observer in self.oom_observers:
            observer(0, 8 << 30, 70 << 30, 1 << 20)
        return len(self.oom_observers)


class LatePolicyWorker(PolicyWorker):
    """A reference policy rank that can arrive late at its step's gradient all-reduce: it
    sleeps ``late_s`` after its forward pass, before the backward pass and the collective."""

    late_s = 0.0

    def set_late(self, late_s: float) -> bool:
        self.late_s = late_s
        return True

    def _update(self, loss: Any) -> None:
        if self.late_s:
            import time

            time.sleep(self.late_s)
        super()._update(loss)
