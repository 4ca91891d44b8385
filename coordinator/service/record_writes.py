"""The record's writes: queued by the event loop, encoded and written on one thread, retried.

A file queued again before it was written is written once, as it is last (``run.msgpack``
every few seconds, a growing phase chunk). A failed write stays queued and that file alone is
tried again after 1, 2, 4 ... 60 s; the files queued behind it are written meanwhile, so one
file that always fails never holds the others back. The failure is shown in
``status()["record"]`` while any file is failing. A file the queue has no room for is refused
(``queue`` returns False and counts it in ``dropped``): its caller queues it again later and
never takes it as written; ``on_written`` says when a file is really written. Nothing here
ever waits for storage on the event loop; what waits is this module's one thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)
MAX_PENDING_FILES = 4096
"""Files queued beyond which new ones are refused (counted in ``dropped``): storage down for a
long time must not take the coordinator's memory with it."""
RETRY_MAX_S = 60.0

Blob = Callable[[], bytes | None]
"""A file's bytes, made on the writer's thread (encoding a large window takes milliseconds);
None removes the file."""


class Store(Protocol):
    """A back end of the store: a record directory (``RecordStore``: local or fsspec) or
    Ray's key-value store (``KVStore``)."""

    url: str

    def put(self, rel: str, blob: bytes) -> None: ...
    def delete(self, rel: str) -> None: ...


Key = tuple[str, str]  # (the store's url, the file's name in it)


@dataclass
class _Pending:
    """One file waiting to be written, and how its tries have gone."""

    store: Store
    blob: Blob
    on_written: Callable[[], None] | None
    failures: int = 0  # in a row
    retry_at: float = 0.0  # (time.monotonic) not tried again before this
    error: str | None = None


class RecordWrites:
    """See the module docstring. ``stats()`` is ``status()["record"]``'s figures."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: collections.OrderedDict[Key, _Pending] = collections.OrderedDict()
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "profiler-record")
        self._busy = False
        self.accepted = 0
        """Files queued so far (a caller can tell whether something it did queued any)."""
        self._stats: dict[str, Any] = {"files": 0, "bytes": 0, "failures": 0, "dropped": 0,
                                       "at": None}  # fmt: skip

    def queue(
        self,
        store: Store,
        rel: str,
        blob: Blob,
        on_written: Callable[[], None] | None = None,
    ) -> bool:
        """Write ``blob()`` as ``rel`` of ``store`` soon (replacing a queued write of it, whose
        back-off it keeps); False, and nothing queued, when the queue is full. ``on_written``
        runs on the writer's thread once this version of the file is written."""
        key = (store.url, rel)
        with self._lock:
            was = self._queue.get(key)
            if was is None and len(self._queue) >= MAX_PENDING_FILES:
                self._stats["dropped"] += 1
                return False
            entry = _Pending(store, blob, on_written)
            if was is not None:
                entry.failures, entry.retry_at, entry.error = was.failures, was.retry_at, was.error
            self._queue[key] = entry
            self._queue.move_to_end(key)
            self.accepted += 1
        self.kick()
        return True

    def kick(self) -> None:
        """Start writing what is due, unless a write is under way."""
        with self._lock:
            if self._busy or self._next_due() is None:
                return
            self._busy = True
        self._thread.submit(self._drain)

    def _next_due(self) -> tuple[Key, _Pending] | None:
        """The first queued file whose retry is due (under the lock)."""
        now = time.monotonic()
        return next(((k, p) for k, p in self._queue.items() if p.retry_at <= now), None)

    def _drain(self) -> None:
        while True:
            with self._lock:
                due = self._next_due()
                if due is None:
                    self._busy = False
                    return
            key, entry = due
            try:
                data = entry.blob()
                if data is None:
                    entry.store.delete(key[1])
                else:
                    entry.store.put(key[1], data)
            except Exception as exc:
                self._failed(key, entry, exc)
                continue
            with self._lock:
                if self._queue.get(key) is entry:  # (not queued again since)
                    del self._queue[key]
                else:  # a newer version waits: its tries start afresh
                    newer = self._queue.get(key)
                    if newer is not None:
                        newer.failures, newer.retry_at, newer.error = 0, 0.0, None
                self._stats["files"] += 1
                self._stats["bytes"] += len(data or b"")
                self._stats["at"] = time.time()
            if entry.on_written is not None:
                try:
                    entry.on_written()
                except Exception:
                    log.exception("after writing %s/%s", *key)

    def _failed(self, key: Key, entry: _Pending, exc: Exception) -> None:
        error = f"{key[0]}/{key[1]}: {type(exc).__name__}: {exc}"[:500]
        with self._lock:
            entry.failures += 1
            entry.error = error
            entry.retry_at = time.monotonic() + min(RETRY_MAX_S, 2.0 ** (entry.failures - 1))
            newer = self._queue.get(key)
            if newer is not None and newer is not entry:  # (queued again while it was tried)
                newer.failures, newer.retry_at, newer.error = (
                    entry.failures, entry.retry_at, error
                )  # fmt: skip
            self._stats["failures"] += 1
        if entry.failures == 1 or entry.failures % 10 == 0:
            log.warning("the run's record could not be written: %s", error)

    def stats(self) -> dict[str, Any]:
        """The figures, ``pending`` files, the latest ``error`` of a file still failing, and
        when the next retry is due."""
        with self._lock:
            failing = [p for p in self._queue.values() if p.failures]
            latest = max(failing, key=lambda p: p.retry_at, default=None)
            soonest = min((p.retry_at for p in failing), default=None)
            retry = None if soonest is None else max(0.0, soonest - time.monotonic())
            return {
                **self._stats,
                "error": latest.error if latest is not None else None,
                "pending": len(self._queue),
                "retry_in_s": round(retry, 1) if retry is not None else None,
            }

    def flush(self, timeout_s: float) -> bool:
        """Write what is queued, within ``timeout_s``: every file is tried at once (a failing
        one once more, then on its back-off as usual); whether nothing is left (a run's stop,
        tests)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            now = time.monotonic()
            for p in self._queue.values():
                p.retry_at = min(p.retry_at, now)
        while True:
            self.kick()
            with self._lock:
                if not self._queue and not self._busy:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
