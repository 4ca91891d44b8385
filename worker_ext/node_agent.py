"""Where a rank's closed trace goes: one helper process per node, never the training process.

In a Ray cluster the helper is the node agent: a Ray actor with ``num_cpus=0``, one per node,
named ``agent-<node id>`` in namespace ``profiler_agents``, pinned to its node with
``NodeAffinitySchedulingStrategy`` and created on demand by the first rank there that needs it.
It builds the summaries (``trace_jobs.run_job``) and pushes them to the coordinator. It is not
detached: it lives as long as the rank (or driver) that created it, and the next rank that needs
it after that creates it again. Outside Ray (a ``RankProfiler`` in a plain process) the helper is
one spawned child process per training process. Either way the training process only submits a
small ``TraceJob`` and gets a ``JobResult`` back through a ``concurrent.futures.Future``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import sys
import threading
import types
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Protocol

from worker_ext.trace_jobs import JobResult, TraceJob, run_job

AGENT_NAMESPACE = "profiler_agents"
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

    def ping(self) -> int:
        """The agent's pid."""
        import os

        return os.getpid()

    def process(self, job: TraceJob) -> JobResult:
        """Summarise, push and finish one trace (``trace_jobs.run_job``)."""
        return run_job(job, self._publish, self._notify)

    def _coordinator(self, report_to: dict[str, str]) -> Any:
        import ray

        key = (report_to["namespace"], report_to["name"])
        handle = self._coordinators.get(key)
        if handle is None:
            handle = self._coordinators[key] = ray.get_actor(key[1], namespace=key[0])
        return handle

    def _publish(self, report_to: dict[str, str], rank: int, blob: bytes) -> bool:
        import ray

        try:
            ref = self._coordinator(report_to).ingest_summary.remote(
                report_to["trainer_id"], rank, blob
            )
            return bool(ray.get(ref, timeout=PUBLISH_TIMEOUT_S))
        except Exception:
            self._coordinators.clear()  # a restarted coordinator is found again next time
            raise

    def _notify(
        self, report_to: dict[str, str], rank: int, window: int, reason: dict[str, str]
    ) -> None:
        self._coordinator(report_to).summary_failed.remote(
            report_to["trainer_id"], rank, window, reason
        )


_ACTOR: Any = None


def _agent_actor() -> Any:
    global _ACTOR
    if _ACTOR is None:
        import ray

        # Threads: one job compresses (zlib lets go of the GIL) while the next is summarised.
        _ACTOR = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)(NodeAgent)
    return _ACTOR


def agent_name(node_id: str) -> str:
    return f"agent-{node_id}"


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
                        get_if_exists=True,
                        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                    )
                    .remote()
                )
            return self._agent

    def prepare(self) -> int | None:
        import ray

        return int(ray.get(self._handle().ping.remote(), timeout=START_TIMEOUT_S))

    def submit(self, job: TraceJob) -> concurrent.futures.Future[JobResult]:
        return self._handle().process.remote(job).future()

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

    One per process: a Ray actor lives while its creator holds a handle, so the process that
    created the node agent keeps its handle for as long as it lives.
    """
    ray = sys.modules.get("ray")
    in_ray = ray is not None and ray.is_initialized()
    kind = RayNodeAgentHelper.kind if in_ray else LocalProcessHelper.kind
    helper = _HELPERS.get(kind)
    if helper is None:
        helper = _HELPERS[kind] = RayNodeAgentHelper() if in_ray else LocalProcessHelper()
    return helper
