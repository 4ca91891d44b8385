"""Where a run's record is: a directory or an fsspec URL, its files read and written whole.

A local file is written beside its final name and renamed into place, so a reader never sees
half a file, and it is on disk before it is renamed (``atomic_file``'s ``durable``: a power
loss does not leave an empty window file); an object store's put is whole by itself. Local
files are ``RECORD_MODE``: readable by this user alone. No Ray: the CLI reads records with it.
"""

from __future__ import annotations

import os
import stat
from typing import Any

from coordinator.core import storage
from coordinator.protocol.atomic_file import write_atomic

SAVE_PATH_ENV = "RAY_PROFILER_SAVE_PATH"
"""Where a run named alone (``--from RUN``, ``diff RUN:3 ...``) is looked for when no
coordinator says (its ``save_path``)."""
RECORD_DIR = "record"
"""The record's directory in a run's directory: ``{save_path}/{run}/record/``."""
RECORD_MODE = 0o600
"""A local record file's mode: the run's config, kernels and stalls are this user's alone
(share a record with ``chmod``, or through the web view and its token)."""


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
        write_atomic(path, blob, RECORD_MODE, durable=True)

    def get(self, rel: str, limit: int) -> bytes | None:
        """``rel``'s bytes, or None when there is no such file; ValueError over ``limit``."""
        fs, path = self._where(rel)
        if fs is None:
            return _read_local(path, limit, f"{self.url}/{rel}")
        try:
            size = int(fs.size(path))
        except FileNotFoundError:
            return None
        if size > limit:
            raise ValueError(f"{self.url}/{rel}: {size} bytes, over the {limit} read")
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


def _read_local(path: str, limit: int, where: str) -> bytes | None:
    """A local record file's bytes (None when it is not there): a regular file, not a link, of
    at most ``limit`` bytes; ValueError for one over it, or one that grew while it was read
    (ours are renamed into place whole). Read with one buffer of its size (``read(limit)``
    would take ``limit`` bytes of memory first, whatever the file's size)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:  # (ELOOP: a link where a record file should be)
        raise ValueError(f"{where}: cannot be read as a record file ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{where}: not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{where}: {st.st_size} bytes, over the {limit} read")
        if len(blob := f.read(st.st_size + 1)) > st.st_size:
            raise ValueError(f"{where}: it grew while it was read (not a whole record file)")
    return blob


def record_url(run_dir: str) -> str:
    """The record directory of the run whose directory is ``run_dir``."""
    return storage.join(run_dir, RECORD_DIR)
