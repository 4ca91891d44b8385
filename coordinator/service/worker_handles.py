"""Keep the coordinator free of torch when it receives worker actor handles.

Ray builds an actor handle's method table by loading the actor's class, which imports the
worker's module (and with it torch) into the process that receives the handle. The coordinator
only ever calls the rank RPCs (``coordinator.protocol.rank_rpc``), so in its process every
foreign actor class resolves to a stub that has exactly those methods, with the same signatures
as ``ProfilerWorkerMixin``, which implements them.
"""

from __future__ import annotations

import logging
from typing import Any

from coordinator.protocol.rank_rpc import RankRPC

log = logging.getLogger(__name__)


class ProfilerWorkerStub(RankRPC):
    """Stands in for any worker class inside the coordinator process."""

    def __ray_ready__(self) -> bool:  # every Ray actor has it; the liveness check calls it
        return True


def install_worker_handle_stubs() -> bool:
    """Make handles deserialised in this process use ``ProfilerWorkerStub``; True on success."""
    try:
        import ray

        manager = ray._private.worker.global_worker.function_actor_manager
        loaded = manager._loaded_actor_classes
        real_load = manager.load_actor_class
    except Exception:  # a Ray without these internals: handles then load the real class
        log.warning("cannot install worker handle stubs; worker modules will be imported")
        return False
    if getattr(real_load, "_profiler_stub", False):
        return True

    def load_actor_class(job_id: Any, descriptor: Any) -> type:
        cached = loaded.get(descriptor.function_id)
        return cached if cached is not None else ProfilerWorkerStub

    load_actor_class._profiler_stub = True  # type: ignore[attr-defined]
    manager.load_actor_class = load_actor_class
    return True
