"""The torch side of a rank's window: building the profiler, exporting its trace, and the one
torch profiler a process may run. ``RankProfiler`` owns every call into these; they hold no
guard of their own beyond the process-wide claim.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerAction as TorchAction
from torch.profiler import ProfilerActivity

from coordinator.core.config import ProfilerConfig
from coordinator.core.schedule import Window
from coordinator.core.storage import join
from coordinator.core.trace_layout import contained, trace_path, window_dir
from coordinator.protocol.atomic_file import atomic_path
from coordinator.protocol.node_dir import node_dir, private_tree
from worker_ext.agent.trace_jobs import TraceJob

STAGING_ENV = "RAY_PROFILER_STAGING"

_CLAIM_LOCK = threading.Lock()
_CLAIMED_BY: Any = None  # the one owner (a RankProfiler) with a live torch profiler


def activities(device: str) -> list[ProfilerActivity]:
    """What torch records: CPU, and CUDA on a GPU rank."""
    acts = [ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(ProfilerActivity.CUDA)
    return acts


def window_profiler(
    config: ProfilerConfig,
    device: str,
    rank: int,
    window: Window,
    step: int,
    on_trace_ready: Callable[[Any], None],
    role: str = "policy",
) -> Any:
    """A torch profiler for ``window``, not yet started; training step ``step`` runs next.

    Its schedule only warms up and records: the trace is written by ``stop()`` alone (never
    inside ``step()``), so the caller decides the one moment it happens.
    """

    def window_action(n: int) -> TorchAction:
        # torch asks for step 0 at construction; answer as for the first step we run.
        n = max(n, step)
        return TorchAction.WARMUP if n < window.first else TorchAction.RECORD

    prof = torch.profiler.profile(
        activities=activities(device),
        schedule=window_action,
        on_trace_ready=on_trace_ready,
        record_shapes=config.record_shapes,
        profile_memory=config.profile_memory,
        with_stack=config.with_stack,
        with_flops=config.with_flops,
        with_modules=config.with_modules,
        experimental_config=experimental_config(config),
    )
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        # torch writes distributedInfo only for a process group; HTA reads the rank there.
        info = {"backend": "none", "rank": int(rank), "role": role}
        prof.preset_metadata_json("distributedInfo", json.dumps(info))
        prof.preset_metadata_json("rank", str(rank))
    prof.step_num = step  # ProfilerStep#N markers carry the global step
    return prof


def experimental_config(config: ProfilerConfig) -> Any:
    """torch's ``_ExperimentalConfig`` for a window, or None for torch's default.

    - Folded stacks need per-event Python stacks, which torch keeps only in verbose mode.
    - Otherwise ``trace_only``: nothing in the rank reads torch's events (the node agent reads
      the trace), so torch skips building them in ``stop()``. The exported trace is the same;
      the closing step saves that build and most of the free of torch's results (on this
      machine, for 100,000 events: 0.21 s -> 0.06 s of free, 0.58 s -> 0.55 s of stop).
      torch refuses it with ``with_stack`` (it warns and drops it); torch releases before
      mid-2026 do not know it (a ``TypeError``), and keep their default.
    """
    make = torch.profiler._ExperimentalConfig
    if config.export_type == "stacks":
        return make(verbose=True)
    if config.with_stack:
        return None
    try:
        return make(trace_only=True)
    except TypeError:  # a torch without trace_only: its default post-processing
        return None


@dataclass(frozen=True)
class TraceTarget:
    """Where one rank writes its traces: the run directory (its staging copy on this node when
    ``remote_run_dir`` is a URL the agent uploads to)."""

    rank: int
    device: str
    run_directory: str
    remote_run_dir: str | None
    role: str = "policy"


def export_trace(prof: Any, job: TraceJob) -> TraceJob:
    """Write the stopped profiler's raw chrome trace where ``job`` says (never half of one: a
    temporary name, then a rename); the job, for the agent."""
    with atomic_path(job.raw_path) as tmp:
        prof.export_chrome_trace(tmp)
    return job


def role_name(role: str) -> str:
    """``role`` as part of a file's name (a role is any string)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", role)


def trace_job(
    config: ProfilerConfig,
    target: TraceTarget,
    window: Window,
    steps: tuple[int, int],
    partial: bool,
    report_to: dict[str, str] | None,
    cpu_wait_ns: int | None = None,
) -> TraceJob:
    """The job for a rank's trace of ``window``: where its raw trace goes (its directory made)
    and what the agent makes of it (``cpu_wait_ns``: its steps' wait for a CPU, if measured)."""
    first, last = steps
    export, rank, index = config.export_type, target.rank, window.index
    if export == "none":  # summarised from a temporary trace, then deleted
        os.makedirs(target.run_directory, exist_ok=True)
        final, upload = None, None
        # Named by role and process too: the rank 0 of each role (policy, rollout) closes the
        # same window at the same moment in the same directory.
        who = role_name(target.role)
        name = f".{who}.rank{rank}.window{index:04d}.{os.getpid()}.json"
        raw = contained(target.run_directory, name)
    else:
        wdir = window_dir(target.run_directory, index, first, last, window.kind)
        rdir = contained(wdir, target.role)  # one sub-directory per role: HTA opens each
        os.makedirs(rdir, exist_ok=True)
        final = trace_path(rdir, rank, export)
        raw = trace_path(rdir, rank, "chrome_trace")  # the agent compresses or folds it
        upload = None
        if target.remote_run_dir is not None:
            where = (os.path.basename(wdir), target.role, os.path.basename(final))
            upload = join(target.remote_run_dir, *where)
    return TraceJob(
        rank=rank,
        window=index,
        steps=(first, last),
        partial=partial,
        device=target.device,
        top_k=config.top_k,
        with_flops=config.with_flops,
        collectives_cap=config.collectives_cap,
        export_type=export,
        raw_path=raw,
        final_path=final,
        report_to=report_to,
        upload_to=upload,
        storage_options=dict(config.storage_options),
        keep_local=config.keep_local,
        cpu_wait_ns=cpu_wait_ns,
    )


def free_results(prof: Any) -> None:
    """Free a stopped profiler's results now: torch's Kineto trace (and its C++ events, unless
    the window was ``trace_only``). Left to themselves they outlive the profiler object, which
    sits in a reference cycle (its ``action_map`` holds its own bound methods), until whichever
    garbage collection reaches it, inside some later training step. Their destructor holds the
    GIL for all of its glibc ``free`` (pybind11's ``dealloc_without_manipulating_gil``; for
    100,000 events 0.06-0.11 s, 0.2-0.35 s with the C++ events), so no other thread can take it
    off this process: the caller picks the moment. Call it only after ``stop()`` has returned
    (the trace handler reads them)."""
    inner = getattr(prof, "profiler", None)
    if inner is not None and getattr(inner, "kineto_results", None) is not None:
        inner.kineto_results = None


def staging_dir(config: ProfilerConfig, run_url: str) -> str:
    """This node's local copy of a remote run directory: ``<staging>/<run name>``.

    ``<staging>`` is ``$RAY_PROFILER_STAGING`` on this node, else the config's
    ``staging_path``, else ``<tmp>/ray-profiler-<uid>/staging``; made private to this user
    and checked as ``node_dir.private_tree`` does (the traces wait there for their upload).

    Raises:
        PermissionError: the staging directory is a link, another user's or open to others.
    """
    chosen = os.environ.get(STAGING_ENV) or config.staging_path
    what = "the staging directory"
    where = (
        private_tree(Path(chosen), what, STAGING_ENV)
        if chosen
        else node_dir("staging", what=what, env=STAGING_ENV)
    )
    name = run_url.rstrip("/").rsplit("/", 1)[-1]
    return contained(str(where), name)


def local_run_dir(
    config: ProfilerConfig, run_directory: str | None, remote: str | None
) -> tuple[str | None, str | None]:
    """Where a rank writes: ``run_directory``, or its staging copy on this node when the run
    directory is the URL ``remote``; and why not, when the staging directory is refused."""
    if remote is None:
        return run_directory, None
    try:
        return staging_dir(config, remote), None
    except (OSError, ValueError) as exc:
        return None, str(exc)


def pick_device(config: ProfilerConfig) -> tuple[str, str | None]:
    """``cuda`` when the config asks for it and this process has a GPU, else ``cpu`` (with a
    note saying why, when cuda was asked for)."""
    if "cuda" not in config.activities:
        return "cpu", None
    try:
        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    if has_gpu:
        return "cuda", None
    return "cpu", "cuda requested but this rank has no GPU: recording cpu only"


def claim(owner: Any) -> bool:
    """Take the process's one torch profiler for ``owner``; False if another owner holds it."""
    global _CLAIMED_BY
    with _CLAIM_LOCK:
        if _CLAIMED_BY is not None and _CLAIMED_BY is not owner:
            return False
        _CLAIMED_BY = owner
        return True


def release(owner: Any) -> None:
    """Give the process's torch profiler back, if ``owner`` holds it."""
    global _CLAIMED_BY
    with _CLAIM_LOCK:
        if _CLAIMED_BY is owner:
            _CLAIMED_BY = None


def other_profiler_reason(owner: Any) -> str | None:
    """Why ``owner`` must not start a profiler now (another one runs in this process), or None."""
    with _CLAIM_LOCK:
        if _CLAIMED_BY is not None and _CLAIMED_BY is not owner:
            return f"rank {_CLAIMED_BY.rank}'s profiler is already running in this process"
    try:
        running = torch._C._autograd._profiler_enabled()
    except Exception:
        running = False
    if running:
        return "another torch.profiler session is already running in this process"
    return None
