"""Receive actor handles without loading the actors' code.

Ray builds an actor handle's method table by loading the actor's class, which imports the
actor's module (a training worker's brings torch) into the process that receives the handle.
The coordinator and the node agents only ever call the rank RPCs (``protocol.rank_rpc``) and the
agent RPCs (``protocol.agent_rpc``) on foreign actors, so in their processes every actor class
whose module they do not own resolves to a stub that has exactly those methods, with the same
signatures as the classes that implement them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from coordinator.protocol.agent_rpc import AgentRPC
from coordinator.protocol.rank_rpc import RankRPC

log = logging.getLogger(__name__)


class ForeignActorStub(RankRPC, AgentRPC):
    """Stands in for any foreign actor class (a rank, a node agent) in this process."""

    def __ray_ready__(self) -> bool:  # every Ray actor has it; the liveness check calls it
        return True


def install_handle_stubs(own: Sequence[str] = ("coordinator.",)) -> bool:
    """Make handles deserialised in this process use ``ForeignActorStub``, except for classes
    whose module starts with one of ``own`` (loaded for real); True on success."""
    try:
        import ray

        manager = ray._private.worker.global_worker.function_actor_manager
        loaded = manager._loaded_actor_classes
        real_load = manager.load_actor_class
    except Exception:  # a Ray without these internals: handles then load the real class
        log.warning("cannot install actor handle stubs; foreign actors' modules will be imported")
        return False
    if getattr(real_load, "_profiler_stub", False):
        return True
    prefixes = tuple(own)

    def load_actor_class(job_id: Any, descriptor: Any) -> type:
        cached = loaded.get(descriptor.function_id)
        if cached is not None:
            return cached  # type: ignore[no-any-return]
        if str(getattr(descriptor, "module_name", "")).startswith(prefixes):
            return real_load(job_id, descriptor)  # type: ignore[no-any-return]
        return ForeignActorStub

    load_actor_class._profiler_stub = True  # type: ignore[attr-defined]
    manager.load_actor_class = load_actor_class
    return True
