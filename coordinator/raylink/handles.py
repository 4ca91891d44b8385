"""Actor handles as bytes, the way Ray itself serializes them out of band (what pickling a
handle does, without pickle): for the trainers' registrations a restarted coordinator reads
back from Ray's key-value store."""

from __future__ import annotations

from typing import Any

import msgspec


def dump_handle(handle: Any) -> bytes:
    """``handle`` as Ray's own serialized form (in a process connected to Ray)."""
    serialized, _, weak_ref = handle._serialization_helper()
    return msgspec.msgpack.encode([bytes(serialized), bool(weak_ref)])


def load_handle(blob: bytes) -> Any:
    """The handle ``dump_handle`` made (in a process of the same cluster)."""
    from ray.actor import ActorHandle

    serialized, weak_ref = msgspec.msgpack.decode(blob, type=tuple[bytes, bool])
    return ActorHandle._deserialization_helper(serialized, weak_ref, None)
