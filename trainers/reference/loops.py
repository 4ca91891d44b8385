"""Four reference trainers on real Ray policy workers, each reaching the profiler only via hooks.

- ``run_sft``: next-byte loss on a small corpus.
- ``run_sync_rl``: a rollout actor samples from a policy snapshot, a reward scores it, the policy
  ranks take a GRPO-style step, and the weights sync back.
- ``run_one_step_async_rl``: generation of batch k+1 overlaps training on batch k (asyncio).
- ``run_fully_async_rl``: generation workers run continuously into a buffer bounded by a
  staleness limit; one global step is one policy update plus one weight sync, and generation
  pauses only for the sync.

The RL trainers register their rollout workers as role ``rollout`` (``hooks.add_role``): the
config's ``roles: {rollout: {ranks: [0]}}`` profiles them on the policy's global steps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from trainers.hooks import ProfilingHooks
from trainers.reference.model import ModelConfig, sft_batch, sft_corpus
from trainers.reference.workers import grpo_advantages

Log = Callable[[int, str, float, float, str], None]


@dataclass
class RunConfig:
    steps: int = 12
    first_step: int = 0
    seed: int = 0
    batch: int = 16
    prompts: int = 8
    group: int = 8
    new_tokens: int = 8
    max_staleness: int = 1
    buffer_batches: int = 2


@dataclass
class RunResult:
    trainer: str
    metric: str
    values: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def _quiet(step: int, metric: str, value: float, seconds: float, phase: str) -> None:
    pass


def _record(result: RunResult, log: Log, phase: str, step: int, value, t0) -> None:
    dt = time.perf_counter() - t0
    result.values.append(float(value))
    result.step_s.append(dt)
    log(step, result.metric, float(value), dt, phase)


def run_sft(hooks: ProfilingHooks, policy: list[Any], rc: RunConfig, log: Log = _quiet):
    """Supervised next-byte training; returns the mean loss per step."""
    corpus = sft_corpus()
    seq = ModelConfig().seq_len
    result = RunResult("sft", "loss")
    with hooks.session(first_step=rc.first_step):
        for step in range(rc.first_step, rc.first_step + rc.steps):
            t0, phase = time.perf_counter(), hooks.phase  # what this step does
            with hooks.region("train"):
                rows = sft_batch(corpus, step, rc.batch, seq, rc.seed)
                losses = ray.get([w.sft_step.remote(rows) for w in policy])
            hooks.step(step)
            _record(result, log, phase, step, sum(losses) / len(losses), t0)
    return result


def _rl_update(policy: list[Any], batch: dict[str, Any]) -> Any:
    adv = grpo_advantages(batch["rewards"], batch["group"])
    return [w.rl_step.remote(batch["rows"], adv) for w in policy]


def _sync_weights(policy: list[Any], rollouts: list[Any], version: int) -> list[Any]:
    weights = policy[0].get_weights.remote()
    return [r.set_weights.remote(weights, version) for r in rollouts]


def run_sync_rl(
    hooks: ProfilingHooks,
    policy: list[Any],
    rollout: Any,
    rc: RunConfig,
    log: Log = _quiet,
) -> RunResult:
    """Generate, score, update, sync: strictly in that order; returns mean reward per step."""
    result = RunResult("rl", "reward")
    hooks.add_role("rollout", [rollout])
    ray.get(_sync_weights(policy, [rollout], 0))
    with hooks.session(first_step=rc.first_step):
        for step in range(rc.first_step, rc.first_step + rc.steps):
            t0, phase = time.perf_counter(), hooks.phase  # what this step does
            with hooks.region("generate"):
                batch = ray.get(
                    rollout.generate.remote(step, rc.prompts, rc.group, rc.new_tokens, rc.seed)
                )
            with hooks.region("train"):
                ray.get(_rl_update(policy, batch))
            with hooks.region("weight_sync"):
                ray.get(_sync_weights(policy, [rollout], step + 1))
            hooks.step(step)
            _record(result, log, phase, step, batch["rewards"].mean(), t0)
    return result


async def run_one_step_async_rl(
    hooks: ProfilingHooks,
    policy: list[Any],
    rollout: Any,
    rc: RunConfig,
    log: Log = _quiet,
) -> RunResult:
    """Batch k+1 is generated (with the weights before update k) while the ranks train on k.

    Each batch's weights and seed are fixed by construction, so the run is deterministic.
    """
    result = RunResult("async", "reward")
    await asyncio.to_thread(hooks.add_role, "rollout", [rollout])
    await asyncio.gather(*_sync_weights(policy, [rollout], 0))
    first = rc.first_step
    nxt = rollout.generate.remote(first, rc.prompts, rc.group, rc.new_tokens, rc.seed)
    async with hooks.session(first_step=first):
        for step in range(first, first + rc.steps):
            t0, phase = time.perf_counter(), hooks.phase  # what this step does
            async with hooks.region("generate"):  # what generation did not overlap
                batch = await nxt
            if step + 1 < first + rc.steps:  # overlaps the update below
                nxt = rollout.generate.remote(
                    step + 1, rc.prompts, rc.group, rc.new_tokens, rc.seed
                )
            async with hooks.region("train"):
                await asyncio.gather(*_rl_update(policy, batch))
            async with hooks.region("weight_sync"):
                await asyncio.gather(*_sync_weights(policy, [rollout], step + 1))
            await hooks.astep(step)
            _record(result, log, phase, step, batch["rewards"].mean(), t0)
    return result


class _Generation:
    """Generation running continuously on every rollout worker into a bounded buffer, paused
    only while the weights sync."""

    def __init__(self, rollouts: list[Any], rc: RunConfig) -> None:
        self.rollouts, self.rc = rollouts, rc
        self.items: asyncio.Queue[dict[str, Any]] = asyncio.Queue(rc.buffer_batches)
        self.dropped_stale = 0
        self.running = asyncio.Event()
        self.running.set()
        self.stopping = asyncio.Event()
        self.in_flight = 0
        self.idle = asyncio.Condition()
        self.version0: dict[str, list[float]] = {}
        self.tasks: list[asyncio.Future[None]] = []

    def start(self) -> None:
        self.tasks = [
            asyncio.ensure_future(self._forever(i, w)) for i, w in enumerate(self.rollouts)
        ]

    async def _forever(self, i: int, worker: Any) -> None:
        rc, request = self.rc, 0
        while not self.stopping.is_set():
            await self.running.wait()
            self.in_flight += 1
            try:
                batch = await worker.generate.remote(
                    request, rc.prompts, rc.group, rc.new_tokens, rc.seed
                )
            finally:
                self.in_flight -= 1
                async with self.idle:
                    self.idle.notify_all()
            if batch["version"] == 0:
                self.version0[f"{i}:{request}"] = batch["rewards"].tolist()
            request += 1
            await self.items.put(batch)

    async def fresh_batch(self, version: int) -> dict[str, Any]:
        """The next batch at most ``max_staleness`` versions old; older ones are dropped."""
        while True:
            batch = await self.items.get()
            if version - batch["version"] <= self.rc.max_staleness:
                return batch
            self.dropped_stale += 1

    async def sync(self, policy: list[Any], version: int) -> None:
        """Pause generation, wait for requests in flight, sync the weights, resume."""
        self.running.clear()
        async with self.idle:
            await self.idle.wait_for(lambda: self.in_flight == 0)
        await asyncio.gather(*_sync_weights(policy, self.rollouts, version))
        self.running.set()

    async def stop(self) -> None:
        self.stopping.set()
        self.running.set()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def run_fully_async_rl(
    hooks: ProfilingHooks,
    policy: list[Any],
    rollouts: list[Any],
    rc: RunConfig,
    log: Log = _quiet,
) -> RunResult:
    """Generation runs continuously on every rollout worker; the trainer consumes the buffer.

    One global step = one policy update + one weight sync. Generation pauses only while the
    weights sync. Batches older than ``max_staleness`` versions are dropped, never trained on.
    """
    result = RunResult("fully-async", "reward")
    await asyncio.to_thread(hooks.add_role, "rollout", rollouts)
    version = 0
    await asyncio.gather(*_sync_weights(policy, rollouts, version))
    gen = _Generation(rollouts, rc)
    used: list[tuple[int, int, int]] = []
    gen.start()
    try:
        async with hooks.session(first_step=rc.first_step):
            for step in range(rc.first_step, rc.first_step + rc.steps):
                t0, phase = time.perf_counter(), hooks.phase  # what this step does
                async with hooks.region("generate"):  # waiting for the buffer
                    batch = await gen.fresh_batch(version)
                used.append((batch["worker_id"], batch["request_id"], batch["version"]))
                async with hooks.region("train"):
                    await asyncio.gather(*_rl_update(policy, batch))
                version += 1
                async with hooks.region("weight_sync"):
                    await gen.sync(policy, version)
                await hooks.astep(step)
                _record(result, log, phase, step, batch["rewards"].mean(), t0)
    finally:
        await gen.stop()
    result.extra = {
        "version0_rewards": gen.version0,
        "used": used,
        "dropped_stale": gen.dropped_stale,
        "final_version": version,
    }
    return result


def reset_workers(policy: list[Any], rollouts: list[Any], seed: int) -> None:
    """Same starting weights everywhere, so two runs can be compared step for step."""
    ray.get([w.reset.remote(seed) for w in policy])
    ray.get(_sync_weights(policy, rollouts, 0))


def mean(xs: list[float]) -> float:
    return float(torch.tensor(xs).mean()) if xs else float("nan")
