"""``stacks()``: every rank's and every driver's stack, read at one moment by the node agents.

Whose: every registered rank of every trainer (every role, selected or not) and each trainer's
driver. Where: Ray's actor table gives each rank's pid and node without calling the rank (a
hung rank answers nothing). How: one ``StackRequest`` per node, to that node's agent, all with
the same wall-clock moment to read at; the agent reads with py-spy, or faulthandler. The reply
is grouped by ``coordinator.core.stack_report``. Nothing here touches the step path.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from coordinator.core.stack_report import Whom, stack_entry, stacks_reply
from coordinator.core.validate import is_number
from coordinator.protocol.names import agent_name
from coordinator.protocol.stack_replies import (
    METHODS,
    ProcessStack,
    StackRequest,
    StacksReply,
)
from coordinator.raylink.actor_table import actor_id, live_nodes, place_actors
from coordinator.raylink.agents import AgentHandles
from coordinator.service.shell import CoordinatorShell

STACK_TIMEOUT_S = 10.0  # one process's read, on its node
LEAD_S = 0.2  # every node reads at now + this
MAX_STACK_TIMEOUT_S = 120.0


def check_stack_args(native: Any, ranks: Any, method: Any, timeout_s: Any) -> None:
    """ValueError naming the first argument of ``stacks()`` that is wrong."""
    if not isinstance(native, bool):
        raise ValueError(f"native must be a bool, got {native!r:.80}")
    if ranks is not None and (
        not isinstance(ranks, list)
        or len(ranks) > 100_000
        or any(isinstance(r, bool) or not isinstance(r, int) for r in ranks)
    ):
        raise ValueError(f"ranks must be None or a list of ints, got {ranks!r:.80}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r:.80}")
    if not is_number(timeout_s) or not 0 < timeout_s <= MAX_STACK_TIMEOUT_S:
        raise ValueError(f"timeout_s must be a number in (0, {MAX_STACK_TIMEOUT_S:g}]")


def unknown_whom(
    trainers: dict[str, Any], ranks: list[int] | None, trainer_id: str | None
) -> str | None:
    """Why ``stacks(ranks, trainer_id)`` names nobody it could read, or None: an unknown
    trainer, or ranks that no trainer in scope has registered (an empty answer would look like
    a cluster with nothing to show)."""
    if trainer_id is not None and trainer_id not in trainers:
        return f"no trainer {trainer_id!r:.80} is registered; registered: {sorted(trainers)}"
    if ranks is None:
        return None
    scope = [t for t in trainers.values() if trainer_id is None or t.trainer_id == trainer_id]
    known = {r for t in scope for r in t.handles}
    have = sorted(known)
    listed = f"{have[:20]}{' ...' if len(have) > 20 else ''}"
    if not ranks:
        return f"ranks is an empty list: give None for every rank (registered ranks: {listed})"
    missing = sorted(set(ranks) - known)
    if missing:
        whose = f"trainer {trainer_id!r}" if trainer_id is not None else "any trainer"
        return f"ranks {missing[:20]} not registered by {whose} (registered ranks: {listed})"
    return None


class StackCalls:
    """Takes stacks through the node agents (see the module docstring)."""

    def __init__(self, shell: CoordinatorShell) -> None:
        self.shell = shell
        self.agents = AgentHandles()

    async def stacks(
        self,
        native: bool = False,
        ranks: list[int] | None = None,
        trainer_id: str | None = None,
        method: str = "auto",
        threads: bool = False,
        timeout_s: float = STACK_TIMEOUT_S,
        flight_recorder_dir: str | None = None,
    ) -> StacksReply:
        check_stack_args(native, ranks, method, timeout_s)
        if trainer_id is not None and not isinstance(trainer_id, str):
            raise ValueError(f"trainer_id must be a str or None, got {trainer_id!r:.80}")
        unknown = unknown_whom(self.shell.run.state.trainers, ranks, trainer_id)
        if unknown is not None:
            raise ValueError(unknown)
        t0, taken_at = time.perf_counter(), time.time()
        whom = await self._whom(ranks, trainer_id)
        got = await self._read(whom, native, method, timeout_s, flight_recorder_dir)
        keep = threads or ranks is not None
        loop = asyncio.get_running_loop()  # thousands of ranks: grouped off the event loop
        return await loop.run_in_executor(
            self.shell.reads, _reply, whom, got, keep, (taken_at, t0, native, method)
        )

    async def _whom(self, ranks: list[int] | None, trainer_id: str | None) -> list[Whom]:
        """Every process wanted, placed by Ray's actor table (off the event loop)."""
        st = self.shell.run.state
        whom: list[Whom] = []
        handles: dict[int, str | None] = {}
        for t in st.trainers.values():
            if trainer_id is not None and t.trainer_id != trainer_id:
                continue
            for r, h in sorted(t.handles.items()):
                if ranks is None or r in ranks:
                    w = Whom("rank", t.trainer_id, t.role, r)
                    whom.append(w)
                    handles[id(w)] = actor_id(h)
            if t.driver is not None and ranks is None:
                whom.append(_driver(t.trainer_id, t.role, t.driver))
        loop = asyncio.get_running_loop()
        ids = {a for a in handles.values() if a}
        places, nodes = await loop.run_in_executor(None, _places, ids)
        for w in whom:
            if w.who == "rank" and w.rank is not None:
                rec = st.ranks.get((w.trainer_id, w.rank))
                _place(w, places.get(handles.get(id(w)) or ""), rec)
            if w.error is None and w.node_id is not None and w.node_id not in nodes:
                w.error = f"node {w.node_id[:12]} unreachable"
        return whom

    async def _read(
        self, whom: list[Whom], native: bool, method: str, timeout_s: float, fr_dir: str | None
    ) -> dict[int, tuple[ProcessStack | None, str | None]]:
        by_node: dict[str, list[Whom]] = {}
        for w in whom:
            if w.error is None and w.node_id is not None and w.pid is not None:
                by_node.setdefault(w.node_id, []).append(w)
        at = time.time() + LEAD_S
        calls = [
            self._read_node(node, ws, native, method, timeout_s, at, fr_dir)
            for node, ws in by_node.items()
        ]
        out: dict[int, tuple[ProcessStack | None, str | None]] = {}
        for part in await asyncio.gather(*calls):
            out.update(part)
        return out

    async def _read_node(
        self,
        node: str,
        whom: list[Whom],
        native: bool,
        method: str,
        timeout_s: float,
        at: float,
        fr_dir: str | None,
    ) -> dict[int, tuple[ProcessStack | None, str | None]]:
        req: StackRequest = {
            "targets": [{"pid": int(w.pid or 0), "dump": w.dump} for w in whom],
            "native": native,
            "method": method,
            "at": at,
            "timeout_s": timeout_s,
            "flight_recorder_dir": fr_dir,
        }
        name = agent_name(node)
        try:
            agent = await self.agents.get(name)
        except ValueError:
            why = f"no node agent on node {node[:12]} (no profiled rank there has started one)"
            return {id(w): (None, why) for w in whom}
        try:
            wait = timeout_s * (2 if fr_dir else 1) + LEAD_S + 30.0
            got: list[ProcessStack] = await asyncio.wait_for(agent.read_stacks.remote(req), wait)
        except Exception as exc:
            self.agents.forget(name)
            why = f"node {node[:12]}'s agent did not answer: {type(exc).__name__}: {exc}"[:300]
            return {id(w): (None, why) for w in whom}
        by_pid = {g["pid"]: g for g in got if isinstance(g, dict)}
        return {id(w): (by_pid.get(int(w.pid or 0)), None) for w in whom}


def _reply(
    whom: list[Whom],
    got: dict[int, tuple[ProcessStack | None, str | None]],
    threads: bool,
    how: tuple[float, float, bool, str],
) -> StacksReply:
    taken_at, t0, native, method = how
    entries = [
        stack_entry(w, *got.get(id(w), (None, "no answer")), threads)
        for w in sorted(whom, key=lambda w: w.order)
    ]
    return stacks_reply(entries, taken_at, time.perf_counter() - t0, native, method)


def _driver(trainer_id: str, role: str, driver: dict[str, Any]) -> Whom:
    pid, node = driver.get("pid"), driver.get("node_id")
    return Whom(
        "driver",
        trainer_id,
        role,
        None,
        node_id=node if isinstance(node, str) else None,
        pid=pid if isinstance(pid, int) else None,
        dump=driver.get("dump") if isinstance(driver.get("dump"), dict) else None,
        error=None
        if isinstance(pid, int) and isinstance(node, str)
        else "the driver's pid is unknown",
    )


def _places(ids: set[str]) -> tuple[dict[str, Any], set[str]]:
    return place_actors(ids), live_nodes()


def _place(w: Whom, place: Any, rec: Any) -> None:
    """Fill a rank's pid and node from Ray's table, and its faulthandler dump when the rank
    that reported it is this very process."""
    if place is None:
        w.error = "Ray does not know this actor (not an actor handle, or long gone)"
        return
    w.pid, w.node_id = place.pid, place.node_id
    if not place.alive:
        w.error = place.death or "exited"
    elif rec is not None and rec.pid == place.pid:
        w.dump = rec.stack_dump
