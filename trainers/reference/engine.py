"""A small generation engine with a profiler of its own, as vLLM's and SGLang's engines have,
and the rollout actor that wraps it as a rank (``EngineProfilerMixin``).

- ``TinyEngine.start_profile(output_dir=None)``: SGLang's form; it writes a gzipped chrome
  trace into ``output_dir``.
- ``FixedDirEngine.start_profile()``: vLLM's form; it writes into the directory it was built
  with (vLLM's ``VLLM_TORCH_PROFILER_DIR``), a plain chrome trace.
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray
import torch

from trainers.reference.workers import Sampler
from worker_ext.rank.engine_rank import EngineProfilerMixin


class TinyEngine:
    """Holds the model; profiles itself between ``start_profile`` and ``stop_profile``."""

    suffix = ".trace.json.gz"

    def __init__(self, model: torch.nn.Module, trace_dir: str | None = None) -> None:
        self.model = model
        self.trace_dir = trace_dir
        self._prof: Any = None
        self._out: str | None = None
        self.traces_written = 0

    def start_profile(self, output_dir: str | None = None) -> None:
        self._begin(output_dir or self.trace_dir)

    def stop_profile(self) -> None:
        prof, self._prof = self._prof, None
        if prof is None:
            raise RuntimeError("the engine's profiler is not running")
        prof.stop()
        assert self._out is not None
        os.makedirs(self._out, exist_ok=True)
        name = f"{time.time_ns()}-pid{os.getpid()}-TP-0{self.suffix}"
        prof.export_chrome_trace(os.path.join(self._out, name))
        self.traces_written += 1

    def _begin(self, out: str | None) -> None:
        if self._prof is not None:
            raise RuntimeError("the engine's profiler is already running")
        if out is None:
            raise ValueError("no directory to write the engine's trace to")
        self._out = out
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self._prof.start()


class FixedDirEngine(TinyEngine):
    """vLLM's form: ``start_profile()`` without arguments, into the directory set at start."""

    suffix = ".pt.trace.json"

    def start_profile(self) -> None:  # type: ignore[override]
        self._begin(self.trace_dir)


class EngineRolloutWorker(Sampler, EngineProfilerMixin):
    """A generation worker whose engine profiles itself: a rank of role ``rollout`` through the
    engine adapter. ``fixed_dir`` builds the vLLM-style engine writing there."""

    def __init__(self, worker_id: int, fixed_dir: str | None = None) -> None:
        super().__init__(worker_id)
        if fixed_dir is None:
            self.engine: TinyEngine = TinyEngine(self.model)
        else:
            self.engine = FixedDirEngine(self.model, fixed_dir)
            self.engine_trace_dir = fixed_dir

    def traces_written(self) -> int:
        return self.engine.traces_written


def make_engine_rollouts(n: int, fixed_dir: str | None = None) -> list[Any]:
    cls = ray.remote(num_cpus=0)(EngineRolloutWorker)
    return [cls.remote(i, fixed_dir) for i in range(n)]
