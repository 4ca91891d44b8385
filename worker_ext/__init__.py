"""What runs inside a training rank: the torch.profiler wrapper and the actor mixin."""

from worker_ext.mixin import ProfilerWorkerMixin
from worker_ext.rank_profiler import RankProfiler

__all__ = ["ProfilerWorkerMixin", "RankProfiler"]
