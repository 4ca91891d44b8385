"""The node agent: one detached Ray actor per node that finishes every rank's closed trace.

It runs in its own process, never a training rank's: named ``agent-<version>-<node id>`` in
namespace ``profiler_agents`` (``coordinator.protocol.names``), ``num_cpus=0``, pinned to its node
with ``NodeAffinitySchedulingStrategy`` and created on demand by the first rank there that needs
it (``worker_ext.rank.agent_link``). Being detached, it outlives every rank (a killed rank does
not cost the other ranks of its node their summaries) and stops with the cluster (or
``stop_node_agents``). It is an asyncio actor with two event loops: window commands, pings and
stack reads in the control lane (``CONTROL_LANE``, a concurrency group of its own), everything
else in Ray's default group; so a relay taking its group's partials does not hold the next
window's start behind its event loop's queue. Its own work runs in two more lanes: summaries
(built one at a time, then pushed to the coordinator) and file work (compression, folded
stacks, clean-up, upload) on one thread of the lowest CPU priority, so every pending summary
goes before any compression, and the file work yields the CPU to training.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import re
import time
from collections.abc import Callable, Hashable
from typing import Any, TypeVar, cast

import ray

from coordinator.protocol.agent_rpc import (
    CONTROL_LANE,
    AgentRPC,
    NodeCommand,
    NodeCommandReply,
    PlanAnswer,
    PlanPost,
    SnapshotAsked,
    SnapshotRequest,
)
from coordinator.protocol.memory_replies import AgentMemoryReply, MemoryWatch
from coordinator.protocol.names import AGENT_NAMESPACE, agent_name, is_agent_name
from coordinator.protocol.reasons import reason
from coordinator.protocol.replies import Reason
from coordinator.protocol.stack_replies import ProcessStack, StackRequest
from coordinator.protocol.summary_codec import RankSummary, decode_summary
from coordinator.protocol.timeline import PieceRank, TimelinePiece
from coordinator.raylink.handle_stubs import install_handle_stubs
from worker_ext.agent.exit_watch import ExitWatch
from worker_ext.agent.idle_exit import IDLE_EXIT_S, IdleExit, exit_actor
from worker_ext.agent.kineto_daemon import ensure_daemon
from worker_ext.agent.memory_sampler import (
    MemorySampler,
    ask_for_snapshot,
    check_snapshot_request,
    check_watch,
)
from worker_ext.agent.partials import (
    LINGER_S,
    Gather,
    GroupKey,
    PartialRoutes,
    command_key,
    group_key,
    node_blob,
)
from worker_ext.agent.plan_posts import BoardWriter, sweep_boards
from worker_ext.agent.rank_fanout import RankFanOut, command_problem
from worker_ext.agent.stack_reader import check_request, read_stacks, sweep_dumps
from worker_ext.agent.timeline_pieces import PieceStore, sweep_left
from worker_ext.agent.trace_jobs import (
    JobResult,
    TraceJob,
    fetch_kineto_trace,
    finish_trace,
    lowest_cpu_priority,
    summarise_job,
    upload_trace,
)
from worker_ext.agent.trace_reports import TraceReports

log = logging.getLogger(__name__)
PUBLISH_TIMEOUT_S = 30.0
F = TypeVar("F", bound=Callable[..., Any])


def control_lane(method: F) -> F:
    """Serve ``method`` on the agent's control lane (``CONTROL_LANE``)."""
    return cast(F, ray.method(concurrency_group=CONTROL_LANE)(method))


class NodeAgent(AgentRPC):
    """The node agent's body (see the module docstring); every method is called through Ray."""

    def __init__(self, idle_exit_s: float = IDLE_EXIT_S) -> None:
        self._coordinators: dict[tuple[str, str], Any] = {}
        # Summaries hold the GIL while they parse: one at a time is as fast as several.
        self._summaries = concurrent.futures.ThreadPoolExecutor(1, "profiler-summary")
        self._files = concurrent.futures.ThreadPoolExecutor(
            1, "profiler-files", initializer=lowest_cpu_priority
        )
        # Kineto windows wait for libkineto's file on threads of their own, one per window,
        # and are summarised at the lowest CPU priority.
        self._waits = concurrent.futures.ThreadPoolExecutor(256, "profiler-kineto")
        self._quiet = concurrent.futures.ThreadPoolExecutor(
            1, "profiler-kineto-summary", initializer=lowest_cpu_priority
        )
        self.stubs = install_handle_stubs(own=("coordinator.", "worker_ext.agent."))
        self._node = str(ray.get_runtime_context().get_node_id())
        self.name = agent_name(self._node)
        self._fanout = RankFanOut(self.name, self._node, on_start=self._expect)
        self._routes = PartialRoutes(self.name, self._call_agent, self._push_partial)
        self._partials: Gather[RankSummary] = Gather(
            node_blob(self._node), self._routes.to_relay(self._node), LINGER_S
        )
        self._idle = IdleExit(idle_exit_s, self._owners_live, self._leave)
        self._files.submit(_sweep_node)  # what processes gone since the last agent left
        self._traces = TraceReports(self._send_traces)
        self._in_flight = 0  # trace jobs being processed
        self._owners: set[tuple[str, str]] = set()
        self._pieces = PieceStore()  # merged window traces of this node's ranks
        self._boards = BoardWriter(self._node)  # plan boards of this node's SPMD ranks
        self._memory = MemorySampler(self._node)  # the memory of this node's ranks
        session = ray.get_runtime_context().get_session_name()  # attached ranks' processes:
        self._exits = ExitWatch(self._rank_exited, session=session, since=time.time())

    def _leave(self) -> None:
        """Idle with no live run: the merged pieces go with the agent (``IdleExit``)."""
        self._pieces.drop_all()
        exit_actor()

    @control_lane
    async def ping(self) -> int:
        """The agent's pid."""
        self._idle.touch()
        return os.getpid()

    @control_lane
    async def command(self, cmd: NodeCommand) -> NodeCommandReply:
        """A window command for the ranks of some nodes: this node's ranks are called here, the
        others' through their agents (``worker_ext.agent.rank_fanout``)."""
        self._idle.touch(cmd.get("idle_exit_s") if isinstance(cmd, dict) else None)
        if isinstance(cmd, dict) and isinstance(cmd.get("owner"), str):
            namespace, _, name = cmd["owner"].partition("#")[0].partition("/")
            self._owners.add((namespace, name))
        if command_problem(cmd) is None and cmd["method"] == "start_profile":
            self._routes.lead(cmd)
        return await self._fanout.command(cmd)

    @control_lane
    async def post_plan(self, post: PlanPost) -> PlanAnswer:
        """A trainer's plan board for this node's SPMD ranks: written where they look, then
        their acknowledgements awaited (``worker_ext.agent.plan_posts``)."""
        self._idle.touch()
        return await self._boards.post(post)

    @control_lane
    async def read_stacks(self, req: StackRequest) -> list[ProcessStack]:
        """The stacks of this node's processes that ``req`` lists (``stack_reader``)."""
        self._idle.touch()
        check_request(req)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._files, sweep_dumps)
        return await loop.run_in_executor(None, read_stacks, req)

    @control_lane
    async def watch_memory(self, watch: MemoryWatch) -> AgentMemoryReply:
        """Sample ``watch``'s processes from now on (``memory_sampler``); what was sampled
        since the last watch. A watch counts as use: the agent stays while a run samples."""
        self._idle.touch()
        check_watch(watch)
        return await asyncio.get_running_loop().run_in_executor(None, self._memory.watch, watch)

    @control_lane
    async def request_snapshots(self, req: SnapshotRequest) -> list[SnapshotAsked]:
        """Ask each of ``req``'s processes for a CUDA memory snapshot to its path."""
        self._idle.touch()
        return [
            {"pid": int(pid), "asked": why is None, "reason": why}
            for pid, path in check_snapshot_request(req)
            for why in [ask_for_snapshot(int(pid), path)]
        ]

    async def collect_partial(
        self, report_to: dict[str, str], window: int, node: str, blob: bytes
    ) -> bool:
        """A node partial of the group this agent relays (from that node's agent); True once
        the group's merged partial is in the coordinator."""
        self._idle.touch()
        return await self._routes.collect(report_to, window, node, blob)

    def _expect(self, cmd: NodeCommand, node: str, keys: list[tuple[str, int]]) -> None:
        """Ranks of this node started a window: wait for their summaries, and send the node's
        partial to the command's relay."""
        window = cmd["args"][0].get("index") if cmd["args"] else None
        if not isinstance(window, int):
            return
        for tid in {t for t, _ in keys}:
            ranks: set[Hashable] = {r for t, r in keys if t == tid}
            self._partials.expect(command_key(cmd, tid, window), ranks)
        self._routes.learn(cmd, node, keys)

    async def _push_partial(self, key: GroupKey, report_to: dict[str, str], blob: bytes) -> bool:
        return bool(await self._call(report_to, "ingest_partial", blob))

    async def _call_agent(self, name: str, method: str, *args: Any) -> Any:
        handle = await self._fanout.agent(name)
        return await getattr(handle, method).remote(*args)

    async def _owners_live(self) -> bool:
        """Whether a coordinator this agent served still has a live run."""
        for namespace, name in self._owners | set(self._coordinators):
            try:
                loop = asyncio.get_running_loop()
                get = functools.partial(ray.get_actor, name, namespace=namespace)
                handle = await loop.run_in_executor(None, get)
                ping = await asyncio.wait_for(handle.ping.remote(), PUBLISH_TIMEOUT_S)
                if ping.get("live"):
                    return True
            except Exception:
                continue  # gone, or not answering: it does not keep this agent alive
        return False

    async def watch_exits(self) -> None:
        """An attached rank 0 of this node keeps its steps in a step file: once its process is
        gone, they go to its coordinator (``exit_watch``)."""
        self._idle.touch()
        self._exits.watch()

    async def _rank_exited(self, owner: dict[str, Any], last: int, walls: Any) -> Any:
        to = owner["report_to"]  # (its run, passed by _call, and the process: checked there)
        self._owners.add((to["namespace"], to["name"]))
        args = (owner["rank"], owner["generation"], last, walls)
        return await self._call(to, "rank_exited", *args, pid=owner["pid"])

    async def serve_kineto(self, directory: str) -> int:
        """Play libkineto's daemon for this node's processes in ``directory`` (their
        ``KINETO_IPC_SOCKET_DIR``), from a process of the agent's own; that process's pid."""
        self._idle.touch()
        if not isinstance(directory, str) or os.path.normpath(directory) != directory:
            raise ValueError(f"{directory!r} is not a normalised directory path")
        if not os.path.isabs(directory):
            raise ValueError(f"{directory!r} is not an absolute path")
        return await asyncio.get_running_loop().run_in_executor(None, ensure_daemon, directory)

    async def read_trace_chunk(self, path: str, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes of a trace file on this node from ``offset`` (b"" at its end).

        Serves trace files of the trace layout only (``window_*/<role>/rank*.pt.trace.json[.gz]``,
        ``rank*.stacks.txt``), for ``coordinator.ops.collect``; anything else is a ValueError.
        """
        self._idle.touch()
        if not is_trace_file(path):
            raise ValueError(f"{path!r} is not a trace file of a profiling window")
        if not isinstance(offset, int) or not isinstance(size, int) or offset < 0 or size < 1:
            raise ValueError("offset must be an int >= 0 and size an int >= 1")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, _read_chunk, path, offset, min(size, MAX_CHUNK))

    async def merge_traces(
        self, ranks: list[PieceRank], min_us: float, max_events: int
    ) -> TimelinePiece:
        """This node's ranks of a window merged into one piece (``coordinator.ops.timeline``),
        on the file lane (it yields the CPU to training); read it with ``read_piece_chunk``,
        then ``drop_piece``."""
        self._idle.touch()
        make = functools.partial(self._pieces.make, ranks, min_us, max_events, is_trace_file)
        return await asyncio.get_running_loop().run_in_executor(self._files, make)

    async def read_piece_chunk(self, piece: str, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes of a piece ``merge_traces`` made, from ``offset``."""
        self._idle.touch()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self._pieces.read, piece, offset, size)

    async def drop_piece(self, piece: str) -> bool:
        """Remove a piece once read; whether it was there."""
        return self._pieces.drop(piece)

    async def process(self, job: TraceJob) -> JobResult:
        """Summarise and push (in its node partial), then finish and upload the trace file;
        never raises."""
        self._in_flight += 1
        try:
            with self._idle.busy():
                return await self._process(job)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:  # the node's traces are done: report them together
                self._traces.send_now()

    async def _process(self, job: TraceJob) -> JobResult:
        loop = asyncio.get_running_loop()
        lost = await loop.run_in_executor(self._waits, fetch_kineto_trace, job)  # kineto windows
        if lost is not None:
            if job.report_to:
                await self._notify(job, lost.errors[-1])
            if job.report_to and job.final_path is not None:  # (else the window waits for it)
                self._stored(job, lost, lost.errors[-1])
            return lost
        # A kineto window's summary yields the CPU to training (the point of that engine).
        lane = self._summaries if job.kineto is None else self._quiet
        res, blob, folded = await loop.run_in_executor(lane, summarise_job, job)
        if blob is not None:
            res.pushed = await self._publish(job, blob, res)
            if not res.pushed:
                res.summary = blob  # it rides on the rank's next reply
        elif job.report_to:
            await self._notify(job, res.errors[-1])
        await loop.run_in_executor(self._files, finish_trace, job, folded, res)
        self._files.submit(_sweep_node)  # the node's dead processes' files, now and then
        self._pieces.sweep()  # (merged pieces whose caller timed out)
        if job.upload_to is not None:
            await loop.run_in_executor(self._files, upload_trace, job, res)
        if job.report_to and job.final_path is not None:
            self._stored(job, res)
        return res

    async def _call(self, report_to: dict[str, str], method: str, *args: Any, **kwargs: Any) -> Any:
        """Call the coordinator ``report_to`` names; a handle that has gone stale (the
        coordinator was killed, restarted or replaced by a new run) is looked up once more."""
        key = (report_to["namespace"], report_to["name"])
        for attempt in (1, 2):
            handle = self._coordinators.get(key)
            try:
                if handle is None:  # a blocking lookup: off the event loop
                    loop = asyncio.get_running_loop()
                    handle = await loop.run_in_executor(
                        None, functools.partial(ray.get_actor, key[1], namespace=key[0])
                    )
                    self._coordinators[key] = handle
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
            summary = decode_summary(blob)
            key = group_key(job.report_to, summary.window)
            pushed = await self._partials.add(key, job.report_to, summary.rank, summary)
            relay_failed = self._routes.relay_failures.get(key)
            if relay_failed is not None:  # pushed all the same; the rank's status says why
                res.errors.append(relay_failed)
            return pushed
        except Exception as exc:
            res.errors.append(reason("publish", exc))
            return False

    def _stored(self, job: TraceJob, res: JobResult, lost: Reason | None = None) -> None:
        """Tell the coordinator where the trace is now, or why it is not (in a batch)."""
        assert job.report_to is not None
        self._traces.add(job.report_to, trace_report(job, res, self._node, lost))

    async def _send_traces(self, report_to: dict[str, str], reports: list[dict[str, Any]]) -> None:
        await self._call(report_to, "traces_stored", reports)

    async def _notify(self, job: TraceJob, why: Reason) -> None:
        """Tell the coordinator at once that this summary is lost. If that fails too, say so
        in the log and in the summary's own error: the coordinator then learns of the loss
        from the rank's next reply, which carries that error."""
        assert job.report_to is not None
        try:
            await self._call(job.report_to, "summary_failed", job.rank, job.window, why)
        except Exception as exc:
            told = f"{type(exc).__name__}: {exc}"
            log.warning(
                "rank %d's summary of window %d is lost (%s), and the coordinator %s could not "
                "be told at once (%s): it learns it from the rank's next reply",
                job.rank,
                job.window,
                why["message"][:200],
                job.report_to.get("name"),
                told,
            )
            why["message"] = (
                f"{why['message']} [the coordinator could not be told at once: {told}]"
            )[:2000]


def trace_report(job: TraceJob, res: JobResult, node: str, lost: Reason | None) -> dict[str, Any]:
    """Where ``job``'s trace is now, or why it is not: a file's error, or ``lost``, why no
    trace came at all (a kineto window libkineto never wrote)."""
    files = [e for e in res.errors if e["where"] not in ("summary", "publish", "relay")]
    return {
        "rank": job.rank,
        "window": job.window,
        "path": res.trace_path,
        "error": lost or (files[-1] if files else None),
        "local_path": res.local_path,
        "node": node,
    }


MAX_CHUNK = 8 << 20
_TRACE_FILE = re.compile(
    r"(^|/)window_\d{4,}_(auto_)?steps_\d+-\d+/([A-Za-z0-9][A-Za-z0-9._-]{0,63}/)?"
    r"rank\d+(-\d+)?\.(pt\.trace\.json(\.gz)?|stacks\.txt)$"
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


def stop_node_agents() -> list[str]:
    """Kill every node agent of this version on the cluster (they are detached); their names."""
    killed = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        name = a.get("name", "")
        if a.get("namespace") == AGENT_NAMESPACE and is_agent_name(name):
            with contextlib.suppress(ValueError):
                ray.kill(ray.get_actor(name, namespace=AGENT_NAMESPACE))
                killed.append(name)
    return killed


def _sweep_node() -> None:
    """What the node's gone processes and an earlier agent left: stack dumps, plan boards,
    merged pieces (each sweep never raises)."""
    sweep_dumps()
    sweep_boards()
    sweep_left()
