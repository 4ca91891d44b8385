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

Ray's private API: the table's entry (``ray._private.state.state.get_actor_info``), the
``core_worker_pb2.ActorHandle`` message and the handle's (de)serialization helpers. Tested with
Ray 2.60.0 (``TESTED_RAY``; the project allows ray>=2.40): the message's fields that later Rays
added (``OPTIONAL_FIELDS``) are set only where this Ray's message has them, and when the private
path fails, the rank's restore problem names this Ray's version and the tested one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from coordinator.raylink.actor_table import actor_id

ACTOR_ID_HEX = re.compile(r"^[0-9a-f]{32}$")
"""A Ray actor id: 16 bytes, as hex."""
TESTED_RAY = "2.60.0"
"""The Ray whose private actor-table API this module is tested with."""
OPTIONAL_FIELDS = ("max_pending_calls", "enable_task_events", "labels")
"""``ActorHandle`` fields set only where this Ray's message has them (not every Ray's has)."""


class PrivateApiFailed(RuntimeError):
    """Ray's private actor-table path failed (a Ray other than ``TESTED_RAY``?)."""


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

    entry = _table_entry(ident)
    if entry.name:
        weak = ray.get_actor(entry.name, entry.ray_namespace)
        if actor_id(weak) != ident:
            raise LookupError(f"the name {entry.name!r} is another actor's now")
        # (made by Ray now, in this process)
        serialized = _private(lambda: weak._serialization_helper()[0])
    else:
        serialized = _private(lambda: _from_table(entry))
    return _private(lambda: ray.actor.ActorHandle._deserialization_helper(serialized, False, None))


def _table_entry(ident: str) -> Any:
    """Ray's actor table's entry for ``ident``, if it does not say dead."""
    import ray
    from ray.core.generated import gcs_pb2

    actor = ray.ActorID.from_hex(ident)
    blob = _private(lambda: ray._private.state.state.get_actor_info(actor))
    if blob is None:
        raise LookupError("Ray's actor table has no such actor")
    entry = _private(lambda: gcs_pb2.ActorTableData.FromString(blob))
    if entry.state == gcs_pb2.ActorTableData.DEAD:  # (not: being created, alive, restarting)
        state = gcs_pb2.ActorTableData.ActorState.Name(entry.state)
        raise LookupError(f"Ray's actor table has it {state}")
    return entry


def _private(call: Callable[[], Any]) -> Any:
    """``call()``, a use of Ray's private API: a failure other than ``LookupError`` (ours: the
    actor is gone) is raised as ``PrivateApiFailed``, naming this Ray's version."""
    try:
        return call()
    except LookupError:
        raise
    except Exception as exc:
        import ray

        raise PrivateApiFailed(
            f"Ray {ray.__version__}'s private actor-table API failed (tested with Ray "
            f"{TESTED_RAY}): {type(exc).__name__}: {exc}"
        ) from exc


def _has_field(message: Any, name: str) -> bool:
    """Whether the protobuf message (class or instance) ``message`` has a field ``name``."""
    return name in message.DESCRIPTOR.fields_by_name


def _from_table(entry: Any) -> bytes:
    """The handle of the unnamed actor of ``entry`` (Ray's actor table), as Ray's
    ``CreateInnerActorHandleFromActorData`` makes one from the same entry; each of
    ``OPTIONAL_FIELDS`` only where this Ray's ``ActorHandle`` has it."""
    import ray
    from ray.core.generated import common_pb2, core_worker_pb2

    if not entry.function_descriptor.HasField("python_function_descriptor"):
        raise LookupError("not a Python actor")
    ident = ray.ActorID(entry.actor_id)
    creation = ray.TaskID.for_actor_creation_task(ident)
    optional: dict[str, Callable[[], Any]] = {
        "max_pending_calls": lambda: -1,
        "enable_task_events": lambda: True,
        "labels": lambda: dict(entry.labels) if _has_field(entry, "labels") else {},
    }
    message = core_worker_pb2.ActorHandle
    fields = {name: value() for name, value in optional.items() if _has_field(message, name)}
    return bytes(
        message(
            actor_id=entry.actor_id,
            owner_id=entry.parent_id,
            owner_address=entry.owner_address,
            creation_job_id=entry.job_id,
            actor_language=common_pb2.Language.PYTHON,
            actor_creation_task_function_descriptor=entry.function_descriptor,
            # (the creation task's first return: what Ray counts the handle's references on)
            actor_cursor=creation.binary() + (1).to_bytes(4, "little"),
            extension_data=b"0",
            is_detached=entry.is_detached,
            ray_namespace=entry.ray_namespace,
            **fields,
        ).SerializeToString()
    )
