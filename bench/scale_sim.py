"""The real coordinator actor driven with thousands of simulated ranks on simulated nodes.

A few Ray actors answer the rank RPCs for many ranks each (``SimRanks``, for the direct path and
registration); a few others play the node agents of many simulated nodes each (``SimAgents``,
4 by default, ``--agent-hosts``): they run the real agent fan-out code
(``worker_ext.agent.rank_fanout``: relay, forwarding by agent name, reply folding; window
commands in the agents' control lane) with ranks answered in process. As many others play the
same agents' summaries (``SimAgents`` in role "summaries", at the lowest CPU priority): they
push realistic summaries (2,000 kernels, the current wire format with breakdown and step times)
over the real agents' path: one node partial per node to its group's relay, whose merge goes to
the coordinator (``ingest_partial``), or with ``--fanout direct`` one summary per rank
(``ingest_summary``), the path before node partials. One process here plays 312 agents and 9
relays at 10,000 ranks: in the process of their command lane, that summary work (a real relay
merges one group) starved the lane of the GIL, and the window commands waited for it (the report
opening a window while summaries arrive took 2.7-3.5 s; the same agents' commands pinged in
0.7-1.7 s). ``SCALE_SIM_SHARED_AGENTS=1`` plays both in one process again.

It prints, for each size: the trainer's step report latency in windows (open, step, close); the
coordinator's own CPU per in-window step (psutil on its pid); its CPU from a close until every
trace is reported (the summaries, with the harness's polls and steps meanwhile);
the time from the close until the cross-rank table lists every rank; a step report's latency
while summaries arrive; ``status()`` latency and size; the coordinator's memory per window; and
its event loop's longest stall (``status()["process"]["loop"]``). ``SCALE_SIM_GC=1`` also prints
what the coordinator's garbage collector walks at the end, by type; ``SCALE_SIM_SLOW=1`` the
slowest turns of its event loop (its CPU, the garbage collection in it, where it was);
``SCALE_SIM_SPY=<py-spy>`` records the coordinator and one agent actor for 10 s after each close;
``SCALE_SIM_FANOUT_LOG=1`` prints the timeline of each window's opening command.

``--collectives 0 200``: one run per count, each rank's summary carrying that many collectives
(issue 56: ``collective_blocks``); after its windows, one ``collectives()`` read of the last, its
time and the coordinator's CPU (the matching, on its reads thread).

Run: RAY_AUTH_MODE=disabled .venv/bin/python bench/scale_sim.py --ranks 1024 10000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

import psutil
import ray

from coordinator import get_or_create_coordinator
from coordinator.core.partial import fold_summaries
from coordinator.protocol.agent_rpc import CONTROL_CALLS, CONTROL_LANE, NodeCommand
from coordinator.protocol.collective_replies import CollectiveBlock, RankCollective
from coordinator.protocol.names import AGENT_NAMESPACE
from coordinator.protocol.partial_codec import encode_partial
from coordinator.protocol.replies import rank_reply  # noqa: E402
from coordinator.protocol.summary_codec import (
    Breakdown,
    KernelRow,
    RankSummary,
    encode_summary,
)
from coordinator.service.node_fanout import group_size
from worker_ext.agent.node_agent import control_lane
from worker_ext.agent.partials import PartialRoutes, group_key
from worker_ext.agent.rank_fanout import Key, RankFanOut, RankReplies
from worker_ext.agent.trace_reports import TraceReports

# A py-spy binary: record the coordinator for 10 s after each close (where its time goes).
SPY = os.environ.get("SCALE_SIM_SPY")
# SCALE_SIM_SPY_STEPS=<s>: also record the coordinator (py-spy, not idle) for <s> seconds from
# each window's first step on, to see what its in-window steps cost.
SPY_STEPS = int(os.environ.get("SCALE_SIM_SPY_STEPS") or 0)
# SCALE_SIM_SPY_GIL=1: record only the samples of threads holding the GIL (who takes it).
SPY_GIL = os.environ.get("SCALE_SIM_SPY_GIL") == "1"
# SCALE_SIM_NICE_AGENTS=1: the simulated agents at the lowest CPU priority, so that they do not
# take the coordinator's (and the driver's) cores, as real agents on their own nodes would not.
NICE_AGENTS = os.environ.get("SCALE_SIM_NICE_AGENTS") == "1"
# SCALE_SIM_NICE_SUMMARIES=0: the actors that play the agents' summaries (built, pushed, relayed
# and merged for 1,250 nodes at 10,000 ranks: the work of other machines) at normal priority;
# by default at the lowest, so that they take the CPU the coordinator and the command path
# leave, not theirs.
NICE_SUMMARIES = os.environ.get("SCALE_SIM_NICE_SUMMARIES", "1") == "1"
GC_CENSUS = os.environ.get("SCALE_SIM_GC") == "1"  # print what the coordinator's GC walks
# SCALE_SIM_SLOW=1: log every turn of the coordinator's event loop that takes over 20 ms of the
# loop thread's CPU, with the coroutine it ran (what a stall is made of).
SLOW_LOG = os.environ.get("SCALE_SIM_SLOW") == "1"
# SCALE_SIM_FANOUT_LOG=1: each window's opening command through the agents, in ms from its
# start: the relays' replies (first, median, last), the replies folded, the end; its CPU.
FANOUT_LOG = os.environ.get("SCALE_SIM_FANOUT_LOG") == "1"
# SCALE_SIM_TRACES=<s>: the agents also report every rank's trace as the real agents do (batched
# per node: ``traces_stored``), the nodes starting over <s> seconds after the close; windows then
# settle. SCALE_SIM_TRACES_EACH=1: one ``trace_stored`` call per rank instead (the path before).
TRACES_S = float(os.environ["SCALE_SIM_TRACES"]) if os.environ.get("SCALE_SIM_TRACES") else None
TRACES_EACH = os.environ.get("SCALE_SIM_TRACES_EACH") == "1"
# SCALE_SIM_SHARED_AGENTS=1: each simulated agent actor also pushes its nodes' summaries and
# relays their groups, in the process whose control lane takes the window commands (as a real
# agent does). By default they are apart: one actor here plays 312 agents and 9 relays at
# 10,000 ranks, whose summary work (a real relay's is one group's) would starve that actor's
# control lane of the GIL, and the report that opens a window meanwhile waits for it.
SHARED_AGENTS = os.environ.get("SCALE_SIM_SHARED_AGENTS") == "1"
STEPS_TO_WINDOW = 100  # the schedule below opens a window every 7 steps
TRACE_EVERY_S = 0.25  # a node's file lane finishes one trace this often
PER_NODE = 8
ARRIVER_WAIT_S = 4.0  # (--collectives: the last window's arriver is matched after 1 s quiet)
RANK_HOSTS = 4  # Ray actors that answer the rank RPCs for the registration and the direct path
KERNELS = 2000
NAMES = [
    f"void at::native::elementwise_kernel<{i}, 4, gemm_{i % 97}>(int, float*)"
    for i in range(KERNELS)
]


def node_of(rank: int) -> str:
    return f"sim-node-{rank // PER_NODE:05d}"


AGENT_HOSTS = 4
"""Ray actors that play the node agents, by default. ``--agent-hosts groups``: one per relay
group, each relaying one group and taking its partials (about sqrt(nodes) calls a window) as a
real relay does; on 2 cores those 35 processes (at 10,000 ranks) take turns on the CPU and the
harness measures the machine's scheduler more than the coordinator (see bench/README.md)."""


def agent_hosts(nodes: int, choice: str) -> int:
    """How many actors play the agents: ``choice`` is a count or ``groups``. Node i is on actor
    i % hosts, so with one per group each group's nodes are spread over every actor and the
    groups' relays (their first nodes) are on different actors."""
    if choice == "groups":
        return max(1, -(-nodes // group_size(nodes)))
    return max(1, int(choice))


def agent_roles() -> str:
    """How the agents are played, for the printout."""
    if SHARED_AGENTS:
        nice = ", nice 19" if NICE_AGENTS else ""
        return f" (commands and summaries in one process each{nice})"
    nice = "nice 19" if NICE_AGENTS or NICE_SUMMARIES else "not niced"
    return f" (their commands; as many play their summaries, {nice})"


def agent_name(index: int, role: str = "commands") -> str:
    """The Ray name of the actor that plays agent actor ``index``'s ``role`` (the ranks' replies
    name the "commands" one: window commands go there)."""
    return f"sim-{'summaries' if role == 'summaries' else 'agents'}-{index}"


def host_of(node: str, hosts: int) -> int:
    return int(node.rsplit("-", 1)[1]) % hosts


def reply(
    rank: int | None,
    hosts: int,
    closed: dict[str, Any] | None = None,
    pending: list[int] | None = None,
) -> dict[str, Any]:
    """A rank's reply; ``rank`` None for the direct path (one actor answers for many ranks, so
    it cannot say which node: the coordinator keeps what the registration told it)."""
    node = node_of(rank) if rank is not None else None
    agent = (
        {"kind": "node_agent", "pid": 1, "name": agent_name(host_of(node, hosts))} if node else None
    )
    return dict(
        rank_reply(
            rank=rank,
            node_id=node,
            device="cuda",
            closed=closed,
            summaries_pending=pending or [],
            agent=agent,
        )
    )


def closing(window: dict[str, Any], step: int) -> dict[str, Any] | None:
    if step < window["last"]:
        return None
    return {
        "window": window["index"],
        "steps": [window["first"], window["last"]],
        "trace_path": f"/sim/window_{window['index']}/rank.pt.trace.json.gz",
        "partial": False,
    }


@ray.remote(num_cpus=0)
class SimRanks:
    """Answers the rank RPCs for many ranks (the direct path and the registration)."""

    def __init__(self, hosts: int) -> None:
        self.window: dict[str, Any] | None = None
        self.hosts = hosts

    def configure_profiler(self, rank, config, run_dir, warm_up=True, report_to=None, role=""):
        return reply(rank, self.hosts)

    def start_profile(self, window, step):
        self.window = window
        return reply(None, self.hosts)

    def profile_step(self, step):
        w = self.window
        closed = closing(w, step) if w else None
        if closed:
            self.window = None
        return reply(None, self.hosts, closed, [closed["window"]] if closed else None)

    def stop_profile(self):
        return reply(None, self.hosts)

    def dump_profiler_summary(self, wait_s=0.0):
        return reply(None, self.hosts)


def template(rank: int, seed: int = 0) -> RankSummary:
    rnd = random.Random(rank * 7919 + seed)
    kernels = [KernelRow(n, rnd.uniform(1.0, 5000.0), rnd.randint(1, 400), 0) for n in NAMES]
    steps = [(s, rnd.uniform(9e5, 1.1e6)) for s in range(3)]
    return RankSummary(
        rank=rank,
        window=0,
        steps=(0, 2),
        partial=False,
        device="cuda",
        kernels=kernels,
        step_us=steps,
        breakdown=Breakdown(6e5, 3e5, 5e4, 5e4, 3e6),
    )


BASE_US = 1.79e15  # an absolute time on a rank's clock (baseTimeNanoseconds / 1e3 + ts)
PER_STEP = 20  # collectives a step
SLOT_US = 10_000.0  # (over the latest arrival and the longest work: a rank runs them in turn)
KINDS = [("broadcast", "0")] + [("all_reduce", "0")] * 9 + [("all_gather", "node")] * 5
KINDS += [("reduce_scatter", "node")] * 5


def collective_blocks(
    ranks: int, per_rank: int, seq: bool = True, seed: int = 0
) -> dict[int, CollectiveBlock]:
    """Each rank's ``CollectiveBlock`` of a window of ``per_rank`` collectives (``--collectives``):
    group "0" is every rank, each node's ranks a group of their own; each step a broadcast and
    all_reduces on "0", all_gathers and reduce_scatters on the node's group; absolute times, each
    node's clock off by up to 5 ms, each rank arriving up to 200 us late, one in 64 up to 5 ms;
    ``seq``: the trace's ``Seq`` (NCCL's), else None (gloo's: matched by step and order)."""
    rnd = random.Random(seed)
    nodes = [node_ranks(first, ranks) for first in range(0, ranks, PER_NODE)]
    clock = [rnd.uniform(-5e3, 5e3) for _ in nodes]
    calls: dict[int, list[RankCollective]] = {r: [] for r in range(ranks)}
    nseq: dict[str, int] = {}
    for i in range(per_rank):
        step, slot = divmod(i, PER_STEP)
        kind, where = KINDS[slot % len(KINDS)]
        nbytes = 1 << rnd.randint(16, 26)
        t0, work = BASE_US + i * SLOT_US, 50.0 + nbytes / 2e4
        groups = [("0", range(ranks))] if where == "0" else [
            (str(1 + n), members) for n, members in enumerate(nodes)
        ]  # fmt: skip
        for name, members in groups:
            nseq[name] = nseq.get(name, -1) + 1
            late = {r: rnd.uniform(0, 200.0) + (rnd.uniform(0, 5e3) if rnd.random() < 1 / 64 else 0)
                    for r in members}  # fmt: skip
            end = t0 + max(late.values()) + work
            for r in members:
                off = clock[r // PER_NODE]
                arrive = t0 + late[r] + off
                calls[r].append(RankCollective(
                    name, nseq[name] if seq else None, kind, nbytes, "float", step, arrive,
                    end + off - arrive, end + off + rnd.uniform(0, 5.0),
                ))  # fmt: skip
    world = tuple(range(ranks))
    return {
        r: CollectiveBlock(
            calls=tuple(cs),
            folded=(),
            cut=0,
            groups=(("0", world), (str(1 + r // PER_NODE), tuple(nodes[r // PER_NODE]))),
            notes=(),
        )
        for r, cs in calls.items()
    }


def node_ranks(rank: int, ranks: int) -> range:
    """The ranks of ``rank``'s simulated node, of ``ranks`` in all."""
    first = rank // PER_NODE * PER_NODE
    return range(first, min(ranks, first + PER_NODE))


class GroupRoutes(PartialRoutes):
    """A real relay relays one group, so its ``Gather`` (keyed without the group) holds one
    group's node partials; an actor here plays the relays of several groups: one set of routes
    per group it relays, so that each group's partial is merged and pushed by itself (about
    sqrt(nodes) ranks each, as the coordinator gets them from real relays)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.args = args
        self.by_group: dict[str, PartialRoutes] = {}
        self.group_of: dict[str, str] = {}  # node -> the group (its first node) it is in

    def lead(self, cmd: NodeCommand) -> None:
        if cmd.get("relay") != self.name:
            return
        group = min(cmd["nodes"])
        for node in cmd["nodes"]:
            self.group_of[node] = group
        self.by_group.setdefault(group, PartialRoutes(*self.args)).lead(cmd)

    async def collect(self, report_to: dict[str, str], window: int, node: str, blob: bytes) -> bool:
        routes = self.by_group.get(self.group_of.get(node, ""))
        if routes is None:
            return await super().collect(report_to, window, node, blob)
        return await routes.collect(report_to, window, node, blob)

    def state(self) -> dict[str, Any]:
        """What the control lane learned from the windows' commands: each node's relay, each
        group it relays and the nodes each group waits for."""
        expected = {g: r.group.expected for g, r in self.by_group.items()}
        return {"relays": self.relays, "group_of": self.group_of, "expected": expected}

    def adopt(self, state: dict[str, Any]) -> None:
        """Take what another process's routes learned (``state()``), for the pushes."""
        self.relays.update(state["relays"])
        self.group_of.update(state["group_of"])
        for group, expected in state["expected"].items():
            self.by_group.setdefault(group, PartialRoutes(*self.args)).group.expected.update(
                expected
            )


@ray.remote(num_cpus=0, concurrency_groups={CONTROL_LANE: CONTROL_CALLS})
class SimAgents(RankFanOut):
    """Plays the node agents of the simulated nodes with ``host_of(node, hosts) == index``.

    ``role`` "commands": their control lane (window commands, relaying them, learning the
    partials' routes); "summaries": their summaries (node partials pushed to the groups' relays,
    the relays' merges and pushes, trace reports), in a process of its own, which takes the
    routes from the "commands" actor of the same index before each push; "both": one process
    for both, as a real agent (``SCALE_SIM_SHARED_AGENTS=1``; see ``SHARED_AGENTS``).
    """

    def __init__(
        self,
        index: int,
        hosts: int,
        nodes: list[str],
        coordinator: str,
        namespace: str,
        per_rank: bool,
        windows: int,
        role: str = "both",
        collectives: tuple[int, int] = (0, 0),
    ) -> None:
        super().__init__(
            agent_name(index),
            nodes[0] if nodes else "",
            hosts=lambda n: host_of(n, hosts) == index,
            on_start=lambda cmd, node, keys: self.routes.learn(cmd, node, keys),
        )
        # The real agents' partial routes: each node's partial to its group's relay, which
        # merges the group's and pushes one partial to the coordinator.
        self.routes = GroupRoutes(self.name, self._call_agent, self._to_coordinator)
        self.report_to = {"namespace": namespace, "name": coordinator, "trainer_id": "sim"}
        self.nodes = nodes
        if NICE_AGENTS or (role == "summaries" and NICE_SUMMARIES):
            os.nice(19)  # real agents run on their own nodes, not on the coordinator's cores
        self.per_rank, self.host_count, self.role, self.index = per_rank, hosts, role, index
        self.coordinator = ray.get_actor(coordinator, namespace=namespace)
        self.blobs: dict[tuple[str, int], list[bytes]] = {}
        if role != "commands":
            self._build(windows, collectives)
        self.window: dict[str, Any] | None = None
        self.trainer = "sim"

    def _build(self, windows: int, collectives: tuple[int, int]) -> None:
        # Every window's summaries built before the run: building them (parsing traces) is the
        # real agents' cost, on their own nodes, not the coordinator's, and here it would take
        # the coordinator's cores. ``collectives``: (ranks, collectives a rank) to carry.
        blocks = collective_blocks(*collectives) if collectives[1] else {}
        for node in self.nodes:
            first = int(node.rsplit("-", 1)[1]) * PER_NODE
            summaries = [template(r) for r in range(first, first + PER_NODE)]
            for s in summaries:
                s.collectives = blocks.get(s.rank)
            for w in range(windows):
                for s in summaries:
                    s.window = w
                if self.per_rank:
                    self.blobs[(node, w)] = [encode_summary(s) for s in summaries]
                else:
                    self.blobs[(node, w)] = [encode_partial(fold_summaries(node, summaries))]

    def ready(self) -> int:
        return sum(len(b) for b in self.blobs.values())

    def pid(self) -> int:
        return os.getpid()

    @control_lane  # as a window command would reach it
    async def ping(self) -> bool:
        return True

    async def call_ranks(self, cmd: NodeCommand, keys: list[Key]) -> RankReplies:
        method, args = cmd["method"], cmd["args"]
        closed = None
        if method == "start_profile":
            self.window = args[0]
        elif method == "profile_step" and self.window is not None:
            closed = closing(self.window, args[0])
        pending = [closed["window"]] if closed else None
        out = {k: reply(k[1], self.host_count, closed, pending) for k in keys}
        return out, []

    @control_lane  # as the real agents: commands on their own thread and event loop
    async def command(self, cmd: NodeCommand) -> Any:
        if cmd["method"] == "start_profile":
            self.routes.lead(cmd)
        return await super().command(cmd)

    async def collect_partial(self, report_to, window, node, blob) -> bool:
        return await self.routes.collect(report_to, window, node, blob)

    def routes_state(self) -> dict[str, Any]:
        return self.routes.state()

    async def take_routes(self) -> int:
        """(role "summaries") The routes the "commands" actor of this index learned."""
        if self.role == "summaries":
            commands = ray.get_actor(agent_name(self.index), namespace=AGENT_NAMESPACE)
            self.routes.adopt(await commands.routes_state.remote())
        return len(self.routes.relays)

    async def _call_agent(self, name: str, method: str, *args: Any) -> Any:
        if self.role == "summaries":  # another node's relay: its summaries' process
            name = agent_name(int(name.rsplit("-", 1)[1]), "summaries")
        return await getattr(await self.agent(name), method).remote(*args)

    async def _to_coordinator(self, key: Any, report_to: dict[str, str], blob: bytes) -> bool:
        return bool(await self.coordinator.ingest_partial.remote("sim", blob, report_to["run"]))

    async def push_window(self, window: int, run: str) -> int:
        """Every node's summaries of ``window``, as the real agents push them once built."""
        await asyncio.gather(*(self._push(node, window, run) for node in self.nodes))
        return len(self.nodes)

    async def report_traces(self, window: int, run: str, spread_s: float) -> int:
        """Every rank's trace report, as the real agents send them: each node's file lane
        finishes its ranks' traces one after another (here one each ``TRACE_EVERY_S``), and
        the node's ``TraceReports`` batches them (``traces_stored``, a call about once a
        second); the nodes start at random times over ``spread_s``. With
        ``SCALE_SIM_TRACES_EACH=1``, one ``trace_stored`` call per rank (the path before)."""
        rnd = random.Random(window)

        async def send(report_to: dict[str, str], reports: list[dict[str, Any]]) -> None:
            await self.coordinator.traces_stored.remote(self.trainer, reports, run=run)

        async def node_traces(node: str, delay: float) -> None:
            await asyncio.sleep(delay)
            first = int(node.rsplit("-", 1)[1]) * PER_NODE
            batches = TraceReports(send)
            for rank in range(first, first + PER_NODE):
                report = {"rank": rank, "window": window, "node": node}
                report["path"] = f"/sim/window_{window}/rank{rank}.pt.trace.json.gz"
                if TRACES_EACH:
                    await self.coordinator.trace_stored.remote(
                        self.trainer, rank, window, report["path"], None, run=run, node=node
                    )
                else:
                    batches.add({**self.report_to, "run": run}, report)
                    await asyncio.sleep(TRACE_EVERY_S)
            await batches.drain()

        await asyncio.gather(*(node_traces(n, rnd.uniform(0, spread_s)) for n in self.nodes))
        return len(self.nodes) * PER_NODE

    async def _push(self, node: str, window: int, run: str) -> None:
        first = int(node.rsplit("-", 1)[1]) * PER_NODE
        for n, blob in enumerate(self.blobs[(node, window)]):
            if self.per_rank:
                await self.coordinator.ingest_summary.remote(self.trainer, first + n, blob, run)
            else:
                report_to = {**self.report_to, "run": run}
                await self.routes.push(group_key(report_to, window), report_to, node, blob)


def _log_slow_turns(_self: Any) -> None:
    """Runs in the coordinator: time every callback of its event loop in thread CPU, and sample
    the loop thread's stack every 3 ms from another thread, to say what a slow turn ran."""
    import asyncio.base_events as base_events
    import asyncio.events as events
    import collections
    import gc
    import sys
    import threading

    run = events.Handle._run
    slow: list[tuple[float, float, str]] = []
    gc_ms = [0.0, 0.0]  # collections' total, the start of the one in progress
    turn: dict[str, Any] = {"tid": None}
    samples: collections.deque[tuple[float, str]] = collections.deque(maxlen=4096)

    def on_gc(phase: str, _info: Any) -> None:  # (in the thread's CPU, as the turns are)
        if phase == "start":
            gc_ms[1] = time.thread_time()
        else:
            gc_ms[0] += (time.thread_time() - gc_ms[1]) * 1e3

    def where(frame: Any) -> str:
        """The innermost three frames of the coordinator's own code."""
        mine = []
        while frame is not None and len(mine) < 3:
            code = frame.f_code
            if "/coordinator/" in code.co_filename or "/worker_ext/" in code.co_filename:
                mine.append(f"{code.co_qualname}:{frame.f_lineno}")
            frame = frame.f_back
        return " < ".join(mine) or "(Ray or asyncio)"

    def sample() -> None:
        while True:
            time.sleep(0.003)
            tid = turn["tid"]
            frame = sys._current_frames().get(tid) if tid is not None else None
            if frame is not None:
                samples.append((time.perf_counter(), where(frame)))

    once = base_events.BaseEventLoop._run_once
    rounds: list[tuple[float, str]] = []  # loop iterations over 30 ms: what ran in them
    in_round: list[tuple[float, str]] = []

    def label(handle: Any) -> str:
        task = getattr(handle._callback, "__self__", None)
        if isinstance(task, asyncio.Task):
            return str(task.get_coro().__qualname__)
        return str(getattr(handle._callback, "__qualname__", "?"))

    def timed_once(loop: Any) -> None:
        c0 = time.thread_time()
        in_round.clear()
        once(loop)
        ms = (time.thread_time() - c0) * 1e3
        if ms >= 30:
            ran = collections.Counter[str]()
            for cb_ms, name in in_round:
                ran[name] += cb_ms
            top = "; ".join(f"{n} {v:.0f}" for n, v in ran.most_common(4))
            rounds.append((round(ms, 1), f"{len(in_round)} callbacks: {top}"[:300]))

    def timed_run(handle: Any) -> None:
        c0, g0, t0 = time.thread_time(), gc_ms[0], time.perf_counter()
        turn["tid"] = threading.get_ident()
        try:
            run(handle)
        finally:
            turn["tid"] = None
        ms = (time.thread_time() - c0) * 1e3
        in_round.append((ms, label(handle)))
        if ms >= 20:
            seen = collections.Counter(w for t, w in list(samples) if t >= t0)
            what = "; ".join(f"{w} x{n}" for w, n in seen.most_common(2))
            slow.append((round(ms, 1), round(gc_ms[0] - g0, 1), what[:300]))

    gc.callbacks.append(on_gc)
    threading.Thread(target=sample, daemon=True, name="scale-sim-sampler").start()
    events.Handle._run = timed_run  # type: ignore[method-assign]
    base_events.BaseEventLoop._run_once = timed_once  # type: ignore[method-assign]
    events._scale_sim_slow = slow  # type: ignore[attr-defined]
    events._scale_sim_rounds = rounds  # type: ignore[attr-defined]


def _log_fanouts(_self: Any) -> None:
    """Runs in the coordinator: note each node fan-out's timeline (its command's routing, each
    relay's reply as it arrives, the replies folded), in ms from its start."""
    import time as _time

    nodes = _self._shell.nodes
    log = nodes._scale_sim_log = []
    nodes._scale_sim_now = {"method": "", "t0": _time.perf_counter(), "replies": []}
    send, apply_ = nodes._send, nodes._apply

    async def timed_send(cmd, group, timeout):  # type: ignore[no-untyped-def]
        out = await send(cmd, group, timeout)
        nodes._scale_sim_now["replies"].append(round(1e3 * (_time.perf_counter() - t0()), 1))
        return out

    async def timed_apply(run, reply, by_node, method):  # type: ignore[no-untyped-def]
        out = await apply_(run, reply, by_node, method)
        nodes._scale_sim_now["applied"] = round(1e3 * (_time.perf_counter() - t0()), 1)
        return out

    def t0() -> float:
        return nodes._scale_sim_now["t0"]

    fan_out = nodes.fan_out

    async def timed_fan_out(run, keys, method, args, timeout):  # type: ignore[no-untyped-def]
        nodes._scale_sim_now = {"method": method, "t0": _time.perf_counter(), "replies": []}
        c0 = _time.thread_time()
        out = await fan_out(run, keys, method, args, timeout)
        now = nodes._scale_sim_now
        now["end"] = round(1e3 * (_time.perf_counter() - now["t0"]), 1)
        now["cpu"] = round(1e3 * (_time.thread_time() - c0), 1)  # (the loop's, others' too)
        now["replies"] = (
            [
                now["replies"][0],
                sorted(now["replies"])[len(now["replies"]) // 2],
                now["replies"][-1],
            ]
            if now["replies"]
            else []
        )
        log.append({k: v for k, v in now.items() if k != "t0"})
        return out

    nodes._send, nodes._apply, nodes.fan_out = timed_send, timed_apply, timed_fan_out


def _fanouts(_self: Any) -> list[dict[str, Any]]:
    return [x for x in _self._shell.nodes._scale_sim_log if x["method"] == "start_profile"]


def _slow_turns(_self: Any) -> list[tuple[float, float, str]]:
    import asyncio.events as events

    return sorted(getattr(events, "_scale_sim_slow", []), reverse=True)[:12]


def _slow_rounds(_self: Any) -> list[tuple[float, str]]:
    import asyncio.events as events

    return sorted(getattr(events, "_scale_sim_rounds", []), reverse=True)[:8]


def _log_arrivers(_self: Any) -> None:
    """Note each last arriver's matching (``StragglerRefresh``'s ``find_arriver``, off the loop):
    its window, when it began (wall), its ranks' collectives and its thread's CPU."""
    import coordinator.service.straggler_refresh as refresh

    found, log = refresh.find_arriver, []

    def timed_find(agg: Any) -> Any:
        t0, c0 = time.time(), time.thread_time()
        try:
            return found(agg)
        finally:
            log.append((agg.window, t0, len(agg.collectives), time.thread_time() - c0))

    refresh.find_arriver, refresh._scale_sim_arrivers = timed_find, log  # type: ignore[attr-defined]


def _arriver_runs(_self: Any) -> tuple[int, list[tuple[int, float, int, float]]]:
    """Last arrivers' matchings the coordinator has started (``StragglerRefresh``), and those
    ``_log_arrivers`` noted."""
    import coordinator.service.straggler_refresh as refresh

    runs = _self._shell.straggler_refresh.arriver_runs
    return int(runs), list(getattr(refresh, "_scale_sim_arrivers", []))


def _census(_self: Any) -> list[tuple[str, int]]:
    import collections
    import gc

    kinds = collections.Counter(type(o).__name__ for o in gc.get_objects())
    runs = [("collections by generation", [g["collections"] for g in gc.get_stats()])]
    return [*runs, ("frozen", gc.get_freeze_count()), *kinds.most_common(12)]


def watch_table(coord: Any, window: int, n: int, since: float) -> dict[str, Any]:
    """Watch from a thread of its own for ``window``'s table to list all ``n`` ranks, and note
    when it first does (``["at"]``): the driver's loop, which steps, pings and waits for the
    opening report, would see it up to seconds late. Every 0.5 s it asks ``status()`` (about
    20 ms of the coordinator at 10,000 ranks) whether summaries are pending, and only then the
    table (O(ranks) to build: asked every 50 ms, it was a second of coordinator CPU a window)."""
    import threading

    out: dict[str, Any] = {}

    def watch() -> None:
        while time.perf_counter() - since < 900:
            windows = ray.get(coord.status.remote())["windows"]
            entry = next((w for w in windows if w["index"] == window), None)
            if entry is not None and not entry["summaries_pending"]:
                ks = ray.get(coord.kernel_summary.remote(window=window, top_k=20))
                out["ranks"] = len(ks["ranks"])
                if out["ranks"] == n:
                    out["at"] = time.perf_counter()
                    return
            time.sleep(0.5)

    out["watching"] = threading.Thread(target=watch, daemon=True, name="table-watch")
    out["watching"].start()
    return out


def spy(pid: int, out: str, seconds: int = 10, idle: bool = True) -> None:
    import subprocess

    spy_bin = SPY or os.path.join(os.path.dirname(sys.executable), "py-spy")
    cmd = [spy_bin, "record", "-p", str(pid), "-d", str(seconds), "-r", "100"]
    cmd += ["--gil"] if SPY_GIL else ["--idle"] if idle else []
    cmd += ["--threads", "-f", "raw", "-o", out, "--nonblocking"]
    subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def timed(ref_fn) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = ray.get(ref_fn())
    return out, time.perf_counter() - t0


def run_size(
    n: int, fanout: str, windows: int, hosts_choice: str, collectives: int = 0
) -> dict[str, Any]:
    name = f"scale-{fanout}-{n}"
    ns = "profiler-bench"
    tmp = tempfile.mkdtemp(prefix="scale-sim-")
    cfg = {
        "enable": True,
        "save_path": tmp,
        "ranks": "all",
        "skip_first": 2,
        "wait": 3,
        "warmup": 1,
        "active": 3,
        "repeat": windows,
        "fanout": fanout,
        "worker_timeout_s": 120.0,
        "max_windows": 8,
        "detail_windows": 2,
    }
    coord = get_or_create_coordinator(cfg, name=name, namespace=ns, trainer_id="sim")
    pid = ray.get(coord.status.remote())["process"]["pid"]
    if SLOW_LOG:
        ray.get(coord.__ray_call__.remote(_log_slow_turns))
    if FANOUT_LOG:
        ray.get(coord.__ray_call__.remote(_log_fanouts))
    nodes = sorted({node_of(r) for r in range(n)})
    direct = fanout == "direct"
    hosts = agent_hosts(len(nodes), hosts_choice)
    rank_actors = [SimRanks.remote(hosts) for _ in range(RANK_HOSTS)]
    roles = ["both"] if SHARED_AGENTS else ["commands", "summaries"]
    by_role = {
        role: [
            SimAgents.options(name=agent_name(i, role), namespace=AGENT_NAMESPACE).remote(
                i,
                hosts,
                [x for x in nodes if host_of(x, hosts) == i],
                name,
                ns,
                direct,
                windows,
                role,
                (n, collectives),
            )
            for i in range(hosts)
        ]
        for role in roles
    }
    agents, pushers = by_role[roles[0]], by_role[roles[-1]]
    ray.get([a.ready.remote() for a in agents + pushers])
    workers = [rank_actors[r % RANK_HOSTS] for r in range(n)]
    t0 = time.perf_counter()
    ray.get(coord.register.remote("sim", workers))
    register_s = time.perf_counter() - t0
    ray.get(coord.start.remote("sim", 0))
    res: dict[str, Any] = {
        "ranks": n,
        "nodes": len(nodes),
        "agent_hosts": hosts,
        "agent_roles": agent_roles(),
        "fanout": fanout,
        "collectives": collectives,
        "register_s": register_s,
        "open": [],
        "step": [],
        "close": [],
        "cpu_open": [],
        "cpu_step": [],
        "cpu_close": [],
        "cpu_summaries": [],
        "table_after_close": [],
        "step_while": [],
        "status_s": [],
        "status_kb": [],
        "mem_mb": [],
        "stall_ms": [],
        "stall_busy_ms": [],
        "open_while": [],
    }
    run = ray.get(coord.status.remote())["run"]["name"]
    k, phase = 0, "idle"
    if collectives:
        ray.get(coord.__ray_call__.remote(_log_arrivers))
    arrivers = ray.get(coord.__ray_call__.remote(_arriver_runs))[0]
    for _ in range(windows):
        mem0 = rss_mb(pid)
        if SPY_STEPS:  # the coordinator through the window's steps
            spy(pid, f"/tmp/spy-steps-{n}-{len(res['close'])}.txt", seconds=SPY_STEPS, idle=False)
        for _ in range(STEPS_TO_WINDOW):  # step up to and through the next window
            c0 = cpu(pid)
            rep, dt = timed(lambda k=k: coord.step.remote("sim", k))
            c1 = cpu(pid)
            k += 1
            before, phase = phase, rep["phase"]
            kind = {(False, True): "open", (True, True): "step", (True, False): "close"}.get(
                (before != "idle", phase != "idle")
            )
            if kind:
                res[kind].append(dt)
                res[f"cpu_{kind}"].append(c1 - c0)
            if kind == "close":
                break
        else:
            raise RuntimeError(f"no window closed within {STEPS_TO_WINDOW} steps of step {k}")
        closed_at, c0 = time.perf_counter(), cpu(pid)
        index = ray.get(coord.status.remote())["windows"][-1]["index"]
        ray.get([p.take_routes.remote() for p in pushers])
        pushes = [p.push_window.remote(index, run) for p in pushers]
        if TRACES_S is not None:  # the agents' per-rank trace reports, spread over TRACES_S
            pushes += [p.report_traces.remote(index, run, TRACES_S) for p in pushers]
        if SPY:  # the coordinator and the first agent actor, 10 s from the close
            spy(pid, f"/tmp/spy-{n}-{len(res['close'])}.txt")
            spy(ray.get(agents[0].pid.remote()), f"/tmp/spy-agent-{n}-{len(res['close'])}.txt")
            if pushers is not agents:
                spy(ray.get(pushers[0].pid.remote()), f"/tmp/spy-push-{n}-{len(res['close'])}.txt")
        stall_from = time.time()
        lat, stat_s, stat_kb, pings, agent_pings = [], [], [], [], []
        table = watch_table(coord, index, n, closed_at)
        while True:  # the trainer steps on while the summaries arrive
            if phase == "idle":  # up to the report that opens the next window; its in-window
                # steps are the outer loop's (stepping on could pass the whole window here)
                rep, dt = timed(lambda k=k: coord.step.remote("sim", k))
                k += 1
                if rep["phase"] != "idle":  # this report opened the next window: it waited
                    res["open_while"].append(dt)  # for the agents relaying summaries
                    phase = rep["phase"]
                else:
                    lat.append(dt)
            pings.append(timed(lambda: coord.ping.remote())[1])  # takes no lock: Ray alone
            t0 = time.perf_counter()  # the agents' control lane, as the next window's start
            ray.get([a.ping.remote() for a in agents])
            agent_pings.append(time.perf_counter() - t0)
            st, ds = timed(lambda: coord.status.remote())
            stat_s.append(ds)
            stat_kb.append(len(json.dumps(st)) / 1024)
            if "at" in table or not table["watching"].is_alive():
                break
            time.sleep(0.05)
        if "at" not in table:
            raise RuntimeError(f"only {table.get('ranks')} of {n} ranks after 900 s")
        res["table_after_close"].append(table["at"] - closed_at)
        ray.get(pushes)
        res.setdefault("traces_done", []).append(time.perf_counter() - closed_at)
        res["cpu_summaries"].append(cpu(pid) - c0)
        res["step_while"].append(max(lat or [0.0]))
        res["status_s"].append(statistics.median(stat_s))
        res["status_kb"].append(max(stat_kb))
        res["mem_mb"].append(rss_mb(pid) - mem0)
        loop = ray.get(coord.status.remote())["process"]["loop"]
        stalls = [(ms, busy) for t, ms, busy in loop["recent_stalls"] if t >= stall_from]
        res["stall_ms"].append(max([ms for ms, _ in stalls] or [0.0]))
        res["stall_busy_ms"].append(max([busy for _, busy in stalls] or [0.0]))
        res.setdefault("stalls", []).append(sorted(stalls)[-8:])
        res.setdefault("latencies", []).append(sorted(lat)[-5:])
        res.setdefault("pings", []).append(sorted(pings)[-5:])
        res.setdefault("ping_max", []).append(max(pings))
        res.setdefault("agent_ping_max", []).append(max(agent_pings))
        res["gc_max_ms"] = loop["gc_max_ms"]
        if collectives:  # the last arrivers' matchings started so far (each after 1 s quiet)
            res.setdefault("arriver_runs", []).append(
                ray.get(coord.__ray_call__.remote(_arriver_runs))[0] - arrivers
            )
            res.setdefault("closed_wall", {})[index] = time.time() - (
                time.perf_counter() - closed_at
            )
    st, ds = timed(lambda: coord.status.remote())
    res["status_final_s"], res["status_final_kb"] = ds, len(json.dumps(st)) / 1024
    res["nodes_by_path"] = st["nodes"]["by_path"]
    res["direct_nodes"] = [n for n in st["nodes"]["listed"] if n.get("path") == "direct"][:2]
    res["top20_s"] = timed(lambda: coord.kernel_summary.remote(top_k=20))[1]
    if collectives:  # the last window's arriver matching: wait for it, with its CPU
        c0 = cpu(pid)
        time.sleep(ARRIVER_WAIT_S)
        res["cpu_arriver_wait"] = cpu(pid) - c0
        runs, res["arrivers"] = ray.get(coord.__ray_call__.remote(_arriver_runs))
        res["arriver_runs"].append(runs - arrivers)
    if collectives:  # one collectives() read of the last window: its matching, on the reads thread
        c0 = cpu(pid)
        got, res["collectives_s"] = timed(lambda: coord.collectives.remote())
        res["cpu_collectives"] = cpu(pid) - c0
        res["collectives_matched"], res["collectives_mb"] = (
            got["matched"],
            len(json.dumps(got)) / 2**20,
        )
    if SLOW_LOG:
        res["slow_turns"] = ray.get(coord.__ray_call__.remote(_slow_turns))
        res["slow_rounds"] = ray.get(coord.__ray_call__.remote(_slow_rounds))
    if FANOUT_LOG:
        res["fanouts"] = ray.get(coord.__ray_call__.remote(_fanouts))
    if GC_CENSUS:  # what the coordinator's garbage collector walks, by type
        res["gc_census"] = ray.get(coord.__ray_call__.remote(_census))
    ray.get(coord.stop.remote("sim"))
    for a in [coord, *agents, *rank_actors, *([] if pushers is agents else pushers)]:
        ray.kill(a)
    return res


def arriver_rows(r: dict[str, Any]) -> list[tuple[int, float | None, int, float]]:
    """``_log_arrivers``' notes, each one's start as seconds after its window's close."""
    closed = r.get("closed_wall", {})
    return [
        (w, round(t - closed[w], 2) if w in closed else None, n, round(c, 2))
        for w, t, n, c in r["arrivers"]
    ]


def show(res: dict[str, Any]) -> None:
    def ms(xs: list[float]) -> str:
        if not xs:
            return "-"
        return f"{1e3 * statistics.median(xs):.0f} ms (max {1e3 * max(xs):.0f})"

    def mean_ms(xs: list[float]) -> str:  # (CPU times tick in 10 ms: the mean over steps)
        return f"{1e3 * statistics.fmean(xs):.0f} ms over {len(xs)}" if xs else "-"

    def s(xs: list[float]) -> str:
        return f"{statistics.median(xs):.2f} s (max {max(xs):.2f})" if xs else "-"

    r = res
    lines = [
        f"\n== {r['ranks']} ranks on {r['nodes']} nodes, fanout {r['fanout']}, "
        f"{r['agent_hosts']} actors play the agents{r['agent_roles']}, "
        f"{r['collectives']} collectives a rank "
        f"(register {r['register_s']:.1f} s) ==",
        f"step report in windows: open {ms(r['open'])}, step {ms(r['step'])}, "
        f"close {ms(r['close'])}",
        f"coordinator CPU per in-window step (mean): open {mean_ms(r['cpu_open'])}, "
        f"step {mean_ms(r['cpu_step'])}, close {mean_ms(r['cpu_close'])}",
        "coordinator CPU from a close until its traces are reported (summaries"
        f"{', trace reports' if TRACES_S else ''}, and the harness's polls, idle step reports "
        "and the next window's opening meanwhile: an upper bound on the summaries' own): "
        f"{s(r['cpu_summaries'])} (all in {s(r['traces_done'])} after the close)",
        f"table lists every rank, after the close: {s(r['table_after_close'])}",
        f"a step report while summaries arrive (slowest per window): {ms(r['step_while'])}; "
        f"a ping (no lock): {ms(r['ping_max'])}; the report that opened the next window "
        f"meanwhile (it waits for the agents): {ms(r['open_while'])}; a ping of every agent "
        f"actor's control lane meanwhile: {ms(r['agent_ping_max'])}",
        f"status() while summaries arrive: {ms(r['status_s'])}, up to "
        f"{max(r['status_kb']):.0f} KB; after: {1e3 * r['status_final_s']:.0f} ms, "
        f"{r['status_final_kb']:.0f} KB",
        f"coordinator memory per window: {statistics.median(r['mem_mb']):.0f} MB "
        f"(max {max(r['mem_mb']):.0f})",
        f"longest event loop stall while summaries arrive: {max(r['stall_ms']):.0f} ms, "
        f"{max(r['stall_busy_ms']):.0f} ms of it the loop's own CPU; garbage collection "
        f"pauses up to {r['gc_max_ms']} ms by generation",
        f"top-20 query: {1e3 * r['top20_s']:.0f} ms; nodes by path: {r['nodes_by_path']}",
    ]
    if "arriver_runs" in r:
        lines.append(
            "last arrivers' matchings started (StragglerRefresh.arriver_runs, all windows "
            "so far) when each window's table listed every rank, and "
            f"{ARRIVER_WAIT_S:.0f} s after the last: {r['arriver_runs']} (the coordinator's CPU "
            f"in those {ARRIVER_WAIT_S:.0f} s: {r['cpu_arriver_wait']:.2f} s)"
        )
        lines.append(
            "each matching: (window, s after its close, ranks with collectives, s of its "
            f"thread's CPU): {arriver_rows(r)}"
        )
    if "collectives_s" in r:
        lines.append(
            f"collectives() of the last window: {r['collectives_s']:.2f} s, coordinator CPU "
            f"{r['cpu_collectives']:.2f} s, {r['collectives_matched']:,} matched, reply "
            f"{r['collectives_mb']:.1f} MB of JSON"
        )
    if r["direct_nodes"]:
        lines.append(f"nodes told directly, e.g.: {r['direct_nodes']}")
    if "fanouts" in r:
        lines.append(f"opening fan-outs (ms from their start): {r['fanouts']}")
    if "slow_turns" in r:
        lines.append(
            "the loop's slowest turns (ms of its CPU, ms of it collecting garbage, where it was "
            "when sampled every 3 ms): "
            f"{r['slow_turns']}"
        )
        lines.append(
            "the loop's slowest iterations (ms of its CPU; the callbacks that ran in one, the "
            f"CPU of the largest by coroutine or function): {r['slow_rounds']}"
        )
    if "gc_census" in r:
        lines.append(f"objects the collector walks, by type: {r['gc_census']}")
    print("\n".join(lines), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024, 10000])
    ap.add_argument("--fanout", nargs="+", default=["node"], choices=["node", "direct"])
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument(
        "--collectives",
        type=int,
        nargs="+",
        default=[0],
        help="collectives each rank's summary carries (issue 56), one run each: e.g. 0 200",
    )
    ap.add_argument(
        "--agent-hosts",
        default=str(AGENT_HOSTS),
        help="actors that play the node agents: a count, or 'groups' (one per relay group)",
    )
    args = ap.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    out = []
    for n in args.ranks:
        for fanout in args.fanout:
            for per_rank in args.collectives:
                res = run_size(n, fanout, args.windows, args.agent_hosts, per_rank)
                show(res)
                out.append(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
