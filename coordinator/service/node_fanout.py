"""Window commands through the node agents: the coordinator's per-step work grows with nodes.

The ranks of a command are grouped by node (each rank's reply names its node and its node's
agent); the nodes into groups of about sqrt(nodes) (``group_size``); each group's command goes to
one agent of the group, the relay, which calls its own ranks and forwards each other node's part
to that node's agent (``worker_ext.agent.rank_fanout``). So the coordinator makes about
sqrt(nodes) calls per command, and a quiet rank costs it one list entry.

Faults stay per rank: a rank that fails, dies or times out comes back as that rank's failure. A
node whose agent cannot be reached (or a group whose relay cannot) is told directly, as are
ranks whose node or agent is not known yet, and its path is ``direct`` for ``RETRY_S`` before
its agent is tried again. ``status()["nodes"]`` shows each node's path.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from coordinator.core.run import Run
from coordinator.protocol.agent_rpc import (
    ADOPT,
    NodeAnswer,
    NodeCommand,
    NodeCommandReply,
    NodeOrder,
)
from coordinator.protocol.reasons import reason
from coordinator.protocol.replies import NodeEntry, NodePath, Reason
from coordinator.raylink.agents import AgentHandles

Key = tuple[str, int]
RETRY_S = 60.0
RELAY_MARGIN_S = 10.0  # beyond the ranks' timeout: a relay waits up to 5 s more for a node
YIELD_EVERY = 256  # rank replies folded between two yields of the event loop
ROUTE_YIELD_EVERY = 2048  # ranks routed between two yields (about 2 us each)


@dataclass
class NodeRoute:
    """What the coordinator knows of one node's path."""

    node: str
    agent: str
    path: NodePath = "agent"
    reason: Reason | None = None
    retry_at: float = 0.0
    commands: int = 0
    ranks: int = 0
    sent: set[Key] = field(default_factory=set)  # ranks whose handles its agent holds

    def failed(self, why: Reason) -> None:
        self.path, self.reason, self.retry_at = "direct", why, time.monotonic() + RETRY_S
        self.sent.clear()

    def to_dict(self) -> NodeEntry:
        return {
            "node": self.node,
            "agent": self.agent,
            "path": self.path,
            "ranks": self.ranks,
            "commands": self.commands,
            "reason": self.reason,
        }


def _groups(by_node: dict[str, list[Key]]) -> list[list[str]]:
    """The nodes in relay groups of ``group_size``, in name order."""
    nodes = sorted(by_node)
    size = group_size(len(nodes))
    return [nodes[i : i + size] for i in range(0, len(nodes), size)]


def group_size(nodes: int) -> int:
    """Nodes per relay: about sqrt(nodes), at least 8 and at most 64."""
    return max(8, min(64, math.ceil(math.sqrt(max(1, nodes)))))


class NodeFanOut:
    """The coordinator's routes to node agents (kept across runs, rebuilt after a restart)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.routes: dict[str, NodeRoute] = {}
        self._agents = AgentHandles()

    def forget(self, keys: Sequence[Key]) -> None:
        """These ranks registered again (new handles): their agents must get the new ones."""
        for route in self.routes.values():
            route.sent.difference_update(keys)

    async def fan_out(
        self, run: Run, keys: Sequence[Key], method: str, args: Sequence[Any], timeout: float
    ) -> list[Key]:
        """Send ``method(*args)`` to ``keys`` through their nodes' agents and fold the answers
        into the run; returns the keys that must be told directly."""
        by_node, direct = await self._route(run, keys)
        relays = []
        for group in _groups(by_node):
            cmd = self._command(run, by_node, group, method, args, timeout)
            relays.append(self._relay(run, cmd, {node: by_node[node] for node in group}))
            run.state.counters["node_commands"] += 1
        for told_directly in await asyncio.gather(*relays):
            direct.extend(told_directly)
        if direct and by_node:
            run.state.counters["node_fallback_ranks"] += len(direct)
        return direct

    async def _relay(
        self,
        run: Run,
        cmd: NodeCommand,
        by_node: dict[str, list[Key]],
    ) -> list[Key]:
        """Send ``cmd`` to its group's relay and fold the answer in as soon as it is back (the
        other groups' answers still on their way); the keys to tell directly."""
        group = list(by_node)
        reply, why = await self._send(cmd, group, cmd["timeout_s"])
        if reply is not None:
            return await self._apply(run, reply, by_node, cmd["method"])
        direct: list[Key] = []
        for node in group:  # the relay failed: its nodes are told directly
            self.routes[node].failed(why or reason("relay", RuntimeError("no reply")))
            direct.extend(by_node[node])
        return direct

    async def adopt(self, run: Run, keys: Sequence[Key], timeout: float) -> None:
        """Hand each node's agent the handles of its ranks now (a trainer registered), so
        that the first window's commands cost what later ones do. Best effort: a node whose
        agent did not take them gets them with its first command, as before."""
        by_node, _ = await self._route(run, keys)
        groups = _groups(by_node)
        sends = [
            self._send(self._command(run, by_node, g, ADOPT, [], timeout), g, timeout)
            for g in groups
        ]
        replies = await asyncio.gather(*sends)
        taken: set[str] = set()
        for reply, _ in replies:
            for answer in reply["nodes"] if reply is not None else []:
                if (
                    isinstance(answer, dict)
                    and not answer.get("error")
                    and not answer.get("unknown")
                ):
                    taken.add(answer.get("node"))
        for node in set(by_node) - taken:
            self.routes[node].sent.difference_update(by_node[node])

    def _command(
        self,
        run: Run,
        by_node: dict[str, list[Key]],
        group: list[str],
        method: str,
        args: Sequence[Any],
        timeout: float,
    ) -> NodeCommand:
        return {
            "owner": self.owner,
            "run": run.name,
            "relay": "",  # (set by _send: the agent it goes to)
            "method": method,
            "args": list(args),
            "timeout_s": timeout,
            "nodes": {n: self._order(run, n, by_node[n]) for n in group},
            "idle_exit_s": run.config.agent_idle_exit_s,
        }

    async def _route(self, run: Run, keys: Sequence[Key]) -> tuple[dict[str, list[Key]], list[Key]]:
        by_node: dict[str, list[Key]] = {}
        direct: list[Key] = []
        now = time.monotonic()
        for n, key in enumerate(keys):
            if n % ROUTE_YIELD_EVERY == ROUTE_YIELD_EVERY - 1:
                await asyncio.sleep(0)
            rec = run.state.ranks[key]
            agent = rec.agent.get("name") if rec.agent is not None else None
            if rec.node_id is None or not isinstance(agent, str):
                direct.append(key)
                continue
            route = self.routes.get(rec.node_id)
            if route is None or route.agent != agent:
                route = self.routes[rec.node_id] = NodeRoute(rec.node_id, agent)
            if route.path == "direct" and now < route.retry_at:
                direct.append(key)
                continue
            by_node.setdefault(rec.node_id, []).append(key)
        for node, node_keys in by_node.items():
            self.routes[node].ranks = len(node_keys)
        return by_node, direct

    def _order(self, run: Run, node: str, keys: list[Key]) -> NodeOrder:
        route = self.routes[node]
        handles = None
        if not route.sent.issuperset(keys):
            handles = [run.state.trainers[t].handles[r] for t, r in keys]
            route.sent.update(keys)
        return {"agent": route.agent, "ranks": keys, "handles": handles}

    async def _send(
        self, cmd: NodeCommand, group: list[str], timeout: float
    ) -> tuple[NodeCommandReply | None, Reason | None]:
        """The relay's reply, or why no agent of the group could relay it."""
        why: Reason = {"where": "relay", "type": "NoAgent", "message": "no agent in the group"}
        for node in group:  # the first agent of the group that can be found relays
            route = self.routes[node]
            try:
                handle = await self._agents.get(route.agent)
            except Exception as exc:
                route.failed(why := reason("relay", exc))
                continue
            try:
                ref = handle.command.remote({**cmd, "relay": route.agent})
                reply = await asyncio.wait_for(ref, timeout + RELAY_MARGIN_S)
            except Exception as exc:
                self._agents.forget(route.agent)
                silent = TimeoutError("the relay is silent")
                return None, reason("relay", exc if str(exc) else silent)
            if not isinstance(reply, dict) or not isinstance(reply.get("nodes"), list):
                bad: Reason = {
                    "where": "relay",
                    "type": "MalformedReply",
                    "message": f"{reply!r:.200}",
                }
                return None, bad
            return cast(NodeCommandReply, reply), None
        return None, why

    async def _apply(
        self, run: Run, reply: NodeCommandReply, by_node: dict[str, list[Key]], method: str
    ) -> list[Key]:
        """Fold every node's answer into the run; the keys to tell directly."""
        direct: list[Key] = []
        seen: set[str] = set()
        handled = 0  # rank entries since the last yield (a node has a few: count across nodes)
        for answer in reply["nodes"]:
            node = cast(dict[str, Any], answer).get("node") if isinstance(answer, dict) else None
            if not isinstance(node, str) or node not in by_node or node in seen:
                run.state.counters["unexpected_node_answers"] += 1
                continue
            seen.add(node)
            direct.extend(self._apply_node(run, answer, by_node[node], method))
            handled += len(by_node[node])
            if handled >= YIELD_EVERY:
                handled = 0
                await asyncio.sleep(0)
        for node in set(by_node) - seen:  # the relay left a node out: tell it directly
            self.routes[node].failed(
                {"where": "relay", "type": "Missing", "message": "the relay did not answer it"}
            )
            direct.extend(by_node[node])
        return direct

    def _apply_node(self, run: Run, answer: NodeAnswer, keys: list[Key], method: str) -> list[Key]:
        route, st = self.routes[answer["node"]], run.state
        if answer.get("error") is not None:
            route.failed(answer["error"])  # type: ignore[arg-type]
            return keys
        route.path, route.reason = "agent", None
        route.commands += 1
        mine = set(keys)
        answered = sum(1 for t, r in answer.get("answered") or [] if (t, r) in mine)
        for tid, rank, reply in answer.get("replies") or []:
            if (tid, rank) in mine:
                answered += 1
                st.apply_reply((tid, rank), reply)
        st.counters["worker_rpcs"] += answered
        st.counters[f"worker_rpcs_{method}"] += answered
        for f in answer.get("failed") or []:
            key = (f.get("trainer_id"), f.get("rank"))
            if key in mine:
                st.rank_failed(key, f["state"], f["reason"])
        unknown = [(t, r) for t, r in answer.get("unknown") or [] if (t, r) in mine]
        route.sent.difference_update(unknown)
        return unknown
