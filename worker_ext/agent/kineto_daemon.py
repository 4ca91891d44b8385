"""The daemon libkineto asks for on-demand configs, played for one node's processes.

A process of its own (``python -m worker_ext.agent.kineto_daemon <dir> <parent pid>``), so
that no summary the agent parses holds the GIL while a client waits: libkineto waits only about
90 ms for a reply. ``ensure_daemon`` starts one per agent process; of the daemons of one
directory (several agents of one host, as in a test cluster) the one holding
``<dir>/daemon.lock`` serves and the others wait to take over. Each leaves when its parent has
(or on SIGTERM), removing its socket and then the lock file. While serving it removes, once a
minute whatever the traffic, the sockets libkineto's clients left behind (files no live socket
is bound to: a silent client keeps its own).

The late-reply trap: a reply the client no longer waits for stays queued in its socket, and from
then on it reads every reply one poll late. So the daemon never answers a client's first
request, never sends a reply to a request that arrived more than ``LATE_S`` ago (the kernel's
arrival time, ``SO_TIMESTAMPNS``), and leaves the next request unanswered after any reply that
went out late all the same.

A config goes only to a client whose request says it can take one (the ``ACTIVITIES`` bit):
libkineto drops a config that comes while it records or still writes a trace ("Ignored request
- profiler busy"); it waits for the poll after the trace is written.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import BinaryIO

from coordinator.protocol.atomic_file import claim
from worker_ext.agent.kineto_ipc import (
    ACTIVITIES,
    CLIENT_PREFIX,
    SOCKET_NAME,
    bound_names,
    context_reply,
    decode,
    note_free,
    parse_request,
    prepare_dir,
    reply,
    request_path,
)
from worker_ext.agent.stack_reader import process_exited

LATE_S = 0.05
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
SWEEP_S = 60.0


class Daemon:
    """The serving side, on a bound socket (``serve_once`` per datagram)."""

    def __init__(self, directory: str, sweep_s: float = SWEEP_S) -> None:
        self.directory = directory
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.path = os.path.join(directory, SOCKET_NAME)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a daemon before us left it; we hold the lock now
        self.sock.bind(self.path)
        self._inode = os.lstat(self.path).st_ino
        self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self.sock.settimeout(0.5)
        self.seen: dict[str, float] = {}  # client address -> last request
        self.skip_next: set[str] = set()
        self.sent = 0
        self.sweep_s = sweep_s
        self._swept = time.monotonic()
        self.log = None
        if os.environ.get("RAY_PROFILER_KINETO_LOG"):  # every request and answer, to debug
            self.log = open(os.path.join(directory, "daemon.log"), "a", buffering=1)  # noqa: SIM115

    def _note(self, text: str) -> None:
        if self.log is not None:
            self.log.write(f"{time.time():.3f} {text}\n")

    def close(self) -> None:
        """Stop serving: the socket closed and its file removed (unless another took the name)."""
        self.sock.close()
        with contextlib.suppress(OSError):
            if os.lstat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        if self.log is not None:
            self.log.close()

    def serve_once(self) -> None:
        """Take one datagram (or time out) and answer it as above; sweep when it is time."""
        self._sweep()  # (on the clock: clients that poll without a pause never stop it)
        try:
            data, anc, _, addr = self.sock.recvmsg(1 << 16, socket.CMSG_SPACE(16))
        except TimeoutError:
            return
        arrived = _arrival(anc)
        if not isinstance(addr, str) or not addr:
            return
        try:
            msg = decode(data)
        except ValueError:
            return
        first = addr not in self.seen
        self.seen[addr] = time.monotonic()
        if msg.kind == "ctxt":
            self._send(addr, context_reply(1), arrived)
            return
        if msg.kind != "req" or first:
            return
        if addr in self.skip_next:
            self.skip_next.discard(addr)
            return
        try:
            req = parse_request(msg.body)
        except ValueError:
            return
        age = time.time() - arrived if arrived is not None else 0.0
        self._note(f"req pid={req.pids[0]} type={req.types} age={age * 1e3:.1f}ms")
        if age > LATE_S:
            return  # the client has stopped waiting; its config waits for the next poll
        free = bool(req.types & ACTIVITIES)
        if free:
            note_free(self.directory, req.pids[0], arrived or time.time())
        self._answer(addr, req.pids[0], arrived, free)

    def _answer(self, addr: str, pid: int, arrived: float | None, free: bool) -> None:
        """Send the queued config, claimed first (renamed to ``.sent``), only to a client that
        can take it (``free``): libkineto drops one that comes while it records or writes."""
        path = request_path(self.directory, pid)
        sent_path = request_path(self.directory, pid, "sent")
        config = ""
        if free:
            with contextlib.suppress(OSError):
                claim(path, sent_path)  # (fails when none is queued)
                with open(sent_path, encoding="utf-8") as f:
                    config = f.read()
        sent = self._send(addr, reply(config), arrived)
        self._note(f"answer pid={pid} bytes={len(config)} sent={sent} free={free}")
        if sent and config:
            self.sent += 1

    def _send(self, addr: str, data: bytes, arrived: float | None) -> bool:
        try:
            self.sock.sendto(data, addr)
        except OSError:
            return False  # the client is gone
        if arrived is not None and time.time() - arrived > LATE_S:
            self.skip_next.add(addr)  # it went out late: its next poll reads this one
        return True

    def _sweep(self) -> None:
        """Remove the sockets clients left behind (libkineto never removes its own), once per
        ``sweep_s`` (``SWEEP_S``): a client socket file that no live socket is bound to
        (``bound_names``, read after the listing: a client binding meanwhile is in it), older
        than ``sweep_s`` and not heard from for as long. A live client is never swept, however
        long it stays silent (stopped, or it imported torch just before): libkineto binds only
        once, and a client without its file never gets a reply again. Nothing is swept where
        ``/proc`` cannot tell which are bound."""
        now = time.monotonic()
        if now - self._swept < self.sweep_s:
            return
        self._swept = now
        self._sweep_requests()
        try:
            names = [n for n in os.listdir(self.directory) if n.startswith(CLIENT_PREFIX)]
        except OSError:
            return
        bound = bound_names(self.directory)
        if bound is None:
            return
        for name in names:
            addr = os.path.join(self.directory, name)
            if addr in bound or now - self.seen.get(addr, 0.0) <= self.sweep_s:
                continue
            with contextlib.suppress(OSError):
                if time.time() - os.lstat(addr).st_mtime > self.sweep_s:
                    os.unlink(addr)
                    self.seen.pop(addr, None)
                    self.skip_next.discard(addr)

    def _sweep_requests(self) -> None:
        """Remove the files (``requests/<pid>.*``) of processes that are gone: a config posted
        ahead for a window that never came, else sent later to a process reusing the pid."""
        folder = os.path.join(self.directory, "requests")
        try:
            names = os.listdir(folder)
        except OSError:
            return
        for name in names:
            pid = name.split(".", 1)[0]
            if pid.isdigit() and int(pid) > 0 and process_exited(int(pid)):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, name))


def _arrival(ancillary: list[tuple[int, int, bytes]]) -> float | None:
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= 16:
            sec, nsec = struct.unpack_from("=qq", data)  # a struct timespec
            return float(sec) + float(nsec) / 1e9
    return None


def run(directory: str, parent: int) -> None:
    """Serve ``directory`` while ``parent`` lives (or until SIGTERM): wait for the lock, then
    answer; on the way out remove the socket, then the lock file, while holding the lock."""
    stop = threading.Event()  # SIGTERM ends the loop between two datagrams, never inside one
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def wanted() -> bool:
        return os.getppid() == parent and not stop.is_set()

    prepare_dir(directory)
    lock = _take_lock(os.path.join(directory, "daemon.lock"), wanted)
    if lock is None:
        return
    try:
        daemon = Daemon(directory)
        try:
            while wanted():
                daemon.serve_once()
        finally:
            daemon.close()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock.name)
        lock.close()


def _take_lock(path: str, wanted: Callable[[], bool]) -> BinaryIO | None:
    """``path`` opened and locked, waiting while ``wanted()``; None once it is not. A lock file
    removed (by the daemon that held it, leaving) or replaced while we waited is opened anew:
    a lock held on a file no longer at ``path`` locks nothing."""
    while wanted():
        f = open(path, "a+b")  # noqa: SIM115 (returned, open, to the caller)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            time.sleep(0.5)
            continue
        with contextlib.suppress(OSError):
            if os.fstat(f.fileno()).st_ino == os.lstat(path).st_ino:
                return f
        f.close()
    return None


_STARTED: dict[str, subprocess.Popen[bytes]] = {}
_LOCK = threading.Lock()


def ensure_daemon(directory: str) -> int:
    """This process's daemon for ``directory``, started if it is not running; its pid."""
    with _LOCK:
        proc = _STARTED.get(directory)
        if proc is not None and proc.poll() is None:
            return proc.pid
        prepare_dir(directory)
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__, directory, str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # never a caller's pipe: it would stay open with us
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        _STARTED[directory] = proc
        return proc.pid


def stop_daemons() -> None:
    """Stop the daemons this process started (tests; an agent's daemons leave with it)."""
    with _LOCK:
        procs = list(_STARTED.values())
        _STARTED.clear()
    for proc in procs:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]))
