"""Read the stacks of this node's processes, from outside them: py-spy, else faulthandler.
Runs in the node agent, never in a training process.

``py-spy dump`` pauses its target for the few milliseconds of the read. When py-spy is missing,
or may not attach (ptrace not permitted), a process that registered ``faulthandler``
(``worker_ext.rank.stack_dump``) is sent its signal and its dump is read back. A process
already gone is reported at once, never waited for.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from coordinator.core.stacks import parse_faulthandler, parse_py_spy
from coordinator.protocol.node_dir import chosen_dir
from coordinator.protocol.node_files import open_own, write_pipe
from coordinator.protocol.stack_replies import (
    METHODS,
    FlightRecorderEntry,
    ProcessStack,
    StackDump,
    StackRequest,
    StackTarget,
    ThreadStack,
)

STACKS_ENV = "RAY_PROFILER_STACKS_DIR"
PY_SPY_ENV = "RAY_PROFILER_PY_SPY"
"""A path to the py-spy binary; ``none`` makes py-spy unavailable (faulthandler only)."""
# py-spy stops its target while it reads; reads beyond the node's cores only wait for a CPU
# with their targets stopped (bench/stack_cost.py: 32 ranks on 2 cores).
MAX_PARALLEL = min(16, max(2, os.cpu_count() or 2))
MAX_LEAD_S = 5.0  # the longest the agent waits for the request's moment
_DUMP_SETTLE_S = 0.2  # faulthandler writes line by line; a preempted writer pauses


class StackReadError(Exception):
    """Why one method could not read a stack; ``str`` is the reason shown to the operator."""


def stacks_dir() -> Path:
    """Where this node's faulthandler dumps and Flight Recorder pipes go, made private and
    checked (``node_dir.chosen_dir``; PermissionError says why not):
    ``$RAY_PROFILER_STACKS_DIR``, else ``<tmp>/ray-profiler-<uid>/stacks``."""
    return chosen_dir(STACKS_ENV, "stacks", "the stack dumps folder")


def sweep_dumps(folder: Path | None = None) -> list[str]:
    """Remove the faulthandler dumps (``<pid>.txt``) and Flight Recorder pipes (``<pid>.fr``)
    of processes that are gone (a rank killed by ``ray.kill`` never runs its exit handler);
    the names removed. Never raises."""
    removed: list[str] = []
    try:
        entries = list((folder or stacks_dir()).iterdir())
    except OSError:
        return removed
    for path in entries:
        stem, dot, ext = path.name.partition(".")
        if not dot or ext not in ("txt", "fr") or not stem.isdigit():
            continue
        if process_exited(int(stem)):
            try:
                path.unlink()
                removed.append(path.name)
            except OSError:
                continue
    return removed


def find_py_spy() -> str | None:
    """The py-spy binary: ``$RAY_PROFILER_PY_SPY``, else next to this Python, else on PATH."""
    chosen = os.environ.get(PY_SPY_ENV)
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "none") else chosen
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def process_exited(pid: int) -> bool:
    """Whether ``pid`` is gone (or a zombie, which no reader can read)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def read_with_py_spy(pid: int, native: bool, timeout_s: float) -> list[ThreadStack]:
    """Every thread of ``pid`` through ``py-spy dump --json``; StackReadError says why not."""
    exe = find_py_spy()
    if exe is None:
        raise StackReadError("py-spy not installed")
    cmd = [exe, "dump", "--pid", str(pid), "--json"] + (["--native"] if native else [])
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        raise StackReadError(f"py-spy not installed (no {exe})") from None
    except subprocess.TimeoutExpired:
        raise StackReadError(f"py-spy did not answer within {timeout_s:g} s") from None
    if done.returncode != 0:
        raise StackReadError(py_spy_failure(done.stderr or done.stdout, pid))
    try:
        return parse_py_spy(done.stdout)
    except ValueError as exc:
        raise StackReadError(f"py-spy output unreadable: {exc}") from None


def py_spy_failure(output: str, pid: int) -> str:
    """The reason a failed ``py-spy dump`` gives, in the operator's words."""
    first = next((ln.strip() for ln in output.splitlines() if ln.strip()), "no output")
    if process_exited(pid):
        return "exited"
    low = output.lower()
    if any(s in low for s in ("permission denied", "operation not permitted", "requires root")):
        return f"permission: ptrace not permitted ({first[:160]})"
    return f"py-spy failed: {first[:200]}"


def read_with_faulthandler(pid: int, dump: StackDump | None, timeout_s: float) -> list[ThreadStack]:
    """Signal ``pid`` to append its faulthandler dump, and read what it appended."""
    if dump is None or dump.get("signal") is None or not dump.get("path"):
        why = (dump.get("note") if dump else None) or "the process has not registered it"
        raise StackReadError(f"faulthandler not available: {why}")
    signum = dump["signal"]
    if signum not in (signal.SIGUSR1, signal.SIGUSR2):
        raise StackReadError(f"faulthandler not available: signal {signum} is not SIGUSR1/2")
    path = Path(str(dump["path"]))
    try:
        if path != stacks_dir() / f"{pid}.txt":
            raise FileNotFoundError(path)
        fd = open_own(path, os.O_RDONLY)  # (never through a link, nor another user's file)
    except FileNotFoundError:
        raise StackReadError(f"faulthandler not available: no dump file for pid {pid}") from None
    try:
        text = _appended(fd, pid, signum, timeout_s)
    finally:
        os.close(fd)
    try:
        return parse_faulthandler(text, dump.get("main_thread"))
    except ValueError as exc:
        raise StackReadError(f"faulthandler dump unreadable: {exc}") from None


def _appended(fd: int, pid: int, signum: int, timeout_s: float) -> str:
    """Signal ``pid`` and what its dump file ``fd`` grew by, once it stopped growing."""
    start = os.fstat(fd).st_size
    os.kill(pid, signum)
    deadline, last, stable_since = time.monotonic() + timeout_s, start, time.monotonic()
    while time.monotonic() < deadline:
        size = os.fstat(fd).st_size
        if size != last:
            last, stable_since = size, time.monotonic()
        elif size > start and time.monotonic() - stable_since >= _DUMP_SETTLE_S:
            break
        time.sleep(0.01)
    if last <= start:
        raise StackReadError(f"faulthandler wrote nothing within {timeout_s:g} s")
    return os.pread(fd, last - start, start).decode("utf-8", "replace")


def read_stack(target: StackTarget, native: bool, method: str, timeout_s: float) -> ProcessStack:
    """One process's stack by ``method`` (``auto``: py-spy, then faulthandler); never raises."""
    pid = int(target["pid"])
    out: ProcessStack = {
        "pid": pid,
        "method": None,
        "threads": [],
        "error": None,
        "tried": [],
        "taken_at": time.time(),
        "read_ms": 0.0,
        "flight_recorder": None,
    }
    t0 = time.perf_counter()
    if process_exited(pid):
        out["error"] = "exited"
        return out
    methods = ("py-spy", "faulthandler") if method == "auto" else (method,)
    for m in methods:
        try:
            if m == "py-spy":
                out["threads"] = _py_spy(pid, native, timeout_s, out["tried"])
            else:
                out["threads"] = read_with_faulthandler(pid, target.get("dump"), timeout_s)
            out["method"] = m  # type: ignore[typeddict-item]
            break
        except StackReadError as exc:
            out["tried"].append(f"{m}: {exc}")
            if str(exc) == "exited":
                break
        except OSError as exc:  # the process went away under the read, or a file vanished
            out["tried"].append(f"{m}: {'exited' if process_exited(pid) else exc}")
    if out["method"] is None:
        last = out["tried"][-1].split(": ", 1)[1] if out["tried"] else "no method"
        out["error"] = "exited" if process_exited(pid) else last
        if len(out["tried"]) > 1 and out["error"] != "exited":
            out["error"] = "; ".join(out["tried"])
    out["read_ms"] = (time.perf_counter() - t0) * 1000.0
    return out


def _py_spy(pid: int, native: bool, timeout_s: float, tried: list[str]) -> list[ThreadStack]:
    """py-spy; when ``--native`` alone fails (py-spy cannot unwind every build), without it."""
    if not native:
        return read_with_py_spy(pid, False, timeout_s)
    try:
        return read_with_py_spy(pid, True, timeout_s)
    except StackReadError as exc:
        if not str(exc).startswith("py-spy failed"):
            raise
        tried.append(f"py-spy --native: {exc}")
        return read_with_py_spy(pid, False, timeout_s)


def request_flight_recorder(
    pid: int, dump: StackDump | None, out_dir: str, timeout_s: float
) -> FlightRecorderEntry:
    """Ask a CUDA rank for torch's NCCL Flight Recorder dump into ``out_dir``; never raises."""
    fifo = dump.get("flight_recorder") if dump else None
    if not fifo:
        note = dump.get("flight_recorder_note") if dump else None
        why = note or "not available: the rank is not configured"
        return {"path": None, "reason": why}
    target = Path(out_dir) / f"nccl_flight_recorder_pid{pid}_{time.time_ns() // 1_000_000}.pkl"
    try:
        if Path(str(fifo)) != stacks_dir() / f"{pid}.fr":
            why = f"not available: no Flight Recorder pipe for pid {pid}"
            return {"path": None, "reason": why}
        target.parent.mkdir(parents=True, exist_ok=True)
        write_pipe(str(fifo), f"{target}\n".encode())  # ENXIO: nobody listens
    except OSError as exc:
        return {"path": None, "reason": f"could not ask: {exc}"}
    deadline = time.monotonic() + timeout_s
    error = Path(f"{target}.error")
    while time.monotonic() < deadline:
        if target.exists():
            return {"path": str(target), "reason": None}
        if error.exists():
            return {"path": None, "reason": error.read_text()[:300]}
        time.sleep(0.05)
    return {"path": None, "reason": f"no dump within {timeout_s:g} s"}


MAX_TARGETS = 4096


def check_request(req: object) -> None:
    """ValueError naming what is wrong with a ``StackRequest`` (it comes over Ray)."""
    if not isinstance(req, dict):
        raise ValueError(f"a stack request must be a dict, got {type(req).__name__}")
    targets = req.get("targets")
    if not isinstance(targets, list) or len(targets) > MAX_TARGETS:
        raise ValueError(f"targets must be a list of at most {MAX_TARGETS} processes")
    for t in targets:
        pid = t.get("pid") if isinstance(t, dict) else None
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise ValueError(f"each target needs a pid > 0, got {t!r:.80}")
        if t.get("dump") is not None and not isinstance(t["dump"], dict):
            raise ValueError(f"a target's dump must be a dict or None, got {t['dump']!r:.80}")
    if not isinstance(req.get("native"), bool) or req.get("method") not in METHODS:
        raise ValueError(f"native must be a bool and method one of {', '.join(METHODS)}")
    for key, top in (("at", None), ("timeout_s", 120.0)):
        value = req.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ValueError(f"{key} must be a number, got {value!r:.80}")
        if top is not None and not 0 < value <= top:
            raise ValueError(f"{key} must be in (0, {top:g}], got {value!r:.80}")
    fr = req.get("flight_recorder_dir")
    if fr is not None and not isinstance(fr, str):
        raise ValueError(f"flight_recorder_dir must be a str or None, got {fr!r:.80}")


def read_stacks(req: StackRequest) -> list[ProcessStack]:
    """Every target's stack, all read at once at the request's moment (``at``); blocking."""
    lead = min(max(0.0, float(req["at"]) - time.time()), MAX_LEAD_S)
    time.sleep(lead)
    targets = list(req["targets"])
    timeout = float(req["timeout_s"])
    workers = max(1, min(MAX_PARALLEL, len(targets)))
    with concurrent.futures.ThreadPoolExecutor(workers, "profiler-stacks") as pool:
        futs = [
            pool.submit(read_stack, t, bool(req["native"]), str(req["method"]), timeout)
            for t in targets
        ]
        out = [f.result() for f in futs]
        if req.get("flight_recorder_dir"):
            frs = [
                pool.submit(
                    request_flight_recorder,
                    int(t["pid"]),
                    t.get("dump"),
                    str(req["flight_recorder_dir"]),
                    timeout,
                )
                for t in targets
            ]
            for o, f in zip(out, frs, strict=True):
                o["flight_recorder"] = f.result()
    return out
