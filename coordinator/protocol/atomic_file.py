"""Local files written whole or not at all: the one "temporary file, then rename" of the project.

A reader never sees half a file, and a planted link is never written through: the temporary
file has a random name and is made exclusively (``O_EXCL``) beside the final one, and the
rename replaces whatever is at the final name (a link included), never what a link points to.
A write that fails leaves nothing behind. (An object store's put is whole by itself: this is
for local paths.)

Whole is not durable: without ``durable=True`` the data may still be in the page cache when
the rename is, and a power loss can leave an empty file under the final name. ``durable``
flushes the file to disk before the rename and the directory after it (two ``fsync``s, about
a millisecond each on a disk); the run's record asks for it (a window file is written once,
and is the only copy of that window once the cluster is gone). Traces, plan boards and stack
dumps do not: they are remade, or worthless after a reboot.

>>> import os, tempfile
>>> d = tempfile.mkdtemp()
>>> write_atomic(os.path.join(d, "board"), b"captures")
>>> with atomic_path(os.path.join(d, "trace.json")) as tmp:
...     with open(tmp, "w") as f:
...         _ = f.write("{}")
>>> sorted(os.listdir(d)), os.stat(os.path.join(d, "board")).st_mode & 0o777 == DEFAULT_MODE
(['board', 'trace.json'], True)
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (``/proc``)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    old = os.umask(0o022)  # (elsewhere: set and put back, once, at import)
    os.umask(old)
    return old


DEFAULT_MODE = 0o666 & ~_umask()
"""The mode a finished file gets: as ``open`` would have made it (a trace, a record file); a
plan board asks for 0o600."""


@contextlib.contextmanager
def atomic_path(
    final: str | os.PathLike[str], mode: int = DEFAULT_MODE, durable: bool = False
) -> Iterator[str]:
    """A temporary path beside ``final`` for the block to write (by name: torch's export, a
    gzip stream); renamed over ``final`` with ``mode`` when the block ends, removed when it
    raises; ``durable``: on disk before the rename, the rename on disk after it (see the
    module docstring)."""
    final = os.fspath(final)
    head, name = os.path.split(final)
    fd, tmp = tempfile.mkstemp(dir=head or ".", prefix=f".{name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        os.close(fd)
        yield tmp
        if durable:
            _fsync(tmp, os.O_RDONLY)
        os.replace(tmp, final)
        if durable:
            _fsync(head or ".", os.O_RDONLY | os.O_DIRECTORY)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _fsync(path: str, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(
    final: str | os.PathLike[str],
    blob: bytes | str,
    mode: int = DEFAULT_MODE,
    durable: bool = False,
) -> None:
    """``blob`` (bytes, or text as UTF-8) at ``final``, whole or not at all (``durable``: see
    ``atomic_path``)."""
    data = blob.encode() if isinstance(blob, str) else blob
    with atomic_path(final, mode, durable) as tmp, open(tmp, "wb") as f:
        f.write(data)
