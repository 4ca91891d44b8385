"""A kineto window's trace, seen from the agent: the config handed to the daemon, the file
libkineto writes from the rank's process, and what the rank's hooks say about it.

The rank posts nothing itself: its ``TraceJob`` carries a ``KinetoRequest``. The agent queues
the config for the rank's next poll (``kineto_ipc.post_config``), waits until libkineto renames
its trace into place, then writes the raw trace the usual pipeline reads (``job.raw_path``) with
the metadata libkineto leaves out (``distributedInfo``, ``rank``). A trace that never comes
(the process exited, a ``torch.profiler`` of the user's cancelled it, the rank stopped the
window before it began) costs that window's summary, with the reason; its ``.tmp`` is removed.

The steps a window really recorded are the rank's ``ProfilerStep#N`` markers in it; a window
whose config reached libkineto late starts later than planned and is partial, with the reason
(``settle_steps``). A config libkineto was sent but dropped is said as soon as the process
polls, able to take a config, after the rank ended the window (``_dropped``), not at the
timeout. Imports neither torch nor Ray.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from coordinator.protocol.atomic_file import atomic_path
from coordinator.protocol.node_files import open_own
from coordinator.protocol.replies import Reason
from coordinator.protocol.summary_codec import decode_summary, encode_summary
from worker_ext.agent.kineto_daemon import ensure_daemon
from worker_ext.agent.kineto_ipc import config_taken, free_since, post_config, withdraw_config
from worker_ext.agent.stack_reader import process_exited

POLL_S = 0.1
CANCEL_SUFFIX = ".cancel"
ENDED_SUFFIX = ".ended"
LATE = (
    " (libkineto takes a config when it asks, once a second, and only once the trace before "
    "it is written: status()['schedule_problems'] says what the schedule needs)"
)
DROP_MARGIN_S = 0.2  # a poll this long after the window's end was sent after it
_LOCKS: dict[int, tuple[threading.Lock, int]] = {}  # pid -> its lock, windows holding or waiting
_LOCKS_LOCK = threading.Lock()


@contextlib.contextmanager
def _pid_lock(pid: int) -> Iterator[None]:
    """One window of a process at a time: libkineto drops a config that arrives while another
    waits for its start ("another profile request is pending"). The lock is forgotten when no
    window of the process holds or waits for it (pids come and go for as long as the agent
    lives)."""
    with _LOCKS_LOCK:
        lock, users = _LOCKS.get(pid, (threading.Lock(), 0))
        _LOCKS[pid] = (lock, users + 1)
    try:
        with lock:
            yield
    finally:
        with _LOCKS_LOCK:
            lock, users = _LOCKS[pid]
            if users == 1:
                del _LOCKS[pid]
            else:
                _LOCKS[pid] = (lock, users - 1)


@dataclass(frozen=True)
class KinetoRequest:
    """What the agent needs to drive one rank's kineto window."""

    pid: int
    config: str
    """libkineto's config text (``ACTIVITIES_LOG_FILE`` is ``log_file``)."""
    log_file: str
    directory: str
    """The daemon's directory (``KINETO_IPC_SOCKET_DIR`` of the rank)."""
    metadata: str
    """Top-level JSON members to add to the trace (``"distributedInfo": {...}, "rank": R``)."""
    timeout_s: float = 900.0
    """The longest the agent waits for the trace while the process lives."""
    posted: bool = False
    """The rank posted the config itself, ahead of the window (``kineto_ipc.post_config``)."""


def written_path(log_file: str, pid: int) -> str:
    """Where libkineto writes for ``log_file``: ``<stem>_<pid><ext>``."""
    stem, ext = os.path.splitext(log_file)
    return f"{stem}_{pid}{ext}"


def ended_path(log_file: str) -> str:
    """The marker a rank writes when its window ended with libkineto holding its config."""
    return log_file + ENDED_SUFFIX


def cancel_path(log_file: str) -> str:
    """The marker a rank writes to say its window's trace will not come, and why."""
    return log_file + CANCEL_SUFFIX


def await_trace(
    req: KinetoRequest,
    raw_path: str,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    serve: Callable[[str], object] = ensure_daemon,
) -> Reason | None:
    """Hand the config to the daemon, wait for libkineto's file and write ``raw_path`` from it;
    None once written, else why not (every file of the attempt removed). Never raises.

    A process's windows are handed over one at a time: the next config is posted once the
    trace before it is written, unless the rank posted it itself ahead (``req.posted``); the
    daemon sends it when libkineto can take it."""
    with _pid_lock(req.pid):
        return _await_trace(req, raw_path, clock, sleep, serve)


def _await_trace(
    req: KinetoRequest,
    raw_path: str,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    serve: Callable[[str], object],
) -> Reason | None:
    out = written_path(req.log_file, req.pid)
    try:
        serve(req.directory)  # (already served, unless the agent restarted)
        if not req.posted and not os.path.exists(cancel_path(req.log_file)):
            post_config(req.directory, req.pid, req.config)
    except Exception as exc:
        return _reason("summary", f"kineto: the config could not be handed to the daemon: {exc}")
    deadline = clock() + req.timeout_s
    why: str | None = None
    while not os.path.exists(out):
        why = _why_not_yet(req, clock() > deadline)
        if why is not None:
            break
        sleep(POLL_S)
    if why is None:
        try:
            _with_metadata(out, raw_path, req.metadata)
        except Exception as exc:
            why = f"libkineto's trace {out} could not be read or rewritten: {exc}"
    withdraw_config(req.directory, req.pid, req.log_file)
    for left in (out, out + ".tmp", cancel_path(req.log_file), ended_path(req.log_file)):
        with contextlib.suppress(OSError):
            os.unlink(left)
    return None if why is None else _reason("summary", f"kineto: {why}")


def _why_not_yet(req: KinetoRequest, past_deadline: bool) -> str | None:
    """Why the trace will not come, or None while it may."""
    with contextlib.suppress(OSError):  # (the rank's own file only: no link, pipe, or giant)
        fd = open_own(cancel_path(req.log_file), os.O_RDONLY)
        try:
            said = os.read(fd, 4096).decode("utf-8", "replace").strip()[:1000]
        finally:
            os.close(fd)
        return said or "the rank cancelled the window"
    if process_exited(req.pid):
        sent = config_taken(req.directory, req.pid, req.log_file)
        return (
            f"the rank's process {req.pid} exited before libkineto wrote the trace "
            f"(libkineto writes it from that process; config {'sent' if sent else 'never sent'})"
        )
    dropped = _dropped(req)
    if dropped is not None:
        return dropped
    if past_deadline:
        return f"no trace from libkineto within {req.timeout_s:.0f} s"
    return None


def _dropped(req: KinetoRequest) -> str | None:
    """Why libkineto will not write a config it was sent, or None: the rank ended the window
    (and counted libkineto's iterations past its end, so libkineto records or writes it until
    the trace is there), yet the process polled since, saying it could take a config."""
    try:
        ended = os.stat(ended_path(req.log_file)).st_mtime
    except OSError:
        return None
    free = free_since(req.directory, req.pid)
    if (
        free is None
        or free < ended + DROP_MARGIN_S
        or not config_taken(req.directory, req.pid, req.log_file)
    ):
        return None
    if os.path.exists(written_path(req.log_file, req.pid)):
        return None  # (written meanwhile)
    return (
        "libkineto dropped the window's config: the window ended and libkineto is not recording "
        "it (it drops a config that comes while it still writes the trace before, or while "
        "another waits for its start)"
    )


def _with_metadata(src: str, dst: str, metadata: str) -> None:
    """Copy libkineto's trace to ``dst`` with ``metadata`` as its first members."""
    with open(src, "rb") as fin:
        head = fin.read(1 << 16)
        start = head.find(b"{")
        if start < 0:
            raise ValueError("not a JSON object")
        with atomic_path(dst) as tmp, open(tmp, "wb") as fout:
            fout.write(head[: start + 1] + metadata.encode("utf-8") + b",")
            fout.write(head[start + 1 :])
            while chunk := fin.read(1 << 20):
                fout.write(chunk)


def settle_steps(blob: bytes, planned: tuple[int, int]) -> tuple[bytes, Reason | None]:
    """The summary with the steps its markers show it recorded; partial, with the reason, when
    they are not the planned ones."""
    summary = decode_summary(blob)
    seen = sorted(s for s, _ in summary.step_us)
    if seen and (seen[0], seen[-1]) == planned:
        return blob, None
    if not seen:
        why = f"no step of the planned {planned[0]}-{planned[1]} is in libkineto's trace" + LATE
        return encode_summary(dataclasses.replace(summary, partial=True)), _reason("kineto", why)
    got = (seen[0], seen[-1])
    late = seen[0] > planned[0]
    why = f"recorded steps {got[0]}-{got[1]} of the planned {planned[0]}-{planned[1]}" + (
        ": the config reached libkineto after the window's first step" + LATE if late else ""
    )
    fixed = dataclasses.replace(summary, steps=got, partial=True)
    return encode_summary(fixed), _reason("kineto", why)


def _reason(where: str, message: str) -> Reason:
    return {"where": where, "type": "KinetoWindow", "message": message[:1000]}
