"""What runs inside a training rank: the torch.profiler wrapper and the actor mixin.

``ProfilerWorkerMixin`` imports without torch; ``RankProfiler`` loads torch on first use.
"""

from typing import Any

from worker_ext.rank.mixin import ProfilerWorkerMixin

__all__ = ["ProfilerWorkerMixin", "RankProfiler"]


def __getattr__(name: str) -> Any:
    if name == "RankProfiler":
        from worker_ext.rank.rank_profiler import RankProfiler

        return RankProfiler
    raise AttributeError(f"module 'worker_ext' has no attribute {name!r}")
