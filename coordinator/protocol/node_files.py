"""Opening the node-local files of ``node_dir``'s folders: never through a link, and only what is
this user's own, of the kind expected (a file, or a named pipe).

The folders are private already; these checks are the second wall, for a folder moved by a
variable or made before it was private: a link planted at a rank's pid name is never followed
(``O_NOFOLLOW``), a file or pipe of another user is refused, and a pipe that turns out to be a
plain file is never written (a non-blocking open of a file succeeds: ``fstat`` tells).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from pathlib import Path

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def _checked(fd: int, path: str | Path, is_kind: Callable[[int], bool], kind: str) -> int:
    """``fd`` when it is a ``kind`` of this user's, else closed and a PermissionError."""
    st = os.fstat(fd)
    if is_kind(st.st_mode) and st.st_uid == os.getuid():
        return fd
    os.close(fd)
    raise PermissionError(f"{path} is not a {kind} of this user's: refused")


def open_own(path: str | Path, flags: int, mode: int = 0o600) -> int:
    """A descriptor of the regular file ``path`` (``flags`` as ``os.open``; made with ``mode``
    under ``O_CREAT``), never through a link (OSError), and refused (PermissionError) when it
    is not a file or belongs to another user."""
    # O_NONBLOCK: a pipe planted at a file's name must not hang the open (it is refused after).
    fd = os.open(path, flags | _NOFOLLOW | os.O_NONBLOCK, mode)
    return _checked(fd, path, stat.S_ISREG, "file")


def append_line(path: str | Path, line: str) -> None:
    """``line`` and a newline appended to ``path`` (made 0600 when missing; see ``open_own``)."""
    fd = open_own(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def write_pipe(path: str | Path, data: bytes) -> None:
    """``data`` into the named pipe ``path``, whose reader must be there already (ENXIO when
    none is); refused (PermissionError) when ``path`` is a link, not a pipe, or another user's."""
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | _NOFOLLOW)
    fd = _checked(fd, path, stat.S_ISFIFO, "named pipe")
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def make_pipe(path: str | Path) -> int:
    """A new named pipe at ``path`` (0600; whatever was there is replaced), opened read-write so
    that it always has a reader and never reads an end of file; its descriptor."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.mkfifo(path, 0o600)
    return _checked(os.open(path, os.O_RDWR | _NOFOLLOW), path, stat.S_ISFIFO, "named pipe")
