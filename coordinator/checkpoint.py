"""The coordinator's state, kept where its restart finds it: Ray's internal key-value store.

Why Ray's KV and not a file under the run directory: it is reachable from whichever node Ray
restarts the coordinator on (a run directory may be node-local, or a URL that needs credentials
and a network round trip per write), a write costs about a millisecond, and it lives exactly as
long as the cluster the coordinator belongs to. It does not survive a restart of the head node's
GCS, and neither does the detached coordinator it serves.

The checkpoint is a cloudpickle of the coordinator's runs (config, window plan, bookkeeping,
closed-window aggregates without their per-rank detail, the trainers' registrations with their
actor handles) under ``ray_profiler/<namespace>/<name>``. A step outside a window changes only
the step counters, so it rewrites only those, a few bytes under ``<name>/progress`` (the
``PROGRESS`` part), never the whole run.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

KV_NAMESPACE = "ray_profiler"
VERSION = 1
STATE, PROGRESS = "", "progress"  # the parts of a checkpoint


def _key(namespace: str, name: str, part: str) -> bytes:
    return f"{namespace}/{name}{'/' + part if part else ''}".encode()


def save(namespace: str, name: str, payload: dict[str, Any], part: str = STATE) -> int:
    """Store ``payload`` as ``part``; returns its size in bytes. Raises what Ray or pickling
    raises."""
    import ray.cloudpickle as cloudpickle
    from ray.experimental import internal_kv

    blob = cloudpickle.dumps({"version": VERSION, **payload})
    internal_kv._internal_kv_put(
        _key(namespace, name, part), blob, overwrite=True, namespace=KV_NAMESPACE
    )
    return len(blob)


def load(namespace: str, name: str, part: str = STATE) -> dict[str, Any] | None:
    """The last ``part`` stored, or None (none, unreadable, or of another version)."""
    try:
        import ray.cloudpickle as cloudpickle
        from ray.experimental import internal_kv

        blob = internal_kv._internal_kv_get(_key(namespace, name, part), namespace=KV_NAMESPACE)
        if not blob:
            return None
        payload = cloudpickle.loads(blob)
    except Exception:
        log.exception("the coordinator's checkpoint cannot be read; starting without it")
        return None
    if not isinstance(payload, dict) or payload.get("version") != VERSION:
        return None
    return payload


def delete(namespace: str, name: str) -> None:
    """Forget the checkpoint (a coordinator created anew, not restarted, starts clean)."""
    try:
        from ray.experimental import internal_kv

        for part in (STATE, PROGRESS):
            internal_kv._internal_kv_del(_key(namespace, name, part), namespace=KV_NAMESPACE)
    except Exception:
        log.debug("could not delete the coordinator's checkpoint", exc_info=True)
