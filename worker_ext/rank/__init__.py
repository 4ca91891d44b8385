"""What runs inside a training rank: the actor mixin, ``RankProfiler`` (with ``torch_session``,
the project's only driver of ``torch.profiler``), the hand-off of closed traces and the link to
the node agent."""
