"""Summaries travel as partials: each node agent folds its ranks' summaries of a window into one
node partial, and the relay of each group of nodes merges its group's node partials into one
before it pushes to the coordinator. At 10,000 ranks on 1,250 nodes, the coordinator gets about
35 partials a window, not 10,000 summaries (or 1,250 partials, whose calls alone would queue a
step report for seconds behind them in Ray).

Both folds are a ``Gather``: items of one window of one trainer of one coordinator's run are
collected until every member expected has one (the ranks of a node that started the window, the
nodes of a group), or ``LINGER_S`` after the first arrived; then folded and pushed once. What
cannot be folded, merged or pushed is not lost: each summary then rides on its rank's next
reply, as a summary the agent could not push does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from coordinator.core.partial import fold_summaries, merge_partials
from coordinator.protocol.agent_rpc import NodeCommand
from coordinator.protocol.partial_codec import NodePartial, decode_partial, encode_partial
from coordinator.protocol.replies import Reason
from coordinator.protocol.summary_codec import RankSummary

log = logging.getLogger(__name__)

LINGER_S = 1.0  # a node's summaries wait this long for its late ranks
GROUP_LINGER_S = 2.0  # a relay waits this long for its group's late nodes
RELAY_TIMEOUT_S = 30.0
GroupKey = tuple[str, str, str, str, int]  # namespace, name, trainer_id, run, window
T = TypeVar("T")
Push = Callable[["GroupKey", dict[str, str], bytes], Awaitable[bool]]
"""Pushes a folded blob of group ``key`` (whose last element is the window)."""


def group_key(report_to: dict[str, str], window: int) -> GroupKey:
    return (
        report_to["namespace"],
        report_to["name"],
        report_to["trainer_id"],
        report_to.get("run") or "",
        window,
    )


def command_key(cmd: NodeCommand, trainer_id: str, window: int) -> GroupKey:
    namespace, _, name = cmd["owner"].partition("#")[0].partition("/")
    return (namespace, name, trainer_id, cmd.get("run", ""), window)


@dataclass
class _Pending(Generic[T]):
    key: GroupKey
    report_to: dict[str, str]
    items: dict[Hashable, T] = field(default_factory=dict)
    waiting: list[asyncio.Future[bool]] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None


class Gather(Generic[T]):
    """Collects items by group key, folds each group into one blob and pushes it once."""

    def __init__(self, fold: Callable[[list[T]], bytes], push: Push, linger_s: float) -> None:
        self.fold, self.push, self.linger_s = fold, push, linger_s
        self.expected: dict[GroupKey, set[Hashable]] = {}
        self._pending: dict[GroupKey, _Pending[T]] = {}

    def expect(self, key: GroupKey, members: set[Hashable]) -> None:
        """The members whose items ``key`` waits for (once they are all in, it goes). Called
        from the agent's control lane, another thread: the set is replaced, never changed."""
        self.expected[key] = self.expected.get(key, set()) | members
        while len(self.expected) > 256:  # windows whose items never came: forget the oldest
            del self.expected[next(iter(self.expected))]

    async def add(
        self, key: GroupKey, report_to: dict[str, str], member: Hashable, item: T
    ) -> bool:
        """Queue ``item``; True once the blob it was folded into is in the coordinator."""
        loop = asyncio.get_running_loop()
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _Pending(key, report_to)
            pending.timer = loop.call_later(self.linger_s, self._go, key)
        pending.items[member] = item
        done: asyncio.Future[bool] = loop.create_future()
        pending.waiting.append(done)
        if key in self.expected and self.expected[key] <= set(pending.items):
            self._go(key)
        return await done

    def _go(self, key: GroupKey) -> None:
        pending = self._pending.pop(key, None)
        if pending is None:
            return
        if pending.timer is not None:
            pending.timer.cancel()
        if set(pending.items) >= self.expected.get(key, set()):
            self.expected.pop(key, None)
        asyncio.ensure_future(self._fold_and_push(pending))

    async def _fold_and_push(self, pending: _Pending[T]) -> None:
        items = list(pending.items.values())
        try:  # a fold of 2,000 kernels x many ranks takes tens of ms: off the event loop
            loop = asyncio.get_running_loop()
            blob = await loop.run_in_executor(None, self.fold, items)
            ok = await self.push(pending.key, pending.report_to, blob)
        except Exception as exc:
            for done in pending.waiting:
                if not done.done():
                    done.set_exception(exc)
            return
        for done in pending.waiting:
            if not done.done():
                done.set_result(ok)


def node_blob(node: str) -> Callable[[list[RankSummary]], bytes]:
    return lambda summaries: encode_partial(fold_summaries(node, summaries))


def group_blob(relay: str) -> Callable[[list[NodePartial]], bytes]:
    return lambda partials: encode_partial(merge_partials(relay, partials))


class PartialRoutes:
    """Where one agent's node partials go, and the relay's side: the group's partials merged.

    ``call_agent(name, method, *args)`` reaches another agent; ``to_coordinator(report_to,
    blob)`` pushes a partial to the coordinator.
    """

    def __init__(
        self,
        name: str,
        call_agent: Callable[..., Awaitable[Any]],
        to_coordinator: Push,
        linger_s: float = GROUP_LINGER_S,
    ) -> None:
        self.name = name
        self.call_agent = call_agent
        self.relays: dict[tuple[GroupKey, str], str] = {}  # (key, node) -> its relay's name
        self.group: Gather[NodePartial] = Gather(group_blob(name), to_coordinator, linger_s)
        self.to_coordinator = to_coordinator
        self.relay_failures: dict[GroupKey, Reason] = {}
        """Why a relay did not take this agent's partial of a group, by group (bounded)."""

    def learn(self, cmd: NodeCommand, node: str, keys: Sequence[tuple[str, int]]) -> None:
        """A ``start_profile`` this agent ran on ``node``'s ``keys``: their partials go to
        the command's relay; and when this agent is that relay, it waits for its group."""
        window = cmd["args"][0].get("index") if cmd["args"] else None
        relay = cmd.get("relay")
        if not isinstance(window, int) or not isinstance(relay, str):
            return
        for tid in {t for t, _ in keys}:
            self.relays[(command_key(cmd, tid, window), node)] = relay
        while len(self.relays) > 65_536:
            del self.relays[next(iter(self.relays))]

    def lead(self, cmd: NodeCommand) -> None:
        """This agent relays ``cmd`` (a ``start_profile``): wait for its nodes' partials."""
        window = cmd["args"][0].get("index") if cmd["args"] else None
        if cmd.get("relay") != self.name or not isinstance(window, int):
            return
        nodes: dict[str, set[Hashable]] = {}
        for node, order in cmd["nodes"].items():
            for tid, _ in order["ranks"]:
                nodes.setdefault(tid, set()).add(node)
        for tid, members in nodes.items():
            self.group.expect(command_key(cmd, tid, window), members)

    def to_relay(self, node: str) -> Push:
        """How ``node``'s partials are pushed: to its relay, else straight to the coordinator."""

        async def push(key: GroupKey, report_to: dict[str, str], blob: bytes) -> bool:
            return await self.push(key, report_to, node, blob)

        return push

    async def push(self, key: GroupKey, report_to: dict[str, str], node: str, blob: bytes) -> bool:
        """A node's partial: to its relay, else straight to the coordinator."""
        window = key[4]
        relay = self.relays.pop((key, node), None)
        if relay == self.name:
            return await self.collect(report_to, window, node, blob)
        if relay is not None:
            try:
                got = self.call_agent(relay, "collect_partial", report_to, window, node, blob)
                return bool(await asyncio.wait_for(got, RELAY_TIMEOUT_S))
            except Exception as exc:  # the relay is gone: push it ourselves, and say so
                self._relay_failed(key, relay, node, exc)
        return await self.to_coordinator(key, report_to, blob)

    def _relay_failed(self, key: GroupKey, relay: str, node: str, exc: BaseException) -> None:
        message = (
            f"the relay {relay} did not take node {node}'s partial of window {key[4]} "
            f"({type(exc).__name__}: {exc}); the node pushed it to the coordinator itself"
        )[:1000]
        log.warning("%s", message)
        self.relay_failures[key] = Reason(where="relay", type=type(exc).__name__, message=message)
        while len(self.relay_failures) > 256:
            del self.relay_failures[next(iter(self.relay_failures))]

    async def collect(self, report_to: dict[str, str], window: int, node: str, blob: bytes) -> bool:
        """The relay's side: one node's partial of its group."""
        partial = decode_partial(blob)
        return await self.group.add(group_key(report_to, window), report_to, node, partial)
