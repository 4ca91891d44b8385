"""What happens to a window's trace after the rank wrote it, in a process other than the rank's.

A rank's training process only stops the profiler and writes the raw chrome trace; it then
hands a ``TraceJob`` to its node's agent (``worker_ext.agent.node_agent``), which builds the
summary from the trace (``summarise_job``), pushes it to the coordinator, then compresses the
trace, writes folded stacks or deletes the temporary trace (``finish_trace``), and uploads it
(``upload_trace``). ``run_job`` is the same without the push, for the local agent outside Ray.
Imports neither torch nor Ray.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from coordinator.protocol.atomic_file import atomic_path
from coordinator.protocol.collective_replies import DEFAULT_COLLECTIVES_CAP, CollectiveBlock
from coordinator.protocol.node_files import open_own
from coordinator.protocol.reasons import reason
from coordinator.protocol.replies import Reason
from coordinator.protocol.summary_codec import RankSummary, encode_summary
from worker_ext.agent.kineto_traces import KinetoRequest, await_trace, settle_steps
from worker_ext.agent.trace_summary import summarise_trace


@dataclass(frozen=True)
class TraceJob:
    """One rank's closed window: where the raw trace is and what to make of it."""

    rank: int
    window: int
    steps: tuple[int, int]
    partial: bool
    device: str
    top_k: int
    with_flops: bool
    export_type: str
    raw_path: str
    """The chrome trace torch wrote (for ``chrome_trace`` it is already the final file)."""
    final_path: str | None
    """The file the window promises (``.json.gz``, ``.stacks.txt``); None for ``none``."""
    report_to: dict[str, str] | None = None
    upload_to: str | None = None
    """The URL the finished trace goes to (a URL ``save_path``), or None to keep it here."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    keep_local: bool = False
    """Keep the local copy once it is uploaded."""
    kineto: KinetoRequest | None = None
    """``engine: kineto``: the trace is libkineto's, still to come (``kineto_traces``)."""
    collectives_cap: int = DEFAULT_COLLECTIVES_CAP
    """Collectives the summary keeps (the config's ``collectives_cap``)."""
    cpu_wait_ns: int | None = None
    """The training thread's wait for a CPU, a recorded step's mean (``rank.cpu_wait``), ns;
    None: not measured. A kineto rank writes it beside libkineto's file (``cpu_wait_path``)."""


@dataclass
class JobResult:
    """What the agent did with a job; every field crosses processes."""

    window: int
    pid: int
    seconds: float = 0.0
    summary: bytes | None = None
    """The encoded summary when it could not be pushed (it rides on the rank's next reply)."""
    pushed: bool = False
    trace_path: str | None = None
    """Where the window's trace is now (its URL once uploaded)."""
    local_path: str | None = None
    """The copy on this node that stays: kept on purpose, or because the upload failed."""
    errors: list[Reason] = field(default_factory=list)
    """``where`` (summary, publish, relay, compress, stacks, cleanup, upload), ``type``,
    ``message``. A ``relay`` error lost nothing: the partial went to the coordinator directly."""


def run_job(job: TraceJob) -> JobResult:
    """Summarise, then finish the trace file, for a agent that does not push (the summary
    rides on the rank's next reply). Never raises: failures go in ``errors``."""
    t0 = time.perf_counter()
    lost = fetch_kineto_trace(job)
    if lost is not None:
        return lost
    res, blob, folded = summarise_job(job)
    res.summary = blob
    finish_trace(job, folded, res)
    upload_trace(job, res)
    res.seconds = time.perf_counter() - t0
    return res


def fetch_kineto_trace(job: TraceJob) -> JobResult | None:
    """A kineto window's trace written to ``job.raw_path`` (None), or the result that says why
    its summary is lost. Blocks while the window runs; None at once for a torch window."""
    if job.kineto is None:
        return None
    why = await_trace(job.kineto, job.raw_path)
    if why is None:
        return None
    with contextlib.suppress(OSError):
        os.unlink(cpu_wait_path(job.kineto.log_file))
    return JobResult(window=job.window, pid=os.getpid(), trace_path=None, errors=[why])


def summarise_job(job: TraceJob) -> tuple[JobResult, bytes | None, list[str] | None]:
    """The encoded summary of ``job``'s trace (None on failure, with the reason in ``errors``)
    and its folded stacks when the export type asks for them. Never raises."""
    res = JobResult(window=job.window, pid=os.getpid(), trace_path=job.raw_path)
    try:
        summary, folded = summarise_trace(
            job.raw_path,
            rank=job.rank,
            window=job.window,
            steps=job.steps,
            partial=job.partial,
            device=job.device,
            top_k=job.top_k,
            stacks=job.export_type == "stacks",
            flops=job.with_flops,
            clip=job.kineto is not None,
            collectives_cap=job.collectives_cap,
            cpu_wait_ns=job.cpu_wait_ns if job.kineto is None else kineto_cpu_wait(job),
        )
        blob = _encoded(summary)
        if job.kineto is not None:
            blob, why = settle_steps(blob, job.steps)
            if why is not None:
                res.errors.append(why)
        return res, blob, folded
    except Exception as exc:  # the reason goes to the rank's status
        res.errors.append(reason("summary", exc))
        return res, None, None


def cpu_wait_path(log_file: str) -> str:
    """Where a kineto rank writes its window's ``cpu_wait_ns`` (its job went to the agent at
    the window's start): beside libkineto's file, before it lets libkineto write."""
    return log_file + ".cpu_wait"


MAX_CPU_WAIT_DIGITS = 19
"""The longest ``cpu_wait_ns`` a kineto side file may hold (an int64's digits)."""


def kineto_cpu_wait(job: TraceJob) -> int | None:
    """A kineto window's ``cpu_wait_ns`` as its rank wrote it (the file then removed); None:
    not written, not this user's own regular file (never through a link, never a pipe:
    ``node_files.open_own``), or not ASCII digits, ``MAX_CPU_WAIT_DIGITS`` at most."""
    assert job.kineto is not None
    path = cpu_wait_path(job.kineto.log_file)
    try:
        fd = open_own(path, os.O_RDONLY)
        try:
            raw = os.read(fd, MAX_CPU_WAIT_DIGITS + 1)
        finally:
            os.close(fd)
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    ok = 0 < len(raw) <= MAX_CPU_WAIT_DIGITS and raw.isascii() and raw.isdigit()
    return int(raw) if ok else None


def _encoded(summary: RankSummary) -> bytes:
    """The summary's bytes; one whose collectives take it past its cap goes without them (a
    note in their place says so), never lost whole for them."""
    try:
        return encode_summary(summary)
    except ValueError as exc:
        block = summary.collectives
        if block is None:
            raise
        kept = len(block.calls) + block.cut
        note = f"its {kept} collectives were left out: the summary would not fit ({exc})"
        summary.collectives = CollectiveBlock((), (), kept, (), (note[:500],))
        return encode_summary(summary)


def finish_trace(job: TraceJob, folded: list[str] | None, res: JobResult) -> None:
    """Compress, write stacks or delete: whatever the export type asks of the raw trace.

    Sets ``res.trace_path`` to where the trace is now; a failure goes in ``res.errors``.
    """
    export, raw, final = job.export_type, job.raw_path, job.final_path
    if res.errors and res.errors[0]["where"] == "summary" and export in ("stacks", "none"):
        return  # the raw trace stays where it is, for whoever wants to look at it
    try:
        if export == "chrome_trace":
            res.trace_path = raw
        elif export == "chrome_trace_gz" and final:
            _atomic(final, lambda tmp: _gzip(raw, tmp))
            res.trace_path = final
            os.unlink(raw)
        elif export == "stacks" and final:
            _atomic(final, lambda tmp: _write_lines(tmp, folded or []))
            res.trace_path = final
            os.unlink(raw)
        elif export == "none":
            res.trace_path = None
            os.unlink(raw)
    except Exception as exc:
        where = {"chrome_trace_gz": "compress", "stacks": "stacks"}.get(export, "cleanup")
        res.errors.append(reason(where, exc))


UPLOAD_ATTEMPTS = 4
UPLOAD_BACKOFF_S = 0.5


def upload_trace(
    job: TraceJob, res: JobResult, sleep: Callable[[float], None] = time.sleep
) -> None:
    """Copy the finished trace to ``job.upload_to``, retrying with backoff; then drop the local
    copy unless ``keep_local``. A failure keeps the local copy and goes in ``res.errors``."""
    local = res.trace_path
    if job.upload_to is None or local is None or not os.path.exists(local):
        return
    from coordinator.core.storage import filesystem

    _lower_fsspec_io_priority()
    delay = UPLOAD_BACKOFF_S
    for attempt in range(1, UPLOAD_ATTEMPTS + 1):
        try:
            fs, path = filesystem(job.upload_to, job.storage_options)
            fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            fs.put_file(local, path)
            break
        except Exception as exc:
            if attempt == UPLOAD_ATTEMPTS:
                err = reason("upload", exc)
                err["message"] = (
                    f"upload to {job.upload_to} failed {attempt} times; the trace stays at "
                    f"{local}: {err['message']}"
                )[:1000]
                res.errors.append(err)
                res.local_path = local
                return
            sleep(delay)
            delay *= 2
    res.trace_path = job.upload_to
    if job.keep_local:
        res.local_path = local
        return
    try:
        os.unlink(local)
    except OSError as exc:
        res.local_path = local
        res.errors.append(reason("cleanup", exc))


def lowest_cpu_priority() -> None:
    """Give the calling thread the lowest CPU priority (Linux: nice is per thread)."""
    with contextlib.suppress(Exception):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _lower_fsspec_io_priority() -> None:
    """Async filesystems (s3fs, gcsfs) do their work on fsspec's own I/O thread: give it the
    lowest CPU priority too, so an upload yields the CPU to training (Linux: nice per thread)."""
    try:
        from fsspec.asyn import get_loop

        get_loop().call_soon_threadsafe(lowest_cpu_priority)
    except Exception:
        return


def _atomic(final: str, write: Callable[[str], None]) -> None:
    with atomic_path(final) as tmp:
        write(tmp)


def _gzip(src: str, dst: str) -> None:
    with open(src, "rb") as fin, gzip.open(dst, "wb", compresslevel=6) as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)


def _write_lines(path: str, lines: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")
