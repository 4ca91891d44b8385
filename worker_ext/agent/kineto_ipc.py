"""libkineto's on-demand protocol, the side a daemon plays, and where it lives on a node.

A process started with ``KINETO_USE_DAEMON=1`` (before ``import torch``) runs a libkineto client
that asks a daemon for a config every ``ON_DEMAND_CONFIG_UPDATE_INTERVAL_SECS`` over an
``AF_UNIX`` datagram socket. ``KINETO_IPC_SOCKET_DIR`` moves both ends from the abstract name
``dynolog`` (a real dynolog's) to files in a directory: here ``kineto_dir()``, private to the
user (``0700``, and so is every folder above it that we make: ``node_dir``), so the node agent
plays the daemon without disturbing a dynolog on the node, and no other user can swap it.

A message is a 40-byte header (``size_t size; char type[32]``) and ``size`` bytes. The client
sends ``req``: ``{int32 type; int32 n; int64 jobid; int32 pids[n]}`` (the process, then its
ancestors); the reply is ``req`` with the config text (empty: nothing to do). A GPU client may
first register with ``ctxt`` (``{int32 gpu; int32 pid; int64 jobid}``), answered with an int32.

Configs wait in ``<dir>/requests/<pid>.conf`` until that process asks and can take one
(``post_config``); the daemon claims one by renaming it to ``<pid>.sent`` before it sends it (so
a rank that removes its ``.conf`` knows it was never sent: ``take_back``), and the agent
removes it with the window (``withdraw_config``). While a ``.sent`` is there, the daemon notes
in ``<pid>.free`` when the process last said it could take a config (``free_since``): after
the window ended, that means libkineto dropped it. Imports neither torch nor Ray.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import struct
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

from coordinator.protocol.atomic_file import write_atomic
from coordinator.protocol.node_dir import node_dir, private_dir, private_tree, user_root

log = logging.getLogger(__name__)

HEADER = struct.Struct("=Q32s")
REQUEST = struct.Struct("=iiq")
ACTIVITIES = 0x2
"""The bit of a ``req``'s types that says the client can take an activity config now: libkineto
clears it while it records or still writes a trace, and drops a config that comes then."""
CONTEXT = struct.Struct("=iiq")
MAX_PIDS = 64
DIR_ENV = "RAY_PROFILER_KINETO_DIR"
SOCKET_NAME = "dynolog"  # the name libkineto sends to, in KINETO_IPC_SOCKET_DIR
POLL_S = 1
"""The clients' poll interval (``ON_DEMAND_CONFIG_UPDATE_INTERVAL_SECS``; libkineto's default is
5 s, and it reads the file only when the process starts)."""
CLIENT_PREFIX = "dynoconfigclient"  # each client binds <dir>/dynoconfigclient<uuid>
MAX_DIR = 107 - len(CLIENT_PREFIX) - 36 - 1  # a Unix socket's path has at most 107 bytes
RAY_SETUP_HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
"""Where Ray's worker reads its ``worker_process_setup_hook`` (a job's is put there by
``ray.init``; an actor's ``runtime_env`` key is ignored, its ``env_vars`` are not)."""
KINETO_SETUP_HOOK = "worker_ext.attach.kineto_setup"
ATTACH_HOOK = "worker_ext.attach.setup"
PROBLEM_ENV = "RAY_PROFILER_KINETO_PROBLEM"
LIBKINETO_ENV = ("KINETO_USE_DAEMON", "KINETO_IPC_SOCKET_DIR", "KINETO_CONFIG")
"""What libkineto reads of ``kineto_env()`` (all of it in the daemon directory)."""


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
    """This user's daemon directory on this node, not made or checked: ``$RAY_PROFILER_KINETO_DIR``,
    else ``kineto`` in the user's node directory (``<tmp>/ray-profiler-<uid>/kineto``). The same
    path on every node of a cluster."""
    return os.environ.get(DIR_ENV) or str(user_root() / "kineto")


def kineto_env(directory: str | None = None, setup_hook: bool = True) -> dict[str, str]:
    """What a rank's environment needs for ``engine: kineto``, for
    ``runtime_env={"env_vars": kineto_env()}``; prepares the directory on this node.

    libkineto binds its client socket in the directory once, when torch is imported: on a node
    where nothing made the directory before, it never asks. So the variables also name Ray's
    worker setup hook ``worker_ext.attach.kineto_setup`` (Ray runs it in each worker process
    they reach, before the actor's code imports torch), which prepares the directory on the
    rank's own node. In an actor's ``env_vars`` that variable replaces the job's own setup hook
    for the actor, so it is left out where Ray is initialized and the job has a hook of its own
    (``job_setup_hook``): quietly for the attach hook ``worker_ext.attach.setup`` (which makes
    the directory the variables name), with a warning for any other (which should call
    ``kineto_setup()``). ``setup_hook=False`` always leaves it out: for a job whose own setup
    hook calls ``kineto_setup()``."""
    d = prepare_dir(directory or kineto_dir())
    env = {
        "KINETO_USE_DAEMON": "1",
        "KINETO_IPC_SOCKET_DIR": d,
        "KINETO_CONFIG": os.path.join(d, "client.conf"),
        DIR_ENV: d,
    }
    job_hook = job_setup_hook() if setup_hook else None
    if setup_hook and job_hook in (None, KINETO_SETUP_HOOK):
        env[RAY_SETUP_HOOK_ENV] = KINETO_SETUP_HOOK
    elif job_hook is not None and job_hook != ATTACH_HOOK:
        log.warning(
            "profiler: kineto_env() leaves Ray's setup hook variable out: the job's own "
            "worker_process_setup_hook (%s) would be replaced by it in the actor; that hook "
            "should call worker_ext.attach.kineto_setup() (else the daemon directory is made "
            "only on this node)",
            job_hook,
        )
    return env


def job_setup_hook() -> str | None:
    """The ``worker_process_setup_hook`` of the Ray job this process belongs to, as its
    ``runtime_env`` says (a module path, or a function's name); None where Ray is not
    initialized here or the job has none."""
    ray = sys.modules.get("ray")  # (never imported here: a process without Ray has no job)
    try:
        if ray is None or not ray.is_initialized():
            return None
        runtime_env = ray.get_runtime_context().runtime_env
        hook = runtime_env.get("worker_process_setup_hook") or (
            runtime_env.get("env_vars") or {}
        ).get(RAY_SETUP_HOOK_ENV)
    except Exception:  # (a Ray whose runtime context cannot say: as if it had none)
        return None
    return str(hook) if hook else None


def prepare_dir(directory: str) -> str:
    """Make (or check) the daemon's ``directory`` and its requests folder, private to this user
    down from the user's node directory (``node_dir``), and write the clients' config file.

    Raises:
        PermissionError: a component is a link, another user's, or open to others (another user
            could swap the directory and serve the ranks' libkineto its own configs).
        ValueError: too long for the clients' socket paths (libkineto's clients then never
            poll)."""
    if len(os.fsencode(directory)) > MAX_DIR:
        raise ValueError(
            f"{directory!r} is too long for libkineto's sockets in it: at most {MAX_DIR} bytes "
            f"(set {DIR_ENV} to a shorter directory)"
        )
    what = "libkineto's daemon directory"
    if directory == str(user_root() / "kineto"):
        node_dir("kineto", what=what)
    else:
        private_tree(Path(directory), what, DIR_ENV)
    private_dir(Path(directory) / "requests", what, DIR_ENV)
    conf = os.path.join(directory, "client.conf")
    text = f"ON_DEMAND_CONFIG_UPDATE_INTERVAL_SECS={POLL_S}\n"
    with contextlib.suppress(OSError), open(conf, encoding="utf-8") as f:
        if f.read() == text:
            return directory
    write_atomic(conf, text.encode("utf-8"))
    return directory


def prepare_process(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """In a rank's process before ``import torch``: make (or check) the directory its libkineto
    variables name (``KINETO_IPC_SOCKET_DIR``), so that libkineto's client binds there. A
    directory refused turns libkineto's daemon mode off in this process (it would ask whoever
    serves there): ``KINETO_USE_DAEMON``, ``KINETO_IPC_SOCKET_DIR`` and ``KINETO_CONFIG`` (the
    base config libkineto reads when it starts, in that directory) are removed, and why is kept
    in ``$RAY_PROFILER_KINETO_PROBLEM``; returns why, else None."""
    directory = environ.get("KINETO_IPC_SOCKET_DIR")
    if environ.get("KINETO_USE_DAEMON") != "1" or not directory:
        return None
    try:
        prepare_dir(directory)
        return None
    except (OSError, ValueError) as exc:
        why = f"libkineto's daemon mode is off in this process: {exc}"
        for key in LIBKINETO_ENV:
            environ.pop(key, None)
        environ[PROBLEM_ENV] = why[:1000]
        return why


def client_bound(directory: str) -> bool | None:
    """Whether this process holds a libkineto client socket in ``directory`` (bound when torch
    was imported, never later), from ``/proc``; None where ``/proc`` cannot tell."""
    prefix = os.path.join(directory, CLIENT_PREFIX)
    try:
        inodes = set()
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # (a descriptor closed meanwhile)
                link = os.readlink(f"/proc/self/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[len("socket:[") : -1])
        return any(inode in inodes and path.startswith(prefix) for inode, path in _unix_sockets())
    except OSError:
        return None


def bound_names(directory: str) -> set[str] | None:
    """The client socket names in ``directory`` that a live socket is bound to (any process of
    this network namespace: ``/proc/net/unix`` lists a name while its socket is open); None
    where ``/proc`` cannot tell."""
    prefix = os.path.join(directory, CLIENT_PREFIX)
    try:
        return {path for _, path in _unix_sockets() if path.startswith(prefix)}
    except OSError:
        return None


def _unix_sockets() -> list[tuple[str, str]]:
    """``(inode, path)`` of each named Unix socket open on this node, from ``/proc/net/unix``."""
    with open("/proc/net/unix", encoding="utf-8", errors="replace") as f:
        rows = [line.rstrip("\n").split(None, 7) for line in f]
    return [(r[6], r[7]) for r in rows if len(r) == 8]


def request_path(directory: str, pid: int, suffix: str = "conf") -> str:
    return os.path.join(directory, "requests", f"{int(pid)}.{suffix}")


def post_config(directory: str, pid: int, config: str) -> str:
    """Queue ``config`` for process ``pid``'s next poll (replacing one not yet sent)."""
    path = request_path(directory, pid)
    write_atomic(path, config.encode("utf-8"))
    return path


def withdraw_config(directory: str, pid: int, log_file: str | None = None) -> bool:
    """Take back a config not yet sent, and forget one sent; whether one was not yet sent.
    With ``log_file``, only the config of that window (a later window's, posted ahead, stays)."""
    sent = request_path(directory, pid, "sent")
    if log_file is None or _names(sent, log_file):
        for path in (sent, request_path(directory, pid, "free")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    return take_back(directory, pid, log_file)


def take_back(directory: str, pid: int, log_file: str | None = None) -> bool:
    """Remove the config queued for ``pid`` (only that of ``log_file``, when given); whether it
    was removed, so never sent: the daemon claims a config by renaming it before sending."""
    path = request_path(directory, pid)
    if log_file is not None and not _names(path, log_file):
        return False
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _names(path: str, log_file: str) -> bool:
    line = f"ACTIVITIES_LOG_FILE={log_file}\n"
    try:
        with open(path, encoding="utf-8") as f:
            return line in f.read()
    except OSError:
        return False


def note_free(directory: str, pid: int, when: float) -> None:
    """The daemon's note that process ``pid`` could take a config at ``when`` (wall clock),
    kept only while a config sent to it is outstanding."""
    if os.path.exists(request_path(directory, pid, "sent")):
        with contextlib.suppress(OSError):
            write_atomic(request_path(directory, pid, "free"), repr(when).encode("ascii"))


def free_since(directory: str, pid: int) -> float | None:
    """When process ``pid`` last said it could take a config (``note_free``), or None."""
    try:
        with open(request_path(directory, pid, "free"), encoding="ascii") as f:
            return float(f.read())
    except (OSError, ValueError):
        return None


def config_taken(directory: str, pid: int, log_file: str) -> bool:
    """Whether the daemon sent process ``pid`` the config that writes ``log_file`` (a window's
    own file: the ``.sent`` of an earlier window says nothing of this one)."""
    return _names(request_path(directory, pid, "sent"), log_file)


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
