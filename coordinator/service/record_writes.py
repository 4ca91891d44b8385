"""The record's writes: queued by the event loop, encoded and written on one thread, retried.

A file queued again before it was written is written once, as it is last (``run.msgpack``
every few seconds, a growing phase chunk). A failed write stays queued and is tried again after
1, 2, 4 ... 60 s; the failure is shown in ``status()["record"]`` until a write succeeds. Nothing
here ever waits for storage on the event loop; what waits is this module's one thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from coordinator.service.record_store import RecordStore

log = logging.getLogger(__name__)
MAX_PENDING_FILES = 4096
"""Files queued beyond which new ones are dropped (counted in ``dropped``): storage down for a
long time must not take the coordinator's memory with it."""
RETRY_MAX_S = 60.0

Blob = Callable[[], bytes]
"""A file's bytes, made on the writer's thread (encoding a large window takes milliseconds)."""


class RecordWrites:
    """See the module docstring. ``stats()`` is ``status()["record"]``'s figures."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: collections.OrderedDict[tuple[str, str], tuple[RecordStore, Blob]] = (
            collections.OrderedDict()
        )
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "profiler-record")
        self._busy = False
        self._failures = 0  # in a row
        self._retry_at = 0.0
        self._stats: dict[str, Any] = {
            "files": 0,
            "bytes": 0,
            "failures": 0,
            "dropped": 0,
            "error": None,
            "at": None,
        }

    def queue(self, store: RecordStore, rel: str, blob: Blob) -> None:
        """Write ``blob()`` as ``rel`` of ``store`` soon (replacing a queued write of it)."""
        key = (store.url, rel)
        with self._lock:
            if len(self._queue) >= MAX_PENDING_FILES and key not in self._queue:
                self._stats["dropped"] += 1
                return
            self._queue[key] = (store, blob)
            self._queue.move_to_end(key)
        self.kick()

    def kick(self) -> None:
        """Start writing what is queued, unless a write is under way or a retry is not due."""
        with self._lock:
            if self._busy or not self._queue or time.monotonic() < self._retry_at:
                return
            self._busy = True
        self._thread.submit(self._drain)

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._busy = False
                    return
                key, (store, blob) = next(iter(self._queue.items()))
            try:
                data = blob()
                store.put(key[1], data)
            except Exception as exc:
                self._failed(key, exc)
                return
            with self._lock:
                if self._queue.get(key, (None, None))[1] is blob:  # (not queued again since)
                    del self._queue[key]
                self._failures, self._retry_at = 0, 0.0
                self._stats.update(error=None, at=time.time())
                self._stats["files"] += 1
                self._stats["bytes"] += len(data)

    def _failed(self, key: tuple[str, str], exc: Exception) -> None:
        with self._lock:
            self._failures += 1
            self._stats["failures"] += 1
            self._stats["error"] = f"{key[0]}/{key[1]}: {type(exc).__name__}: {exc}"[:500]
            self._retry_at = time.monotonic() + min(RETRY_MAX_S, 2.0 ** (self._failures - 1))
            self._busy = False
        log.warning("the run's record could not be written: %s", self._stats["error"])

    def stats(self) -> dict[str, Any]:
        with self._lock:
            retry = self._retry_at - time.monotonic() if self._failures else None
            return {
                **self._stats,
                "pending": len(self._queue),
                "retry_in_s": round(max(0.0, retry), 1) if retry is not None else None,
            }

    def flush(self, timeout_s: float) -> bool:
        """Write what is queued now, retries included, for at most ``timeout_s``; whether
        nothing is left (a clean shutdown, tests)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._queue and not self._busy:
                    return True
                self._retry_at = min(self._retry_at, time.monotonic())
            self.kick()
            time.sleep(0.02)
        return False
