"""Training-loop hooks, reference trainers and the demo.

``ProfilingHooks`` imports neither torch nor Ray until it is attached with profiling enabled.
"""

from trainers.hooks import ProfilingHooks

__all__ = ["ProfilingHooks"]
