"""Ray's internal key-value store as a back end of the coordinator's one store: the same files
as a record directory (``RecordStore``'s interface), each under one key.

Why Ray's KV for a restart: it is reachable from whichever node Ray restarts the coordinator
on, a write costs about a millisecond, and it lives exactly as long as the cluster the
coordinator belongs to. It does not survive a restart of the head node's GCS, and neither does
the detached coordinator it serves: ``save_path`` (fsspec) is the back end that outlives it.
"""

from __future__ import annotations

from urllib.parse import quote

KV_NAMESPACE = "ray_profiler"


def key_part(part: str) -> str:
    """``part`` as one component of a key: ``/`` (and ``%``, the escape) percent-encoded, so
    that no two lists of parts make the same prefix (namespace ``a/b`` with name ``c`` is not
    namespace ``a`` with name ``b/c``)."""
    return quote(part, safe="")


class KVStore:
    """The files under ``parts`` (``namespace, name``, or a run's ``..., "runs", run``) in
    Ray's internal key-value store: each part one component of the keys (``key_part``)."""

    def __init__(self, *parts: str) -> None:
        if not parts:
            raise ValueError("a KV store needs at least one part")
        self.prefix = "/".join(key_part(p) for p in parts)
        self.url = f"kv://{KV_NAMESPACE}/{self.prefix}"
        self.options: dict[str, str] = {}

    def _key(self, rel: str) -> bytes:
        return f"{self.prefix}/{rel}".encode()

    def put(self, rel: str, blob: bytes) -> None:
        """Write ``blob`` as ``rel``, replacing it whole."""
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(self._key(rel), blob, overwrite=True, namespace=KV_NAMESPACE)

    def get(self, rel: str, limit: int) -> bytes | None:
        """``rel``'s bytes, or None; ValueError over ``limit``."""
        from ray.experimental import internal_kv

        blob = internal_kv._internal_kv_get(self._key(rel), namespace=KV_NAMESPACE)
        if blob is None:
            return None
        if len(blob) > limit:
            raise ValueError(f"{self.url}/{rel}: {len(blob)} bytes, over the {limit} read")
        return bytes(blob)

    def exists(self, rel: str) -> bool:
        from ray.experimental import internal_kv

        return bool(internal_kv._internal_kv_exists(self._key(rel), namespace=KV_NAMESPACE))

    def delete(self, rel: str) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(self._key(rel), namespace=KV_NAMESPACE)

    def names(self, sub: str) -> list[str]:
        """The file names directly in ``sub``, sorted."""
        from ray.experimental import internal_kv

        start = self._key(sub) + b"/"
        keys = internal_kv._internal_kv_list(start, namespace=KV_NAMESPACE)
        found = {k[len(start) :].decode() for k in keys if k.startswith(start)}
        return sorted(n for n in found if n and "/" not in n)

    def clear(self) -> None:
        """Forget every file under the prefix (a coordinator created anew starts clean); only
        under it: coordinator ``x``'s files are not ``x-2``'s (the ``/`` ends the prefix)."""
        from ray.experimental import internal_kv

        start = self.prefix.encode() + b"/"
        for key in internal_kv._internal_kv_list(start, namespace=KV_NAMESPACE):
            if key.startswith(start):
                internal_kv._internal_kv_del(key, namespace=KV_NAMESPACE)
