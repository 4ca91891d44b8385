"""One profiled window of two reference SFT ranks on gloo, one of them late at each step's
gradient all-reduce (``LatePolicyWorker``): what the collectives and findings tests read."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from tests.configs import profiler_config
from tests.fault_cases import wait_for_windows
from trainers.hooks import ProfilingHooks
from trainers.reference.model import ModelConfig, sft_batch, sft_corpus

ACTIVE = 4


def late_window(
    ray: Any,
    workers: list[Any],
    tmp_path: Any,
    late: dict[int, float],
    read: Callable[[Any, dict[str, Any]], Any],
) -> Any:
    """One window of ``ACTIVE`` SFT steps, rank r late by ``late[r]`` s at each all-reduce;
    ``read(coordinator, status)`` once the window settled, before the coordinator is gone."""
    cfg = profiler_config(tmp_path, wait=1, warmup=1, active=ACTIVE, repeat=1, record_shapes=True)
    hooks = ProfilingHooks.attach(cfg, workers, trainer_id="sft", name=f"p-{uuid.uuid4().hex[:8]}")
    ray.get([w.set_late.remote(late.get(r, 0.0)) for r, w in enumerate(workers)])
    corpus, seq = sft_corpus(), ModelConfig().seq_len
    try:
        with hooks.session(first_step=0):
            for step in range(2 + ACTIVE + 1):
                rows = sft_batch(corpus, step, 8, seq, seed=0)
                ray.get([w.sft_step.remote(rows) for w in workers])
                hooks.step(step)
        return read(hooks.coordinator, wait_for_windows(ray, hooks.coordinator, timeout=60))
    finally:
        ray.get([w.set_late.remote(0.0) for w in workers])
        ray.kill(hooks.coordinator)
