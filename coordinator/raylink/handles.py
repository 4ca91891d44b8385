"""Actor handles kept by what identifies the actor, and made again from Ray's own actor table:
for the trainers' registrations a restarted coordinator reads back from Ray's key-value store.

What is stored is the actor's id (hex), never Ray's serialized handle: Ray's decoder trusts
those bytes (a short actor id aborts the process, a check in C++ and not an exception, so a
coordinator restored from them would crash at every restart; the class they name is loaded by
Ray's class loader, which unpickles). What comes back is a handle Ray makes from its own
actor table (the GCS), for an id that is 16 bytes of hex and that the table has and does not
say dead (alive, restarting, or still being created):

- a named actor: ``ray.get_actor(name, namespace)`` (Ray's public API), its id checked
  against the stored one (a name may have been taken by another actor since);
- an unnamed actor: Ray has no public way back from an id. The handle is built from the
  table's entry for that id, as Ray builds a named actor's handle from the same entry (its
  owner, job, class, name), with Ray's defaults for what only the creator knew (method
  retries, calls in flight); then registered with Ray's handle decoder. Those bytes are made
  here, from the table, never read from storage.

Either is made strong, as a handle received as an argument is: it keeps a non-detached actor
alive as the coordinator's first incarnation did (``ray.get_actor`` alone gives a weak one).
Blocking calls to the GCS: run them where blocking is fine (a restart's load).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from coordinator.raylink.actor_table import actor_id

ACTOR_ID_HEX = re.compile(r"^[0-9a-f]{32}$")
"""A Ray actor id: 16 bytes, as hex."""


def dump_handle(handle: Any) -> str:
    """What the store keeps of ``handle``: its actor id (hex)."""
    ident = actor_id(handle)
    if ident is None or not ACTOR_ID_HEX.match(ident):
        raise ValueError(f"not an actor handle: {type(handle).__name__}")
    return ident


def load_handles(ids: Iterable[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """A strong handle for each of ``ids`` that Ray's actor table has and does not say dead,
    and why not for the others (never raises for an id: a bad one is a reason)."""
    handles: dict[str, Any] = {}
    why: dict[str, str] = {}
    for ident in dict.fromkeys(ids):
        if not isinstance(ident, str) or not ACTOR_ID_HEX.match(ident):
            why[str(ident)] = "not an actor id (16 bytes of hex)"
            continue
        try:
            handles[ident] = _load(ident)
        except Exception as exc:  # (the actor is gone, or Ray refused)
            why[ident] = f"{type(exc).__name__}: {exc}"[:300]
    return handles, why


def _load(ident: str) -> Any:
    import ray
    from ray.core.generated import gcs_pb2

    blob = ray._private.state.state.get_actor_info(ray.ActorID.from_hex(ident))
    if blob is None:
        raise LookupError("Ray's actor table has no such actor")
    entry = gcs_pb2.ActorTableData.FromString(blob)
    if entry.state == gcs_pb2.ActorTableData.DEAD:  # (not: being created, alive, restarting)
        state = gcs_pb2.ActorTableData.ActorState.Name(entry.state)
        raise LookupError(f"Ray's actor table has it {state}")
    if entry.name:
        weak = ray.get_actor(entry.name, entry.ray_namespace)
        if actor_id(weak) != ident:
            raise LookupError(f"the name {entry.name!r} is another actor's now")
        serialized = weak._serialization_helper()[0]  # (made by Ray now, in this process)
    else:
        serialized = _from_table(entry)
    return ray.actor.ActorHandle._deserialization_helper(serialized, False, None)


def _from_table(entry: Any) -> bytes:
    """The handle of the unnamed actor of ``entry`` (Ray's actor table), as Ray's
    ``CreateInnerActorHandleFromActorData`` makes one from the same entry."""
    import ray
    from ray.core.generated import common_pb2, core_worker_pb2

    if not entry.function_descriptor.HasField("python_function_descriptor"):
        raise LookupError("not a Python actor")
    ident = ray.ActorID(entry.actor_id)
    creation = ray.TaskID.for_actor_creation_task(ident)
    return bytes(
        core_worker_pb2.ActorHandle(
            actor_id=entry.actor_id,
            owner_id=entry.parent_id,
            owner_address=entry.owner_address,
            creation_job_id=entry.job_id,
            actor_language=common_pb2.Language.PYTHON,
            actor_creation_task_function_descriptor=entry.function_descriptor,
            # (the creation task's first return: what Ray counts the handle's references on)
            actor_cursor=creation.binary() + (1).to_bytes(4, "little"),
            extension_data=b"0",
            max_pending_calls=-1,
            enable_task_events=True,
            is_detached=entry.is_detached,
            labels=dict(entry.labels),
            ray_namespace=entry.ray_namespace,
        ).SerializeToString()
    )
