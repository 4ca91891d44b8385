"""The RPCs the coordinator calls on every profiled rank, declared once.

``worker_ext.rank.mixin.ProfilerWorkerMixin`` implements them inside a training rank; the
coordinator's handle stubs (``coordinator.raylink.handle_stubs``) inherit these signatures so
that Ray can build a worker handle's method table without importing the worker's class (and
with it torch). The names are the seed's and stay: ``start_profile`` starts a window,
``profile_step`` steps it, ``stop_profile`` stops it early.
"""

from __future__ import annotations

from typing import Any

from coordinator.protocol.replies import RankReply

RANK_RPCS = (
    "configure_profiler",
    "start_profile",
    "profile_step",
    "stop_profile",
    "dump_profiler_summary",
)


class RankRPC:
    """The signatures of the rank RPCs; every one answers a ``RankReply`` and never raises a
    profiling fault."""

    def configure_profiler(
        self,
        rank: int,
        config: dict[str, Any],
        run_dir: str | None,
        warm_up: bool = True,
        report_to: dict[str, str] | None = None,
        role: str = "policy",
    ) -> RankReply:
        """Set the rank's global rank, config and run directory; ``report_to`` names the
        coordinator (``name``, ``namespace``, ``trainer_id``, ``run``) its node agent pushes
        summaries to; ``role`` is its trainer's role (it selects the rank with the config's
        ``roles``, and names the rank's sub-directory in each window)."""
        raise NotImplementedError

    def start_profile(self, window: dict[str, Any], step: int) -> RankReply:
        """Start ``window`` (``Window.to_dict()``); ``step`` is the next training step to run."""
        raise NotImplementedError

    def profile_step(self, step: int) -> RankReply:
        """Global step ``step`` has finished; the window stops after its last step."""
        raise NotImplementedError

    def stop_profile(self) -> RankReply:
        """Stop an open window now (partial). Safe to call any number of times."""
        raise NotImplementedError

    def dump_profiler_summary(self, wait_s: float = 0.0) -> RankReply:
        """The reply with every ready summary; waits up to ``wait_s`` for pending ones."""
        raise NotImplementedError
