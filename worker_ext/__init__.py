"""What runs inside a training rank: the torch.profiler wrapper and the actor mixin.

``ProfilerWorkerMixin`` imports without torch; ``RankProfiler`` loads torch on first use. Both
are imported on first use: the node agent's modules (``worker_ext.agent``) need neither.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker_ext.rank.mixin import ProfilerWorkerMixin
    from worker_ext.rank.rank_profiler import RankProfiler

__all__ = ["ProfilerWorkerMixin", "RankProfiler", "kineto_env"]


def __getattr__(name: str) -> Any:
    if name == "ProfilerWorkerMixin":
        from worker_ext.rank.mixin import ProfilerWorkerMixin

        return ProfilerWorkerMixin
    if name == "RankProfiler":
        from worker_ext.rank.rank_profiler import RankProfiler

        return RankProfiler
    if name == "kineto_env":
        from worker_ext.agent.kineto_ipc import kineto_env

        return kineto_env
    raise AttributeError(f"module 'worker_ext' has no attribute {name!r}")
