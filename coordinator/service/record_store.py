"""Where a run's record is: a directory or an fsspec URL, its files read and written whole.

A local file is written beside its final name and renamed into place, so a reader never sees
half a file; an object store's put is whole by itself. No Ray: the CLI reads records with it.
"""

from __future__ import annotations

import os
from typing import Any

from coordinator.core import storage
from coordinator.protocol.atomic_file import write_atomic

SAVE_PATH_ENV = "RAY_PROFILER_SAVE_PATH"
"""Where a run named alone (``--from RUN``, ``diff RUN:3 ...``) is looked for when no
coordinator says (its ``save_path``)."""
RECORD_DIR = "record"
"""The record's directory in a run's directory: ``{save_path}/{run}/record/``."""


class RecordStore:
    """The files of one record directory (``url``: a local path, ``file://`` or any fsspec
    URL; ``storage_options`` as the config's)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/") or url
        self.remote = storage.is_remote(url)
        self.options = dict(storage_options or {})
        self._fs: tuple[Any, str] | None = None

    def _where(self, rel: str) -> tuple[Any, str]:
        parts = rel.split("/")
        if not self.remote:
            return None, os.path.join(storage.local_path(self.url), *parts)
        if self._fs is None:
            self._fs = storage.filesystem(self.url, self.options)
        fs, root = self._fs
        return fs, "/".join([root.rstrip("/"), *parts])

    def put(self, rel: str, blob: bytes) -> None:
        """Write ``blob`` as ``rel`` (``windows/000003.msgpack``), replacing it whole."""
        fs, path = self._where(rel)
        if fs is not None:
            fs.pipe_file(path, blob)
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomic(path, blob)

    def get(self, rel: str, limit: int) -> bytes | None:
        """``rel``'s bytes, or None when there is no such file; ValueError over ``limit``."""
        fs, path = self._where(rel)
        try:
            size = os.path.getsize(path) if fs is None else int(fs.size(path))
        except FileNotFoundError:
            return None
        if size > limit:
            raise ValueError(f"{self.url}/{rel}: {size} bytes, over the {limit} read")
        if fs is None:
            with open(path, "rb") as f:
                return f.read()
        return bytes(fs.cat_file(path))

    def delete(self, rel: str) -> None:
        """Remove ``rel``; nothing when it is not there."""
        fs, path = self._where(rel)
        try:
            if fs is None:
                os.unlink(path)
            else:
                fs.rm_file(path)
        except FileNotFoundError:
            pass

    def exists(self, rel: str) -> bool:
        fs, path = self._where(rel)
        return os.path.exists(path) if fs is None else bool(fs.exists(path))

    def names(self, sub: str) -> list[str]:
        """The file names in ``sub`` (``windows``), sorted; none when it does not exist."""
        fs, path = self._where(sub)
        try:
            if fs is None:
                found = os.listdir(path)
            else:
                found = [str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(n for n in found if not n.startswith("."))


def record_url(run_dir: str) -> str:
    """The record directory of the run whose directory is ``run_dir``."""
    return storage.join(run_dir, RECORD_DIR)
