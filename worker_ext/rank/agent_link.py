"""A rank's link to the agent that finishes its closed traces, never in the training process.

In a Ray cluster that is the node's agent (``worker_ext.agent.node_agent``), created on demand by
the first rank of the node that needs it. Outside Ray (a ``RankProfiler`` in a plain process) it
is one spawned child process per training process, the local agent. Either way the training
process only submits a small ``TraceJob`` and gets a ``JobResult`` back through a
``concurrent.futures.Future``.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Protocol

from coordinator.protocol.agent_rpc import CONTROL_CALLS, CONTROL_LANE
from coordinator.protocol.names import AGENT_NAMESPACE, agent_name
from worker_ext.agent.kineto_daemon import ensure_daemon
from worker_ext.agent.node_agent import NodeAgent
from worker_ext.agent.spawned import spawn_pool, submit_to
from worker_ext.agent.trace_jobs import JobResult, TraceJob, run_job

# The first start of an agent can wait for a busy node (Kineto warm-ups on 2 cores: tens of s).
START_TIMEOUT_S = 120.0


class AgentLink(Protocol):
    """The agent a rank hands its ``TraceJob``s to, in a process other than the rank's."""

    kind: str
    name: str | None
    """The agent's actor name, once known (node agents only)."""

    def prepare(self) -> int | None:
        """Start the agent now (not in a window's closing step); its pid, or None."""
        ...

    def submit(self, job: TraceJob) -> concurrent.futures.Future[JobResult]:
        """Queue ``job``; the future fails if the agent dies or cannot be reached."""
        ...

    def forget(self) -> None:
        """The agent died: start a new one on the next ``prepare``/``submit``."""
        ...

    def serve_kineto(self, directory: str) -> None:
        """Have the agent play libkineto's daemon in ``directory`` (not awaited)."""
        ...


_ACTOR: Any = None


def _agent_actor() -> Any:
    global _ACTOR
    if _ACTOR is None:
        import ray

        lanes = {CONTROL_LANE: CONTROL_CALLS}
        _ACTOR = ray.remote(num_cpus=0, max_restarts=0, concurrency_groups=lanes)(NodeAgent)
    return _ACTOR


def _node_agent(node: str) -> Any:
    """The node agent of ``node``: the running one, or a new one pinned there."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return (
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


def ensure_node_agents(workers: list[Any], timeout_s: float = START_TIMEOUT_S) -> list[str]:
    """A node agent on every node where one of ``workers`` runs, and on this process's node,
    so that ``stacks()`` reaches ranks no window has configured (and the driver). Blocking: the
    hooks call it from a background thread at attach. Returns the nodes whose agent answered.
    """
    import ray

    from coordinator.raylink.actor_table import actor_id, place_actors

    ids = {a for a in (actor_id(w) for w in workers) if a}
    nodes = {p.node_id for p in place_actors(ids).values() if p.alive and p.node_id}
    nodes.add(str(ray.get_runtime_context().get_node_id()))
    agents = {node: _node_agent(node) for node in sorted(nodes)}
    pings = {node: a.ping.remote() for node, a in agents.items()}
    ready, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=timeout_s)
    return [node for node, ref in pings.items() if ref in ready]


class NodeAgentLink:
    """The node agent of the node this process runs on."""

    kind = "node_agent"

    def __init__(self) -> None:
        self.name: str | None = None
        self._agent: Any = None
        self._lock = threading.Lock()

    def _handle(self) -> Any:
        with self._lock:
            if self._agent is None:
                import ray

                node = ray.get_runtime_context().get_node_id()
                self.name = agent_name(node)
                self._agent = _node_agent(node)
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

    def serve_kineto(self, directory: str) -> None:
        self._handle().serve_kineto.remote(directory)


class LocalAgentLink:
    """A spawned child of this process (used when this process is not part of a Ray cluster);
    it leaves when this process is gone."""

    kind = "local_process"
    name: str | None = None

    def __init__(self) -> None:
        self._pool: concurrent.futures.Executor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> concurrent.futures.Executor:
        with self._lock:
            if self._pool is None:
                self._pool = spawn_pool()
            return self._pool

    def prepare(self) -> int | None:
        import os

        fut = submit_to(self._executor(), os.getpid)
        return int(fut.result(timeout=START_TIMEOUT_S))

    def submit(self, job: TraceJob) -> concurrent.futures.Future[JobResult]:
        try:  # the child process is started by the first submit
            return submit_to(self._executor(), run_job, job)
        except BrokenProcessPool:
            self.forget()
            return submit_to(self._executor(), run_job, job)

    def serve_kineto(self, directory: str) -> None:
        submit_to(self._executor(), ensure_daemon, directory)

    def forget(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


_LINKS: dict[str, AgentLink] = {}


def node_id() -> str | None:
    """The Ray node this process runs on, or None outside Ray."""
    ray = sys.modules.get("ray")
    try:
        if ray is not None and ray.is_initialized():
            return str(ray.get_runtime_context().get_node_id())
    except Exception:
        return None
    return None


def default_link() -> AgentLink:
    """The node agent when this process is part of a Ray cluster, else a local child process.

    One per process, so every rank profiler in it shares one handle (and one child process).
    """
    ray = sys.modules.get("ray")
    in_ray = ray is not None and ray.is_initialized()
    kind = NodeAgentLink.kind if in_ray else LocalAgentLink.kind
    agent = _LINKS.get(kind)
    if agent is None:
        agent = _LINKS[kind] = NodeAgentLink() if in_ray else LocalAgentLink()
    return agent
