"""What runs inside the coordinator actor: the actor, its parts, its calls to ranks, the
checkpoint, the metrics and the handle stubs. Never imports torch or ``worker_ext``."""
