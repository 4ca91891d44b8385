"""CUDA memory snapshots of a training rank (``memory_snapshot:`` in the config): during each
window, on an out-of-memory error, and on demand. Runs in the rank; CUDA ranks only.

- ``window``: the allocator's history is recorded while the window runs
  (``torch.cuda.memory._record_memory_history``) and the snapshot written beside the rank's
  trace when the window closes: ``rank<R>.memory.pickle``.
- ``oom``: history is recorded from the configure on, and an out-of-memory observer
  (``torch._C._cuda_attach_out_of_memory_observer``) writes ``rank<R>.oom-<time>.memory.pickle``
  under ``<run dir>/memory/<role>/`` before the error goes on.
- ``demand``: history from the configure on, and a named pipe ``<memory dir>/<pid>.mem`` that a
  thread reads (blocked without the GIL until asked): each line is a path the node agent wants
  a snapshot written to (``ray-profiler memory --snapshot``). For a run saved to a URL, that is
  under ``<memory dir>/snapshots/``, on the rank's node (``memory_sampler.memory_dir``: the
  user's private folder).

Every snapshot file is written 0600 (it holds the run's tensors' sizes and stacks).

Each snapshot written, or its failure, is noted for the node agent (``note_snapshot``), which
hands the note to the coordinator (``status()["memory"]["snapshots"]``): an OOM that kills the
rank right after still leaves its note. A fault here is noted and logged, never raised into
training. Open a snapshot in PyTorch's memory viz (docs/memory-and-stalls.md, "CUDA memory
snapshots").
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any

from coordinator.core.memory_config import MemorySnapshot
from coordinator.protocol.atomic_file import atomic_path
from coordinator.protocol.node_files import make_pipe
from worker_ext.agent.memory_sampler import demand_pipe, memory_dir, note_snapshot

log = logging.getLogger(__name__)
_state: dict[str, Any] = {}  # once per process: the observer and the demand pipe
_lock = threading.Lock()


class MemorySnapshots:
    """One rank's snapshots (see the module docstring)."""

    def __init__(
        self, cfg: MemorySnapshot, device: str, rank: int, out_dir: str | None, role: str = "policy"
    ) -> None:
        self.cfg, self.rank, self.out_dir, self.role = cfg, int(rank), out_dir, role
        self.on = set(cfg.on) if device == "cuda" else set()
        self.always = bool(self.on & {"oom", "demand"})  # history recorded for the whole run
        self.recording = False
        self.problem: str | None = None
        if self.on and (problem := _folder_problem()):  # (a CPU rank never touches it)
            self.problem = problem
            log.warning("rank %d: %s", self.rank, problem)
        if self.always:
            self._record(True)
            with _lock:
                _state["rank"] = self
                if "oom" in self.on:
                    _attach_oom_observer()
                if "demand" in self.on:
                    self.problem = self.problem or _open_demand_pipe()

    @classmethod
    def of(cls, rp: Any) -> MemorySnapshots:
        """A ``RankProfiler``'s: its config, device, rank, run directory and role."""
        return cls(rp.config.memory_snapshot, rp.device, rp.rank, rp.run_directory, rp.role)

    def _record(self, on: bool) -> None:
        try:
            mem = _cuda_memory()
            if on:
                context = None if self.cfg.stacks == "none" else "all"
                stacks = "all" if self.cfg.stacks == "all" else "python"
                mem._record_memory_history(
                    enabled="all", context=context, stacks=stacks, max_entries=self.cfg.max_entries
                )
            else:
                mem._record_memory_history(enabled=None)
            self.recording = on
        except Exception as exc:
            self.problem = f"memory history not recorded: {type(exc).__name__}: {exc}"[:300]
            log.warning("rank %d: %s", self.rank, self.problem)

    def window_started(self) -> None:
        """A window opens: record the allocator's history for it (never raises)."""
        if "window" in self.on and not self.recording:
            self._record(True)

    def window_ended(self, job: Any) -> str | None:
        """A window closed: its snapshot beside its trace (``job``: the window's ``TraceJob``,
        None when it wrote none), ``rank<R>.memory.pickle``; its path, or None (never
        raises)."""
        trace_dir = job if isinstance(job, str) or job is None else os.path.dirname(job.raw_path)
        if "window" not in self.on or trace_dir is None:
            return None
        path = os.path.join(trace_dir, f"rank{self.rank}.memory.pickle")
        written = write_snapshot(path, "window")
        if not self.always:
            self._record(False)
        return written

    def oom_path(self) -> str:
        folder = os.path.join(self.out_dir or str(memory_dir()), "memory", self.role)
        return os.path.join(
            folder, f"rank{self.rank}.oom-{time.strftime('%Y%m%d-%H%M%S')}.memory.pickle"
        )


def _cuda_memory() -> Any:
    import torch

    return torch.cuda.memory


def _folder_problem() -> str | None:
    """Why this rank's snapshot notes and demand pipe cannot be had (the memory folder is
    refused: another user's, open to others, a link), or None."""
    try:
        memory_dir()
    except Exception as exc:
        return f"memory snapshots not noted: {type(exc).__name__}: {exc}"[:500]
    return None


def write_snapshot(path: str, on: str) -> str | None:
    """The allocator's snapshot to ``path`` (0600, whole or not at all: ``atomic_path``), noted
    for the node agent; the path, or None when it failed (noted with why). Never raises."""
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        with atomic_path(path, mode=0o600) as tmp:
            _cuda_memory()._dump_snapshot(tmp)
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"[:500]
        log.warning("memory snapshot to %s failed: %s", path, why)
        note_snapshot(on, path, why)
        return None
    note_snapshot(on, path, None)
    return path


def _attach_oom_observer() -> None:
    if "observer" in _state:
        return

    def observer(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        # Runs inside the failing allocation, before the error goes on: never raise here.
        with contextlib.suppress(BaseException):
            rank = _state.get("rank")
            if rank is not None:
                write_snapshot(rank.oom_path(), "oom")

    try:
        import torch

        torch._C._cuda_attach_out_of_memory_observer(observer)
        _state["observer"] = observer
    except Exception as exc:
        note_snapshot("oom", None, f"no OOM observer: {type(exc).__name__}: {exc}"[:300])


def _open_demand_pipe() -> str | None:
    """The demand pipe and its reader thread, once per process; why not, or None."""
    if "pipe" in _state:
        return None
    try:
        fifo = demand_pipe()  # (in the private memory folder, made and checked)
        fd = make_pipe(fifo)  # read-write: a reader from now on, never an EOF
        threading.Thread(
            target=_serve, args=(fd,), name="profiler-memory-snapshot", daemon=True
        ).start()
        _state["pipe"] = fifo
        import atexit

        atexit.register(_remove_pipe)
    except Exception as exc:
        why = f"no demand pipe: {type(exc).__name__}: {exc}"[:300]
        log.warning("%s", why)
        note_snapshot("demand", None, why)
        return why
    return None


def _serve(fd: int) -> None:
    """Each line read from the pipe is a path to write a snapshot to."""
    with contextlib.suppress(Exception), open(fd, closefd=True) as requests:
        for line in requests:
            path = line.strip()
            if path.endswith(".memory.pickle") and "\0" not in path:
                write_snapshot(path, "demand")


def _remove_pipe() -> None:
    with contextlib.suppress(OSError, KeyError):
        os.unlink(_state["pipe"])
