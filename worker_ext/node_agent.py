"""Where a rank's closed trace goes: one helper process per node, never the training process.

In a Ray cluster the helper is the node agent: a detached Ray actor with ``num_cpus=0``, one per
node, named ``agent-<version>-<node id>`` in namespace ``profiler_agents``, pinned to its node with
``NodeAffinitySchedulingStrategy`` and created on demand by the first rank there that needs it.
Being detached, it outlives every rank (a killed rank does not cost the other ranks of its node
their summaries) and it stops with the cluster (or ``stop_node_agents``). It is an asyncio actor
with two lanes: summaries (built one at a time, then pushed to the coordinator) and file work
(compression, folded stacks, clean-up) on one thread of the lowest CPU priority, so every
pending summary goes before any compression, and the file work yields the CPU to training.

Outside Ray (a ``RankProfiler`` in a plain process) the helper is one spawned child process per
training process. Either way the training process only submits a small ``TraceJob`` and gets a
``JobResult`` back through a ``concurrent.futures.Future``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import multiprocessing
import os
import re
import sys
import threading
import types
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Protocol

from worker_ext.trace_jobs import (
    JobResult,
    TraceJob,
    finish_trace,
    lowest_cpu_priority,
    reason,
    run_job,
    summarise_job,
    upload_trace,
)

AGENT_NAMESPACE = "profiler_agents"
# Part of the agent's name: a cluster that still runs an agent of an older protocol gets a new one.
AGENT_VERSION = "v2"
PUBLISH_TIMEOUT_S = 30.0
START_TIMEOUT_S = 120.0


class TraceHelper(Protocol):
    """Runs ``TraceJob``s in a process other than the caller's."""

    kind: str

    def prepare(self) -> int | None:
        """Start the helper now (not in a window's closing step); its pid, or None."""
        ...

    def submit(self, job: TraceJob) -> concurrent.futures.Future[JobResult]:
        """Queue ``job``; the future fails if the helper dies or cannot be reached."""
        ...

    def forget(self) -> None:
        """The helper died: start a new one on the next ``prepare``/``submit``."""
        ...


class NodeAgent:
    """The node agent's body (see the module docstring); every method is called through Ray."""

    def __init__(self) -> None:
        self._coordinators: dict[tuple[str, str], Any] = {}
        # Summaries hold the GIL while they parse: one at a time is as fast as several.
        self._summaries = concurrent.futures.ThreadPoolExecutor(1, "profiler-summary")
        self._files = concurrent.futures.ThreadPoolExecutor(
            1, "profiler-files", initializer=lowest_cpu_priority
        )
        import ray

        self._node = str(ray.get_runtime_context().get_node_id())

    async def ping(self) -> int:
        """The agent's pid."""
        return os.getpid()

    async def read_trace_chunk(self, path: str, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes of a trace file on this node from ``offset`` (b"" at its end).

        Serves trace files of the trace layout only (``window_*/rank*.pt.trace.json[.gz]``,
        ``rank*.stacks.txt``), for ``coordinator.collect``; anything else is a ValueError.
        """
        if not is_trace_file(path):
            raise ValueError(f"{path!r} is not a trace file of a profiling window")
        if not isinstance(offset, int) or not isinstance(size, int) or offset < 0 or size < 1:
            raise ValueError("offset must be an int >= 0 and size an int >= 1")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, _read_chunk, path, offset, min(size, MAX_CHUNK))

    async def process(self, job: TraceJob) -> JobResult:
        """Summarise and push, then finish and upload the trace file; never raises."""
        loop = asyncio.get_running_loop()
        res, blob, folded = await loop.run_in_executor(self._summaries, summarise_job, job)
        if blob is not None:
            res.pushed = await self._publish(job, blob, res)
            if not res.pushed:
                res.summary = blob  # it rides on the rank's next reply
        elif job.report_to:
            await self._notify(job, res.errors[-1])
        await loop.run_in_executor(self._files, finish_trace, job, folded, res)
        if job.upload_to is not None:
            await loop.run_in_executor(self._files, upload_trace, job, res)
        if job.report_to and job.final_path is not None:
            await self._stored(job, res)
        return res

    async def _call(self, report_to: dict[str, str], method: str, *args: Any, **kwargs: Any) -> Any:
        """Call the coordinator ``report_to`` names; a handle that has gone stale (the
        coordinator was killed, restarted or replaced by a new run) is looked up once more."""
        import ray

        key = (report_to["namespace"], report_to["name"])
        for attempt in (1, 2):
            handle = self._coordinators.get(key)
            try:
                if handle is None:
                    handle = self._coordinators[key] = ray.get_actor(key[1], namespace=key[0])
                ref = getattr(handle, method).remote(
                    report_to["trainer_id"], *args, run=report_to.get("run"), **kwargs
                )
                return await asyncio.wait_for(ref, PUBLISH_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ValueError):
                self._coordinators.pop(key, None)
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def _publish(self, job: TraceJob, blob: bytes, res: JobResult) -> bool:
        if not job.report_to:
            return False
        try:
            return bool(await self._call(job.report_to, "ingest_summary", job.rank, blob))
        except Exception as exc:
            res.errors.append(reason("publish", exc))
            return False

    async def _stored(self, job: TraceJob, res: JobResult) -> None:
        """Tell the coordinator where the trace is now, or why it is not."""
        assert job.report_to is not None
        files = [e for e in res.errors if e["where"] not in ("summary", "publish")]
        with contextlib.suppress(Exception):
            await self._call(
                job.report_to,
                "trace_stored",
                job.rank,
                job.window,
                res.trace_path,
                files[-1] if files else None,
                local_path=res.local_path,
                node=self._node,
            )

    async def _notify(self, job: TraceJob, why: dict[str, str]) -> None:
        """Tell the coordinator at once that this summary is lost."""
        assert job.report_to is not None
        with contextlib.suppress(Exception):
            await self._call(job.report_to, "summary_failed", job.rank, job.window, why)


MAX_CHUNK = 8 << 20
_TRACE_FILE = re.compile(
    r"(^|/)window_\d{4,}_steps_\d+-\d+/rank\d+\.(pt\.trace\.json(\.gz)?|stacks\.txt)$"
)


def is_trace_file(path: object) -> bool:
    """Whether ``path`` names an existing trace file of the trace layout on this node."""
    return (
        isinstance(path, str)
        and "/../" not in path
        and bool(_TRACE_FILE.search(path))
        and os.path.isfile(path)
    )


def _read_chunk(path: str, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


_ACTOR: Any = None


def _agent_actor() -> Any:
    global _ACTOR
    if _ACTOR is None:
        import ray

        _ACTOR = ray.remote(num_cpus=0, max_restarts=0)(NodeAgent)
    return _ACTOR


def agent_name(node_id: str) -> str:
    """The node agent's actor name on the node with this Ray node id."""
    return f"agent-{AGENT_VERSION}-{node_id}"


def stop_node_agents() -> list[str]:
    """Kill every node agent of this version on the cluster (they are detached); their names."""
    import ray

    killed = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        name = a.get("name", "")
        if a.get("namespace") == AGENT_NAMESPACE and name.startswith(f"agent-{AGENT_VERSION}-"):
            with contextlib.suppress(ValueError):
                ray.kill(ray.get_actor(name, namespace=AGENT_NAMESPACE))
                killed.append(name)
    return killed


class RayNodeAgentHelper:
    """The node agent of the node this process runs on."""

    kind = "node_agent"

    def __init__(self) -> None:
        self._agent: Any = None
        self._lock = threading.Lock()

    def _handle(self) -> Any:
        with self._lock:
            if self._agent is None:
                import ray
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                node = ray.get_runtime_context().get_node_id()
                self._agent = (
                    _agent_actor()
                    .options(
                        name=agent_name(node),
                        namespace=AGENT_NAMESPACE,
                        lifetime="detached",
                        get_if_exists=True,
                        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                    )
                    .remote()
                )
            return self._agent

    def prepare(self) -> int | None:
        import ray

        try:
            return int(ray.get(self._handle().ping.remote(), timeout=START_TIMEOUT_S))
        except ray.exceptions.RayActorError:  # the agent this process knew died: a new one
            self.forget()
            return int(ray.get(self._handle().ping.remote(), timeout=START_TIMEOUT_S))

    def submit(self, job: TraceJob) -> concurrent.futures.Future[JobResult]:
        fut: concurrent.futures.Future[JobResult] = self._handle().process.remote(job).future()
        return fut

    def forget(self) -> None:
        with self._lock:
            self._agent = None


class LocalProcessHelper:
    """A spawned child of this process (used when this process is not part of a Ray cluster)."""

    kind = "local_process"

    def __init__(self) -> None:
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                ctx = multiprocessing.get_context("spawn")  # never fork a process running torch
                self._pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx)
            return self._pool

    def prepare(self) -> int | None:
        import os

        with _main_hidden():
            fut = self._executor().submit(os.getpid)
        return int(fut.result(timeout=START_TIMEOUT_S))

    def submit(self, job: TraceJob) -> concurrent.futures.Future[JobResult]:
        with _main_hidden():  # the child process is started by the first submit
            try:
                return self._executor().submit(run_job, job)
            except BrokenProcessPool:
                self.forget()
                return self._executor().submit(run_job, job)

    def forget(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


@contextlib.contextmanager
def _main_hidden() -> Iterator[None]:
    """Start spawned children without re-running the caller's script.

    A spawned child imports the parent's ``__main__`` from its path, which runs a script that
    has no ``if __name__ == "__main__"`` guard (its training loop included) a second time.
    """
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


_HELPERS: dict[str, TraceHelper] = {}


def default_helper() -> TraceHelper:
    """The node agent when this process is part of a Ray cluster, else a local child process.

    One per process, so every rank profiler in it shares one handle (and one child process).
    """
    ray = sys.modules.get("ray")
    in_ray = ray is not None and ray.is_initialized()
    kind = RayNodeAgentHelper.kind if in_ray else LocalProcessHelper.kind
    helper = _HELPERS.get(kind)
    if helper is None:
        helper = _HELPERS[kind] = RayNodeAgentHelper() if in_ray else LocalProcessHelper()
    return helper
