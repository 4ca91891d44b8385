"""Where an actor's process is, from Ray's own tables (the GCS), without calling the actor: a hung
rank answers no call, but Ray still knows its pid, its node and whether it is alive.

Blocking calls: run them off the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ActorPlace:
    pid: int | None
    node_id: str | None
    alive: bool
    death: str | None  # why Ray says it died


def actor_id(handle: Any) -> str | None:
    """The hex id of an actor handle; None for anything else."""
    ident = getattr(handle, "_actor_id", None)
    return ident.hex() if ident is not None and hasattr(ident, "hex") else None


def place_actors(ids: set[str]) -> dict[str, ActorPlace]:
    """Each listed actor's pid, node and state, from one read of Ray's actor table."""
    import ray

    table = ray._private.state.state.actor_table(None)
    out: dict[str, ActorPlace] = {}
    for aid, info in table.items():
        if aid not in ids:
            continue
        addr = info.get("Address") or {}
        pid = info.get("Pid")
        out[aid] = ActorPlace(
            pid=int(pid) if pid else None,
            node_id=addr.get("NodeID") or None,
            alive=info.get("State") in ("ALIVE", "RESTARTING"),
            death=_death(info) if info.get("State") == "DEAD" else None,
        )
    return out


def _death(info: dict[str, Any]) -> str:
    cause = str(info.get("DeathCause") or "").strip()
    first = cause.splitlines()[0][:200] if cause else ""
    return f"exited ({first})" if first else "exited"


def live_nodes() -> set[str]:
    """The ids of the nodes Ray considers alive."""
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def ended_jobs(ids: set[str]) -> set[str]:
    """Those of the listed Ray jobs (hex ids) that Ray says have ended (their driver exited)."""
    import ray

    return {j["JobID"] for j in ray._private.state.state.job_table() if j["IsDead"]} & ids
