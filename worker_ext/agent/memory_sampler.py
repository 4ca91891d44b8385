"""The node agent's memory sampler: each rank process's memory, out of process, about once a
second, on a thread of the agent's own (never a training process's).

Per process: resident memory (``psutil``'s ``memory_info().rss``, 10 us), unique memory
(``memory_full_info().uss``: it reads ``/proc/<pid>/smaps``, about 1.4 ms for a process with
torch loaded, so only every ``USS_EVERY``-th sample) and, where NVML answers, the GPU memory
the process holds on every device. The coordinator sends a ``MemoryWatch`` now and then (which
processes, how often) and takes back what was sampled since the last one; the samples wait in a
bounded buffer per process. With no watch for ``STALE_S`` the thread stops by itself. Each
watch's answer carries the node's memory now (``node_memory``: the host's, or its container's
cgroup limit where lower), for the time a leak leaves the node.

CUDA memory snapshots the node's ranks wrote are noted in the user's private memory folder
(``memory_dir``: ``<tmp>/ray-profiler-<uid>/memory``), one file a rank process: each watch carries
the notes new since the last. Notes and demand pipes are opened never through a link and only
when they are this user's own (``node_files``); a note file anywhere else is never read.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.protocol.memory_replies import (
    AgentMemoryReply,
    MemoryWatch,
    NodeMemory,
    ProcessSamples,
    SnapshotNote,
)
from coordinator.protocol.node_dir import node_dir
from coordinator.protocol.node_files import append_line, open_own, write_pipe
from worker_ext.agent.stack_reader import process_exited

USS_EVERY = 10
BUFFER = 3600  # samples kept per process between two watches
STALE_S = 120.0  # a watcher that has not watched for this long is forgotten
NOTES_KEEP_S = 3600.0  # a note file of an exited process is kept this long
MAX_TARGETS = 4096
MAX_NOTES = 256  # snapshot notes a watch carries
CGROUP = "/sys/fs/cgroup"
# (limit, usage, stat file, the reclaimable page cache's keys in it): cgroup v2, then v1, as
# Ray's memory monitor reads them (its used memory leaves the page cache out)
CGROUP_FILES = (
    ("memory.max", "memory.current", "memory.stat", ("inactive_file", "active_file")),
    ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
     ("total_inactive_file", "total_active_file")),
)  # fmt: skip


def memory_dir() -> Path:
    """Where this node's ranks leave their snapshot notes and demand pipes, and on-demand
    snapshots of a run saved to a URL go: ``node_dir("memory")``, made private to the user
    and checked (PermissionError says why not)."""
    return node_dir("memory", what="the memory folder")


def foreign_pids(nvml_pids: set[int], watched: set[int], here: set[int]) -> str | None:
    """Why no watched process shows in NVML's list when its pids are none of this pid
    namespace's (``here``: those of them that exist here): the agent runs in a container
    without the host's pid namespace, and NVML answers in host pids. None otherwise."""
    if not watched or not nvml_pids or nvml_pids & watched or nvml_pids <= here:
        return None
    return (
        f"NVML names {len(nvml_pids)} GPU process(es), none of them a process of this pid "
        "namespace (NVML gives host pids): the node agent runs in a container without the "
        "host's pid namespace, so no rank's GPU memory is known (run it with --pid=host)"
    )


def node_memory(cgroup: str = CGROUP) -> NodeMemory | None:
    """This node's total and available memory now: the host's (``psutil``), or its
    container's where the cgroup's limit is lower (its usage less the page cache); None
    when psutil fails. Well under a millisecond (one read a watch)."""
    import psutil  # type: ignore[import-untyped,unused-ignore]

    try:
        vm = psutil.virtual_memory()
    except Exception:
        return None
    total, avail = int(vm.total), int(vm.available)
    out: NodeMemory = {"total_bytes": total, "available_bytes": avail,
                       "at": round(time.time(), 3), "source": "host"}  # fmt: skip
    for limit_f, usage_f, stat_f, cache in CGROUP_FILES:
        try:
            limit = Path(cgroup, limit_f).read_text().strip()
            if not limit.isdigit():
                return out  # "max": no limit
            usage = int(Path(cgroup, usage_f).read_text())
            pairs = (line.split() for line in Path(cgroup, stat_f).read_text().splitlines())
            stat = {p[0]: int(p[1]) for p in pairs if len(p) == 2}
        except (OSError, ValueError):
            continue
        used = usage - sum(stat.get(k, 0) for k in cache)
        if int(limit) < total:
            out["total_bytes"] = int(limit)
            out["available_bytes"] = max(0, min(avail, int(limit) - used))
            out["source"] = "cgroup"
        return out
    return out


class GpuMemory:
    """Each process's GPU memory on this node through NVML (``pynvml``, else Ray's own copy)."""

    def __init__(self) -> None:
        self.problem: str | None = None
        self._nvml: Any = None
        self.pids: set[int] = set()
        self._devices: list[Any] = []
        try:
            try:
                import pynvml  # type: ignore[import-not-found,unused-ignore]
            except ImportError:
                from ray._private.thirdparty import pynvml  # type: ignore[no-redef,unused-ignore]
            pynvml.nvmlInit()
            self._devices = [
                pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
            ]
            self._nvml = pynvml
            if not self._devices:
                self.problem = "NVML sees no GPU on this node"
        except Exception as exc:
            self.problem = f"no NVML: {type(exc).__name__}: {exc}"[:300]

    def by_pid(self) -> dict[int, int]:
        """Bytes of GPU memory per pid, over every device (empty with no NVML); ``pids``: every
        pid NVML named this time."""
        out: dict[int, int] = {}
        self.pids = set()
        for dev in self._devices:
            try:
                procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(dev)
            except Exception as exc:
                self.problem = f"NVML failed: {type(exc).__name__}: {exc}"[:300]
                continue
            for p in procs:
                self.pids.add(p.pid)
                used = getattr(p, "usedGpuMemory", None)
                if isinstance(used, int):
                    out[p.pid] = out.get(p.pid, 0) + used
        return out


@dataclass
class _Watcher:
    """One coordinator's watch: its processes, the samples it has not taken yet, the snapshot
    notes it has read. Two runs on one cluster sample the same node without taking each
    other's samples or notes."""

    pids: set[int]
    sample_s: float
    at: float  # when it last watched (monotonic)
    buffers: dict[int, collections.deque[Any]] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)  # pids it ever watched: whose notes it reads
    noted: dict[Path, int] = field(default_factory=dict)  # note file -> bytes read


class MemorySampler:
    """See the module docstring. ``watch`` is called from the agent's event loop (it never
    blocks on a sample); the samples are taken on the sampler's thread."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._procs: dict[int, Any] = {}  # pid -> psutil.Process: every watcher's
        self._gone: dict[int, str] = {}
        self._errors: dict[int, str] = {}
        self._uss: dict[int, int | None] = {}
        self._watchers: dict[str, _Watcher] = {}
        self._thread: threading.Thread | None = None
        self._gpu: GpuMemory | None = None
        self._cpu_s = 0.0
        self._sampled = 0
        self._ticks = 0
        self._closed = False
        self._wake = threading.Event()  # set by close: the thread's wait ends at once
        self._pid_problem: str | None = None  # NVML's pids are not this namespace's

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop sampling: the thread ends after its current sample (a later watch restarts it).

        Raises:
            RuntimeError: the thread still runs after ``timeout_s``.
        """
        with self._lock:
            self._closed = True
            self._wake.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=timeout_s)
            if thread.is_alive():
                raise RuntimeError(f"the memory sampler's thread did not stop in {timeout_s:g} s")

    def watch(self, w: MemoryWatch) -> AgentMemoryReply:
        """Sample ``w``'s processes from now on (for ``w["watcher"]``: one coordinator's run);
        what was sampled for it since its last watch."""
        pids = {int(t["pid"]) for t in w["targets"][:MAX_TARGETS]}
        now = time.monotonic()
        with self._lock:
            self._closed = False
            self._wake.clear()
            for name in [n for n, x in self._watchers.items() if now - x.at > STALE_S]:
                del self._watchers[name]  # a coordinator that stopped asking
            wt = self._watchers.setdefault(w.get("watcher", ""), _Watcher(pids, 1.0, now))
            wt.pids, wt.sample_s, wt.at = pids, float(w["sample_s"]), now
            wt.seen = (wt.seen | pids) if len(wt.seen) < 4 * MAX_TARGETS else set(pids)
            self._open(pids)
            for pid in set(wt.buffers) - pids:
                del wt.buffers[pid]
            out = [self._drain(wt, pid) for pid in sorted(pids)]
            self._forget_unwatched()
            self._start()
        gpu = (self._gpu.problem if self._gpu is not None else None) or self._pid_problem
        return {
            "node_memory": node_memory(),
            "node": self.node,
            "processes": out,
            "gpu": gpu,
            "cpu_s": round(self._cpu_s, 4),
            "sampled": self._sampled,
            "snapshots": self._read_notes(wt),
        }

    def _open(self, pids: set[int]) -> None:
        import psutil  # type: ignore[import-untyped,unused-ignore]

        for pid in pids - set(self._procs) - set(self._gone):
            try:
                self._procs[pid] = psutil.Process(pid)
            except Exception as exc:  # no such process, or not ours to see
                self._gone[pid] = f"{type(exc).__name__}: {exc}"[:300]

    def _drain(self, wt: _Watcher, pid: int) -> ProcessSamples:
        buf = wt.buffers.setdefault(pid, collections.deque(maxlen=BUFFER))
        samples = list(buf)
        buf.clear()
        gone = self._gone.get(pid)
        return {"pid": pid, "samples": samples, "gone": gone, "error": self._errors.get(pid)}

    def _forget_unwatched(self) -> None:
        """The processes no watcher watches any more."""
        watched = set().union(*(x.pids for x in self._watchers.values()))
        for pid in set(self._procs) - watched:
            self._procs.pop(pid, None)
            self._errors.pop(pid, None)
            self._uss.pop(pid, None)
        for pid in set(self._gone) - watched:
            del self._gone[pid]

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="profiler-memory", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        if self._gpu is None:
            self._gpu = GpuMemory()
        while True:
            with self._lock:
                now = time.monotonic()
                live = [x for x in self._watchers.values() if now - x.at <= STALE_S]
                if not live or self._closed:
                    self._procs.clear()
                    self._watchers.clear()
                    self._thread = None
                    return  # nobody asks any more: the next watch starts it again
                interval = min(x.sample_s for x in live)
            c0 = time.thread_time()
            self.sample_once()
            self._cpu_s += time.thread_time() - c0
            self._wake.wait(interval)

    def sample_once(self) -> None:
        """One sample of every watched process, for each watcher of it (its faults are noted,
        never raised)."""
        gpu = self._gpu.by_pid() if self._gpu is not None and self._gpu._devices else {}
        self._ticks += 1
        with self._lock:
            procs = list(self._procs.items())
        named = set(self._gpu.pids) if self._gpu is not None else set()
        here = {p for p in named if not process_exited(p)}
        self._pid_problem = foreign_pids(named, {p for p, _ in procs}, here)
        for pid, proc in procs:
            sample = self._sample(pid, proc, gpu)
            if sample is None:
                continue
            with self._lock:
                for wt in self._watchers.values():
                    buf = wt.buffers.get(pid) if pid in wt.pids else None
                    if buf is not None:
                        buf.append(sample)
                self._sampled += 1

    def _sample(self, pid: int, proc: Any, gpu: dict[int, int]) -> Any:
        import psutil  # type: ignore[import-untyped,unused-ignore]

        t = time.time()
        try:
            rss = int(proc.memory_info().rss)
            uss = self._uss.get(pid)
            if (self._ticks - 1) % USS_EVERY == 0 or pid not in self._uss:
                try:
                    uss = int(proc.memory_full_info().uss)
                    self._errors.pop(pid, None)
                except psutil.AccessDenied as exc:
                    uss, self._errors[pid] = None, f"psutil refused by the OS: {exc}"[:300]
                self._uss[pid] = uss
        except (psutil.NoSuchProcess, psutil.ZombieProcess) as exc:
            with self._lock:
                self._gone.setdefault(pid, f"the process exited ({type(exc).__name__})")
            return None
        except Exception as exc:  # psutil refused by the OS: said, the others go on
            self._errors[pid] = f"{type(exc).__name__}: {exc}"[:300]
            return None
        return (round(t, 3), rss, uss, gpu.get(pid))

    def _read_notes(self, wt: _Watcher) -> list[SnapshotNote]:
        """Snapshot notes of ``wt``'s processes (those it ever watched: a rank killed by its
        OOM leaves its note behind) new since its last read. A note file of an exited process
        goes after ``NOTES_KEEP_S``, so that every watcher of it has read it."""
        out: list[Any] = []
        paths: list[Path] = []
        with contextlib.suppress(OSError):  # (a folder refused: its ranks say why)
            folder = memory_dir()
            paths = sorted(folder.glob("*.snapshots.jsonl"))
            for pipe in folder.glob("*.mem"):  # demand pipes of ranks killed outright
                if pipe.stem.isdigit() and process_exited(int(pipe.stem)):
                    pipe.unlink()
        for path in paths:
            pid = path.name.partition(".")[0]
            if not pid.isdigit():
                continue
            with contextlib.suppress(OSError):
                if int(pid) in wt.seen:
                    out += _notes(path, wt.noted, int(pid))
                old = time.time() - os.lstat(path).st_mtime > NOTES_KEEP_S
                if old and process_exited(int(pid)):
                    path.unlink()
        return out[-MAX_NOTES:]


def _notes(path: Path, read: dict[Path, int], pid: int) -> list[Any]:
    """The notes of ``path`` past what was ``read``; only from a file of this user's, never
    through a link (OSError)."""
    done = read.get(path, 0)
    fd = open_own(path, os.O_RDONLY)
    try:
        data = os.pread(fd, 1 << 20, done) if os.fstat(fd).st_size > done else b""
    finally:
        os.close(fd)
    end = data.rfind(b"\n") + 1
    read[path] = done + end
    out = []
    for line in data[:end].splitlines():
        with contextlib.suppress(ValueError):
            note = json.loads(line)
            if isinstance(note, dict) and note.get("on") in ("window", "oom", "demand"):
                out.append({**note, "pid": pid})
    return out


def note_snapshot(on: str, path: str | None, error: str | None) -> str | None:
    """In a rank: say that a snapshot was written (or why not), for the node agent to pick up
    (``MemorySampler`` reads ``<pid>.snapshots.jsonl``, 0600, never written through a link);
    why it could not be said, or None. Never raises."""
    note = {"on": on, "path": path, "error": error, "at": round(time.time(), 3)}
    try:
        append_line(memory_dir() / f"{os.getpid()}.snapshots.jsonl", json.dumps(note))
    except Exception as exc:
        return f"snapshot notes cannot be written: {type(exc).__name__}: {exc}"[:500]
    return None


def demand_pipe(pid: int | None = None) -> str:
    """The named pipe a rank reads on-demand snapshot paths from (PermissionError: the
    memory folder is refused)."""
    return str(memory_dir() / f"{pid or os.getpid()}.mem")


def ask_for_snapshot(pid: int, path: str) -> str | None:
    """In the node agent: ask process ``pid`` for a snapshot to ``path``; why not, or None."""
    try:
        fifo = demand_pipe(pid)
    except OSError as exc:
        return f"the memory folder cannot be had: {exc}"
    if not os.path.lexists(fifo):
        return "it has no demand pipe (not a CUDA rank, or 'demand' not in memory_snapshot.on)"
    try:
        write_pipe(fifo, (path + "\n").encode())  # (only a pipe of this user's, no link)
    except OSError as exc:
        return f"its pipe refused: {exc}"
    return None


def check_watch(watch: object) -> None:
    """ValueError naming what is wrong with a ``MemoryWatch``."""
    if not isinstance(watch, dict) or not isinstance(watch.get("targets"), list):
        raise ValueError(f"a memory watch must be a dict with a 'targets' list, got {watch!r:.80}")
    who = watch.get("watcher", "")
    if not isinstance(who, str) or len(who) > 300:
        raise ValueError(f"watcher must be a str of at most 300 chars, got {who!r:.80}")
    s = watch.get("sample_s")
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0.05 <= s <= 3600:
        raise ValueError(f"sample_s must be a number in 0.05..3600, got {s!r:.80}")
    for t in watch["targets"][:MAX_TARGETS]:
        pid = t.get("pid") if isinstance(t, dict) else None
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise ValueError(f"a memory target must be {{'pid': int > 0}}, got {t!r:.80}")


def check_snapshot_request(req: object) -> list[tuple[int, str]]:
    """A ``SnapshotRequest``'s targets, checked: each path must end ``.memory.pickle``."""
    targets = req.get("targets") if isinstance(req, dict) else None
    if not isinstance(targets, list) or len(targets) > MAX_TARGETS:
        raise ValueError(f"a snapshot request must hold a 'targets' list, got {req!r:.80}")
    out = []
    for t in targets:
        if (
            not isinstance(t, (list, tuple))
            or len(t) != 2
            or isinstance(t[0], bool)
            or not isinstance(t[0], int)
            or not isinstance(t[1], str)
            or not t[1].endswith(".memory.pickle")
            or "\n" in t[1]
            or "\0" in t[1]
            or "/../" in f"/{t[1]}/"
        ):
            raise ValueError(
                f"a snapshot target must be [pid, a .memory.pickle path], got {t!r:.80}"
            )
        path = t[1] if os.path.isabs(t[1]) else str(memory_dir() / "snapshots" / t[1])
        out.append((t[0], path))
    return out
