"""What runs inside a training rank: the actor mixin, ``RankProfiler`` (the only code that
touches ``torch.profiler``), the hand-off of closed traces and the link to the node agent."""
