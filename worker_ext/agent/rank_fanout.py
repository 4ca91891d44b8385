"""A node agent's part of the per-node fan-out: call its node's ranks, forward other nodes' parts
to their agents, and fold every reply into one answer (``protocol.agent_rpc``).

It keeps, per coordinator (``owner``: ``namespace/name#restarts``), the handles of the ranks it
calls and the last reply it forwarded for each: a rank whose reply has not changed since is only
listed as ``answered``. The first command of a restarted coordinator drops what its earlier
incarnations left (the agent outlives them); a registration's new handles replace a rank's old.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, cast

from coordinator.protocol.agent_rpc import (
    ADOPT,
    NODE_COMMANDS,
    NodeAnswer,
    NodeCommand,
    NodeCommandReply,
    NodeOrder,
    RankFailure,
)
from coordinator.protocol.reasons import reason
from coordinator.protocol.replies import RankReply
from coordinator.raylink.agents import AgentHandles
from coordinator.raylink.failures import call_failure, no_answer

FORWARD_MARGIN_S = 5.0
"""How much longer than the ranks' timeout a relay waits for another node's agent."""
_ONCE = ("closed", "summaries", "summary_failures")  # news a reply carries once
_VOLATILE = ("phase", "window")  # the coordinator does not keep these

Key = tuple[str, int]
RankReplies = tuple[dict[Key, RankReply], list[RankFailure]]


class RankFanOut:
    """Runs ``NodeCommand``s for the nodes ``hosts`` accepts (its own node, by default)."""

    def __init__(
        self,
        name: str,
        node: str,
        hosts: Callable[[str], bool] | None = None,
        on_start: Callable[[NodeCommand, str, list[Key]], None] | None = None,
    ) -> None:
        self.name, self.node = name, node
        self.hosts = hosts or (lambda n: n == node)
        self.on_start = on_start  # (command, node, ranks of the node that started a window)
        self.handles: dict[tuple[str, str, int], Any] = {}
        self._last: dict[tuple[str, str, int], dict[str, Any]] = {}
        self._owners: set[str] = set()
        self._agents = AgentHandles()
        self.commands = 0

    async def command(self, cmd: NodeCommand) -> NodeCommandReply:
        """Run ``cmd``: this agent's nodes here, the others through their agents, at once."""
        problem = command_problem(cmd)
        if problem:
            raise ValueError(problem)
        self._forget_older(cmd["owner"])
        self.commands += 1
        local = [n for n in cmd["nodes"] if self.hosts(n)]
        by_agent: dict[str, dict[str, NodeOrder]] = {}
        for node, order in cmd["nodes"].items():
            if node not in local:
                by_agent.setdefault(order["agent"], {})[node] = order
        parts = await asyncio.gather(
            *(self.call_node(cmd, n, cmd["nodes"][n]) for n in local),
            *(self._forward(cmd, agent, nodes) for agent, nodes in by_agent.items()),
        )
        answers: list[NodeAnswer] = []
        for part in parts:
            answers.extend(cast(list[NodeAnswer], part if isinstance(part, list) else [part]))
        return {"relay": self.name, "nodes": answers}

    async def call_node(self, cmd: NodeCommand, node: str, order: NodeOrder) -> NodeAnswer:
        """Call the ranks of ``node`` (one of this agent's), fold their replies."""
        owner = cmd["owner"]
        if order["handles"] is not None:
            for (tid, rank), handle in zip(order["ranks"], order["handles"], strict=True):
                self.handles[(owner, tid, rank)] = handle
                self._last.pop((owner, tid, rank), None)  # (a new handle: a new rank process)
        keys = [(str(t), int(r)) for t, r in order["ranks"]]
        unknown = [k for k in keys if (owner, *k) not in self.handles]
        known = [k for k in keys if (owner, *k) in self.handles]
        if cmd["method"] == ADOPT:  # the handles are kept: no rank is called
            return _adopted(node, self.name, known, unknown)
        replies, failed = await self.call_ranks(cmd, known)
        if cmd["method"] == "start_profile" and self.on_start is not None and replies:
            self.on_start(cmd, node, list(replies))
        answer: NodeAnswer = {
            "node": node,
            "agent": self.name,
            "answered": [],
            "replies": [],
            "failed": failed,
            "unknown": unknown,
            "error": None,
        }
        for key, reply in replies.items():
            if self._routine(owner, key, reply):
                answer["answered"].append(key)
            else:
                answer["replies"].append((key[0], key[1], reply))
        return answer

    async def call_ranks(self, cmd: NodeCommand, keys: Sequence[Key]) -> RankReplies:
        """Call ``cmd``'s method on each rank in ``keys``; wait up to its timeout."""
        method, args, timeout = cmd["method"], cmd["args"], cmd["timeout_s"]
        tasks: dict[Key, asyncio.Future[Any]] = {}
        failed: list[RankFailure] = []
        for key in keys:
            try:
                ref = getattr(self.handles[(cmd["owner"], *key)], method).remote(*args)
            except Exception as exc:
                failed.append(_failure(key, "disabled", reason("agent", exc)))
                continue
            tasks[key] = asyncio.ensure_future(_await(ref))
        replies: dict[Key, RankReply] = {}
        if tasks:
            _, late = await asyncio.wait(tasks.values(), timeout=timeout)
            for key, task in tasks.items():
                if task in late:
                    task.cancel()
                    failed.append(_failure(key, "unresponsive", no_answer(method, timeout)))
                elif (err := task.exception()) is not None:
                    failed.append(_failure(key, *call_failure(method, err)))
                else:
                    replies[key] = task.result()
        return replies, failed

    def _forget_older(self, owner: str) -> None:
        """``owner`` commands for the first time: drop what the earlier incarnations of the
        same coordinator (its ``#restarts`` before) left; they will never command again."""
        if owner in self._owners:
            return
        same = owner.rpartition("#")[0]
        stale = {o for o in self._owners if o.rpartition("#")[0] == same}
        self._owners = (self._owners - stale) | {owner}
        if stale:
            for kept in (self.handles, self._last):
                for key in [k for k in kept if k[0] in stale]:
                    del kept[key]

    def _routine(self, owner: str, key: Key, reply: Any) -> bool:
        """Whether ``reply`` tells the coordinator nothing new about ``key`` (then only listed)."""
        if not isinstance(reply, dict):
            return False  # the coordinator judges a malformed reply
        kept = {k: v for k, v in reply.items() if k not in _VOLATILE}
        news = any(kept.get(k) for k in _ONCE)
        for k in _ONCE:
            kept.pop(k, None)
        routine = not news and self._last.get((owner, *key)) == kept
        self._last[(owner, *key)] = kept
        return routine

    async def _forward(
        self, cmd: NodeCommand, agent: str, nodes: dict[str, NodeOrder]
    ) -> list[NodeAnswer]:
        """Send ``nodes``' part of ``cmd`` to their agent ``agent``; each node's answer, or
        the error for each when that agent cannot be reached."""
        try:
            handle = await self.agent(agent)
            sub: NodeCommand = {**cmd, "nodes": nodes}
            reply = await asyncio.wait_for(
                handle.command.remote(sub), cmd["timeout_s"] + FORWARD_MARGIN_S
            )
            return list(reply["nodes"])
        except Exception as exc:
            self._agents.forget(agent)
            why = reason("relay", exc if str(exc) else TimeoutError(f"agent {agent} is silent"))
            return [_unreached(node, agent, why) for node in nodes]

    async def agent(self, name: str) -> Any:
        """Another agent's handle, by name (looked up once, off the event loop)."""
        return await self._agents.get(name)


def command_problem(cmd: Any) -> str | None:
    """What is wrong with a ``NodeCommand`` (from the coordinator), or None."""
    if not isinstance(cmd, dict) or not isinstance(cmd.get("nodes"), dict):
        return "a node command is a dict with a 'nodes' dict"
    if cmd.get("method") not in (*NODE_COMMANDS, ADOPT):
        method, known = cmd.get("method"), (*NODE_COMMANDS, ADOPT)
        return f"a node command's method must be one of {known}, not {method!r:.80}"
    if not isinstance(cmd.get("args"), list) or not isinstance(cmd.get("owner"), str):
        return "a node command names its owner (a str) and its args (a list)"
    timeout = cmd.get("timeout_s")
    if not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
        return f"a node command's timeout_s must be in (0, 3600], not {timeout!r:.80}"
    for node, order in cmd["nodes"].items():
        if not isinstance(order, dict) or not isinstance(order.get("ranks"), list):
            return f"node {node!r:.80}: its order must be a dict with a 'ranks' list"
        handles = order.get("handles")
        if handles is not None and len(handles) != len(order["ranks"]):
            return f"node {node!r:.80}: handles must match its ranks one for one"
    return None


def _failure(key: Key, state: Any, why: Any) -> RankFailure:
    return {"trainer_id": key[0], "rank": key[1], "state": state, "reason": why}


def _adopted(node: str, agent: str, known: list[Key], unknown: list[Key]) -> NodeAnswer:
    return {
        "node": node,
        "agent": agent,
        "answered": known,
        "replies": [],
        "failed": [],
        "unknown": unknown,
        "error": None,
    }


def _unreached(node: str, agent: str, why: Any) -> NodeAnswer:
    return {
        "node": node,
        "agent": agent,
        "answered": [],
        "replies": [],
        "failed": [],
        "unknown": [],
        "error": why,
    }


async def _await(ref: Any) -> Any:
    return await ref
