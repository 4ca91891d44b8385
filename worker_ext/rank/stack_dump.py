"""Let the node agent read this process's stack when py-spy cannot attach, and its NCCL Flight
Recorder when a run stalls. Runs in a training rank (or a trainer's driver); imports no torch
until asked about CUDA.

``enable_stack_dump()`` registers ``faulthandler`` on ``SIGUSR2`` (when nothing else uses that
signal) to append every thread's stack to ``<dir>/<pid>.txt`` (``<dir>``: ``stacks_dir``,
private to the user; the file 0600, never opened through a link). The dump is written by
faulthandler's C handler, so it works while the training thread is blocked in C code, a
collective included, and takes no GIL. On a CUDA rank with the Flight Recorder on
(``TORCH_NCCL_TRACE_BUFFER_SIZE`` > 0) it also makes a named pipe ``<dir>/<pid>.fr`` and opens
it read-write before saying so, so the agent always finds a reader (no gap before the thread
starts or between two requests); a thread blocked reading it (holding no GIL, costing nothing
until asked) writes torch's own dump (``_dump_fr_trace``) to each path the agent sends. Both
files go at the process's normal exit; the node agent removes those of processes killed
outright (``stack_reader.sweep_dumps``).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import signal
import sys
import threading
from typing import IO, Any

from coordinator.protocol.atomic_file import write_atomic
from coordinator.protocol.node_files import make_pipe, open_own
from coordinator.protocol.stack_replies import StackDump
from worker_ext.agent.stack_reader import stacks_dir

STACK_SIGNAL = signal.SIGUSR2
_state: dict[str, Any] = {}
_lock = threading.Lock()


def enable_stack_dump(cuda: bool | None = None) -> StackDump:
    """Register the dump once per process (later calls answer the same); never raises.

    ``cuda``: whether this process drives CUDA (None: ask torch if it is loaded).
    """
    with _lock:
        if "dump" not in _state:
            _state["dump"] = _enable(cuda)
            atexit.register(_remove_files)
        dump: StackDump = dict(_state["dump"])  # type: ignore[assignment]
        return dump


def _enable(cuda: bool | None) -> StackDump:
    pid = os.getpid()
    dump: StackDump = {
        "signal": None,
        "path": None,
        "main_thread": threading.main_thread().ident,
        "note": None,
        "flight_recorder": None,
        "flight_recorder_note": None,
    }
    try:
        folder = stacks_dir()  # (made private and checked: PermissionError says why not)
        current = signal.getsignal(STACK_SIGNAL)
        if current not in (signal.SIG_DFL, None):
            dump["note"] = f"signal {STACK_SIGNAL.name} is taken by {current!r}"
        else:
            path = folder / f"{pid}.txt"
            fd = open_own(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)  # never through a link
            f: IO[str] = os.fdopen(fd, "a")  # faulthandler writes to it for life
            f.write(f"# ray-profiler faulthandler pid={pid}\n")
            f.flush()
            faulthandler.register(STACK_SIGNAL, file=f, all_threads=True, chain=False)
            _state["file"] = f
            dump["signal"], dump["path"] = int(STACK_SIGNAL), str(path)
    except Exception as exc:  # a dump that cannot be set up is reported, never raised
        dump["note"] = f"faulthandler not registered: {type(exc).__name__}: {exc}"
    fr, why = _flight_recorder(pid, cuda)
    dump["flight_recorder"], dump["flight_recorder_note"] = fr, why
    return dump


def _remove_files() -> None:
    """At a normal exit: stop the dump and remove this process's files (a process killed
    outright leaves them to the node agent's sweep)."""
    dump = _state.get("dump") or {}
    if dump.get("signal") is not None:
        with contextlib.suppress(Exception):
            faulthandler.unregister(STACK_SIGNAL)
    f = _state.pop("file", None)
    if f is not None:
        with contextlib.suppress(Exception):
            f.close()
    for key in ("path", "flight_recorder"):
        if dump.get(key):
            with contextlib.suppress(OSError):
                os.unlink(dump[key])


def flight_recorder_unavailable(cuda: bool | None) -> str | None:
    """Why this process has no NCCL Flight Recorder to dump; None when it has one."""
    size = os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")
    if not size.strip().isdigit() or int(size) <= 0:
        return "not available: TORCH_NCCL_TRACE_BUFFER_SIZE is not > 0"
    if cuda is None:
        torch = sys.modules.get("torch")
        cuda = bool(torch is not None and torch.cuda.is_available())
    if not cuda:
        return "not available: no CUDA device (CPU or gloo rank)"
    return None


def _flight_recorder(pid: int, cuda: bool | None) -> tuple[str | None, str | None]:
    why = flight_recorder_unavailable(cuda)
    if why is not None:
        return None, why
    try:
        fifo = stacks_dir() / f"{pid}.fr"
        fd = make_pipe(fifo)  # a reader from now on; read-write: never an EOF
        threading.Thread(
            target=_serve_flight_recorder,
            args=(fd,),
            name="profiler-flight-recorder",
            daemon=True,
        ).start()
        return str(fifo), None
    except Exception as exc:
        return None, f"not available: {type(exc).__name__}: {exc}"


def _serve_flight_recorder(fd: int) -> None:
    """Each line read from the pipe ``fd`` is a path: write torch's Flight Recorder dump there
    (or ``<path>.error`` with why)."""
    try:
        with open(fd, closefd=True) as requests:  # blocks, without the GIL, until asked
            for line in requests:
                if line.strip():
                    write_flight_recorder(line.strip())
    except Exception:
        return  # the pipe is gone: nothing more can ask


def write_flight_recorder(path: str) -> None:
    """torch's own Flight Recorder dump (a pickle) to ``path``, atomically; or ``.error``."""
    try:
        from torch._C import _distributed_c10d

        data = _distributed_c10d._dump_fr_trace()  # type: ignore[attr-defined]
        write_atomic(path, data, mode=0o600)
    except Exception as exc:
        with contextlib.suppress(OSError), open(f"{path}.error", "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
