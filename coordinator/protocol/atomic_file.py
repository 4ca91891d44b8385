"""Local files written whole or not at all: the one "temporary file, then rename" of the project
(and the one rename that claims a file, ``claim``).

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

Every file is made ``DEFAULT_MODE`` (0600: this user's alone, whatever the umask) unless the
caller names a mode or the user sets ``RAY_PROFILER_FILE_MODE`` (``file_mode``). The mode is
set on the temporary file before anything is written to it, and again before the rename (a
writer that writes by name may replace the temporary file with one of its own, as torch's
exporter does).

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

FILE_MODE_ENV = "RAY_PROFILER_FILE_MODE"
"""The environment variable by which a user asks for another mode than ``DEFAULT_MODE`` for
the files the profiler writes (octal, as ``chmod`` takes it: ``640``, ``0o644``); read at each
write, so it must be in the environment of the processes that write (the ranks and node agents
through the job's ``runtime_env``, the coordinator's, and the shell running the CLI)."""

DEFAULT_MODE = 0o600
"""The mode a finished file gets (a trace, a stall dump, a record file, ``collect``'s copies):
readable by this user alone, whatever the umask, unless ``FILE_MODE_ENV`` says otherwise."""


def file_mode() -> int:
    """The mode the profiler's files get: ``FILE_MODE_ENV`` where it is set, else
    ``DEFAULT_MODE``; ValueError naming the variable for a value that is not an octal mode
    that lets this user read and write its own file (``0o600`` .. ``0o777``)."""
    text = os.environ.get(FILE_MODE_ENV, "").strip()
    if not text:
        return DEFAULT_MODE
    try:
        mode = int(text.removeprefix("0o").removeprefix("0O"), 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777 or mode & 0o600 != 0o600:
        raise ValueError(
            f"{FILE_MODE_ENV}={text!r} is not a file mode: give an octal mode that lets the "
            f"owner read and write, such as 600 (the default) or 640; or unset it"
        )
    return mode


@contextlib.contextmanager
def atomic_path(
    final: str | os.PathLike[str], mode: int | None = None, durable: bool = False
) -> Iterator[str]:
    """A temporary path beside ``final`` for the block to write (by name: torch's export, a
    gzip stream); renamed over ``final`` with ``mode`` (by default ``file_mode()``) when the
    block ends, removed when it raises; ``durable``: on disk before the rename, the rename on
    disk after it (see the module docstring)."""
    final = os.fspath(final)
    mode = file_mode() if mode is None else mode
    head, name = os.path.split(final)
    fd, tmp = tempfile.mkstemp(dir=head or ".", prefix=f".{name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        os.close(fd)
        yield tmp
        _finish(tmp, mode, durable)
        os.replace(tmp, final)
        if durable:
            _fsync(head or ".", os.O_RDONLY | os.O_DIRECTORY)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _finish(tmp: str, mode: int, durable: bool) -> None:
    """``mode`` set again on what the block left at ``tmp`` (a writer that writes by name may
    have made a new file there, as torch's exporter does: with the umask's mode), never
    through a link; flushed to disk when ``durable``."""
    fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, mode)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def _fsync(path: str, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(
    final: str | os.PathLike[str],
    blob: bytes | str,
    mode: int | None = None,
    durable: bool = False,
) -> None:
    """``blob`` (bytes, or text as UTF-8) at ``final``, whole or not at all (``durable``: see
    ``atomic_path``)."""
    data = blob.encode() if isinstance(blob, str) else blob
    with atomic_path(final, mode, durable) as tmp, open(tmp, "wb") as f:
        f.write(data)


def claim(path: str | os.PathLike[str], to: str | os.PathLike[str]) -> None:
    """``path`` renamed to ``to``: of several processes claiming one file, exactly one wins, and
    the others get ``FileNotFoundError`` (a rename is atomic). Not a write into place: the file
    is whole already; the rename says who took it (the kineto daemon claims a queued config
    this way before it sends it, so that a rank taking the config back knows it was not sent)."""
    os.replace(path, to)
