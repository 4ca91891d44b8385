"""Where an attached process is and who it is among its peers, from what the process already
has loaded (``torch.distributed``, Ray Train) and from Ray's actor table: read by the attach
hook's first step and by SkyRL's coordinated profiler, never importing torch or Ray Train."""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

from coordinator.core.attach import Identity


def process_where(who: Identity | None = None) -> dict[str, Any]:
    """This process: pid, node, job, actor class (and its rank, once known)."""
    out: dict[str, Any] = {"pid": os.getpid()}
    try:
        import ray

        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            out["node_id"], out["job_id"] = ctx.get_node_id(), ctx.get_job_id()
            actor = actor_place(ctx)
            out["actor_class"] = actor[0] if actor else None
    except Exception:  # (not in Ray: the pid says enough)
        pass
    if who is not None:
        out["trainer_id"], out["rank"] = who.trainer_id, who.rank
    return out


def dist_rank() -> tuple[int, int] | None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return None


def train_rank() -> tuple[int, int, str] | None:
    train = sys.modules.get("ray.train")  # (loaded when Ray Train runs this process)
    if train is None:
        return None
    try:
        ctx = train.get_context()
        return int(ctx.get_world_rank()), int(ctx.get_world_size()), ctx.get_experiment_name()
    except Exception:  # not inside a Ray Train worker
        return None


def actor_rank() -> tuple[str, int, int] | None:
    """(class, index, count) of this actor among the job's live actors of its class, in
    actor-id order, from Ray's actor table; None outside an actor."""
    import ray

    if not ray.is_initialized():
        return None
    return actor_place(ray.get_runtime_context())


def actor_place(ctx: Any) -> tuple[str, int, int] | None:
    me = ctx.get_actor_id()
    if me is None:
        return None
    table = ray_actor_table(ctx.get_job_id())
    mine = table.get(me)
    if mine is None:
        return None
    cls = mine["ActorClassName"]
    peers = sorted(a for a, info in table.items() if info["ActorClassName"] == cls)
    return cls, peers.index(me), len(peers)


@functools.cache
def ray_actor_table(job_id: str) -> dict[str, dict[str, Any]]:
    """The job's actors not dead, by id (read once per process: the first step's)."""
    import ray

    table = ray._private.state.state.actor_table(None)
    return {
        aid: info
        for aid, info in table.items()
        if info.get("JobID") == job_id and info.get("State") != "DEAD"
    }
