"""Training-loop hooks, reference trainers and the demo.

``ProfilingHooks`` (a single controller's loop) and ``RankSession`` (each rank of an SPMD loop)
import neither torch nor Ray until attached with profiling enabled.
"""

from trainers.hooks import ProfilingHooks
from worker_ext.rank.rank_session import RankSession

__all__ = ["ProfilingHooks", "RankSession"]
