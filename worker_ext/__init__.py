"""What runs inside a training rank: the torch.profiler wrapper and the actor mixin.

``ProfilerWorkerMixin`` imports without torch; ``RankProfiler`` loads torch on first use. Both
are imported on first use: the node agent's modules (``worker_ext.agent``) need neither.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker_ext.rank.mixin import ProfilerWorkerMixin
    from worker_ext.rank.rank_profiler import RankProfiler

__all__ = ["ProfilerWorkerMixin", "RankProfiler"]


def __getattr__(name: str) -> Any:
    if name == "ProfilerWorkerMixin":
        from worker_ext.rank.mixin import ProfilerWorkerMixin

        return ProfilerWorkerMixin
    if name == "RankProfiler":
        from worker_ext.rank.rank_profiler import RankProfiler

        return RankProfiler
    raise AttributeError(f"module 'worker_ext' has no attribute {name!r}")
