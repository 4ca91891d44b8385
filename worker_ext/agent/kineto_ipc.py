"""libkineto's on-demand protocol, the side a daemon plays, and where it lives on a node.

A process started with ``KINETO_USE_DAEMON=1`` (before ``import torch``) runs a libkineto client
that asks a daemon for a config every ``ON_DEMAND_CONFIG_UPDATE_INTERVAL_SECS`` over an
``AF_UNIX`` datagram socket. ``KINETO_IPC_SOCKET_DIR`` moves both ends from the abstract name
``dynolog`` (a real dynolog's) to files in a directory: here ``kineto_dir()``, private to the
user (``0700``), so the node agent plays the daemon without disturbing a dynolog on the node.

A message is a 40-byte header (``size_t size; char type[32]``) and ``size`` bytes. The client
sends ``req``: ``{int32 type; int32 n; int64 jobid; int32 pids[n]}`` (the process, then its
ancestors); the reply is ``req`` with the config text (empty: nothing to do). A GPU client may
first register with ``ctxt`` (``{int32 gpu; int32 pid; int64 jobid}``), answered with an int32.

Configs wait in ``<dir>/requests/<pid>.conf`` until that process asks (``post_config``); the
daemon renames what it sent to ``<pid>.sent``. Imports neither torch nor Ray.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import struct
import tempfile
from dataclasses import dataclass

from coordinator.protocol.atomic_file import write_atomic

HEADER = struct.Struct("=Q32s")
REQUEST = struct.Struct("=iiq")
CONTEXT = struct.Struct("=iiq")
MAX_PIDS = 64
DIR_ENV = "RAY_PROFILER_KINETO_DIR"
SOCKET_NAME = "dynolog"  # the name libkineto sends to, in KINETO_IPC_SOCKET_DIR
POLL_S = 1
"""The clients' poll interval (``ON_DEMAND_CONFIG_UPDATE_INTERVAL_SECS``; libkineto's default is
5 s, and it reads the file only when the process starts)."""
CLIENT_PREFIX = "dynoconfigclient"  # each client binds <dir>/dynoconfigclient<uuid>
MAX_DIR = 107 - len(CLIENT_PREFIX) - 36 - 1  # a Unix socket's path has at most 107 bytes


@dataclass(frozen=True)
class Message:
    """One datagram: its type (``req``, ``ctxt``) and body."""

    kind: str
    body: bytes


@dataclass(frozen=True)
class ConfigRequest:
    """A client's ``req``: the config types it asks for and its pid, then its ancestors'."""

    types: int
    job_id: int
    pids: tuple[int, ...]


def encode(kind: str, body: bytes) -> bytes:
    """A message as libkineto reads it."""
    return HEADER.pack(len(body), kind.encode("ascii")) + body


def decode(data: bytes) -> Message:
    """A datagram; ValueError for one that is not a message."""
    if len(data) < HEADER.size:
        raise ValueError(f"a {len(data)}-byte datagram is shorter than the 40-byte header")
    size, raw = HEADER.unpack_from(data)
    body = data[HEADER.size :]
    if size != len(body):
        raise ValueError(f"the header says {size} bytes and {len(body)} came")
    kind = raw.split(b"\0", 1)[0].decode("ascii", "replace")
    return Message(kind, body)


def parse_request(body: bytes) -> ConfigRequest:
    """A ``req`` body; ValueError when it is malformed."""
    if len(body) < REQUEST.size:
        raise ValueError("a config request shorter than its fixed part")
    types, n, job = REQUEST.unpack_from(body)
    if not 1 <= n <= MAX_PIDS or len(body) < REQUEST.size + 4 * n:
        raise ValueError(f"a config request with {n} pids in {len(body)} bytes")
    pids = struct.unpack_from(f"={n}i", body, REQUEST.size)
    return ConfigRequest(types, job, tuple(pids))


def request(pids: list[int], types: int = 3, job_id: int = 0) -> bytes:
    """A client's ``req`` (as libkineto sends it; for tests and probes)."""
    body = REQUEST.pack(types, len(pids), job_id) + struct.pack(f"={len(pids)}i", *pids)
    return encode("req", body)


def reply(config: str) -> bytes:
    """The daemon's answer to ``req``: the config text."""
    return encode("req", config.encode("utf-8"))


def context_reply(count: int) -> bytes:
    """The daemon's answer to ``ctxt``: how many processes it knows."""
    return encode("ctxt", struct.pack("=i", count))


def kineto_dir() -> str:
    """This user's daemon directory on this node: ``$RAY_PROFILER_KINETO_DIR``, else
    ``<tmp>/ray-profiler-<uid>/kineto``. The same path on every node of a cluster."""
    return os.environ.get(DIR_ENV) or os.path.join(
        tempfile.gettempdir(), f"ray-profiler-{os.getuid()}", "kineto"
    )


def kineto_env(directory: str | None = None) -> dict[str, str]:
    """What a rank's environment needs before ``import torch`` for ``engine: kineto``, for
    ``runtime_env={"env_vars": kineto_env()}``. Writes the clients' config file on this node
    (the node agent writes it on the others)."""
    d = prepare_dir(directory or kineto_dir())
    return {
        "KINETO_USE_DAEMON": "1",
        "KINETO_IPC_SOCKET_DIR": d,
        "KINETO_CONFIG": os.path.join(d, "client.conf"),
        DIR_ENV: d,
    }


def prepare_dir(directory: str) -> str:
    """Create ``directory`` (and its requests folder) private to this user, write the clients'
    config file, and refuse a directory another user owns or others may write to, or one too
    long for the clients' socket paths (libkineto's clients then never poll)."""
    if len(os.fsencode(directory)) > MAX_DIR:
        raise ValueError(
            f"{directory!r} is too long for libkineto's sockets in it: at most {MAX_DIR} bytes "
            f"(set {DIR_ENV} to a shorter directory)"
        )
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"{directory} is not a directory of this user's")
    if st.st_mode & 0o077:
        raise PermissionError(
            f"{directory} is open to other users (mode {stat.S_IMODE(st.st_mode):o}); "
            "the kineto daemon's directory must be 0700"
        )
    os.makedirs(os.path.join(directory, "requests"), mode=0o700, exist_ok=True)
    conf = os.path.join(directory, "client.conf")
    text = f"ON_DEMAND_CONFIG_UPDATE_INTERVAL_SECS={POLL_S}\n"
    with contextlib.suppress(OSError), open(conf, encoding="utf-8") as f:
        if f.read() == text:
            return directory
    write_atomic(conf, text.encode("utf-8"))
    return directory


def request_path(directory: str, pid: int, suffix: str = "conf") -> str:
    return os.path.join(directory, "requests", f"{int(pid)}.{suffix}")


def post_config(directory: str, pid: int, config: str) -> str:
    """Queue ``config`` for process ``pid``'s next poll (replacing one not yet sent)."""
    path = request_path(directory, pid)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(request_path(directory, pid, "sent"))
    write_atomic(path, config.encode("utf-8"))
    return path


def withdraw_config(directory: str, pid: int) -> bool:
    """Take back a config not yet sent; whether there was one."""
    try:
        os.unlink(request_path(directory, pid))
        return True
    except FileNotFoundError:
        return False


_KEY = re.compile(r"^[A-Z][A-Z0-9_]*$")


def config_text(options: dict[str, object]) -> str:
    """libkineto's ``KEY=value`` lines; ValueError for a key or value that would break them."""
    lines = []
    for key, value in options.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        if not _KEY.match(key) or "\n" in text or "=" in key:
            raise ValueError(f"not a libkineto option: {key}={text!r}")
        lines.append(f"{key}={text}")
    return "\n".join(lines) + "\n"
