"""``memory()``: every rank's memory over the run, sampled by the node agents, and the leaks
named; ``memory_snapshot()``: CUDA memory snapshots on demand.

A timer on the coordinator sends each node's agent a ``MemoryWatch`` (the pids of the run's
ranks on that node) every few seconds (``pull_every``) and folds what the agent sampled since
the last one into the run's ``MemoryBook`` (``coordinator.core.memory``), which marks the
leaks. Where a rank
runs: its own replies (``pid``, ``node_id``), else Ray's actor table. Nothing here touches the
step path; a node whose agent does not answer is said per rank (``unreachable``).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from coordinator.core.memory import MemoryBook
from coordinator.core.memory_view import culprit_lines, marks, rank_entry, status_entry
from coordinator.core.records import Key
from coordinator.core.storage import is_remote
from coordinator.protocol.memory_replies import (
    AgentMemoryReply,
    MemoryMark,
    MemoryReply,
    MemoryStatusEntry,
    SnapshotAsk,
    SnapshotEntry,
    SnapshotReply,
)
from coordinator.protocol.names import agent_name
from coordinator.raylink.actor_table import actor_id, place_actors
from coordinator.raylink.agents import AgentHandles
from coordinator.service.shell import CoordinatorShell

log = logging.getLogger(__name__)
AGENT_TIMEOUT_S = 10.0
SNAPSHOTS = 256
MiB = 1 << 20


@dataclass
class _Kept:
    """The last run's book, kept when the next run began: the recorder makes that run's last
    memory file from it (a run that ends and is followed before the recorder looks)."""

    run: Any  # (its ``Run``: its trainers and config)
    book: MemoryBook
    where: dict[Key, tuple[str | None, int | None, str | None]]
    snapshots: list[SnapshotEntry]
    bands: dict[int, tuple[float, float]]


def pull_every(sample_s: float) -> float:
    """Seconds between two watches: five samples, within 1..5 s."""
    return min(5.0, max(1.0, 5 * sample_s))


class MemoryWatcher:
    """See the module docstring."""

    def __init__(self, shell: CoordinatorShell) -> None:
        self.shell = shell
        self.agents = AgentHandles()
        self.book = MemoryBook()
        self.run_name = shell.run.name
        self.book_run: Any = shell.run  # (the run the book is of)
        self.kept: _Kept | None = None  # the run before it (``_follow``)
        self.where: dict[Key, tuple[str | None, int | None, str | None]] = {}  # node, pid, why
        self.gpu: dict[str, str] = {}
        self.cpu_s: dict[str, float] = {}
        self.snapshots = collections.deque[SnapshotEntry](maxlen=SNAPSHOTS)
        self._placed: dict[str, Any] = {}  # actor id -> place, for ranks with no pid reported
        self._placed_version = -1
        self._evaluated = 0.0
        self._evaluated_whole = 0.0  # the last evaluation of the long span for every rank
        self._entry: MemoryStatusEntry | None = None  # made by each fold
        self.snapshots_asked = 0
        self.bands: dict[int, tuple[float, float]] = {}  # window -> first and last seen open
        self._task: asyncio.Task[None] | None = None
        shell.memory_recorded = self.recorded  # (the run's record keeps its memory too)

    def start(self) -> None:
        """Start the timer (once; from the event loop)."""
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            cfg = self.shell.run.config.memory
            await asyncio.sleep(pull_every(cfg.sample_s or 1.0))
            try:
                await self.pull()
            except Exception:  # the timer must outlive its own faults
                log.exception("memory pull failed")

    async def pull(self) -> None:
        """One watch to every node with ranks of the live run; their samples folded."""
        run = self._follow()
        cfg = run.config.memory
        if not cfg.sample_s or run.lifecycle not in ("configured", "running"):
            return
        _band(self.bands, run, time.time())
        by_node = await self._place()
        got = await asyncio.gather(
            *(self._watch(n, pids, cfg.sample_s) for n, pids in by_node.items())
        )
        now, roles, every = time.time(), self._roles(), pull_every(cfg.sample_s)
        whole = now - self._evaluated_whole >= max(every, cfg.leak_span_s / 20)
        evaluate = whole or now - self._evaluated >= max(every, cfg.leak_every_s())
        if evaluate:
            self._evaluated = now
        if whole:
            self._evaluated_whole = now
        fold = functools.partial(
            self._fold_all, self.book, by_node, got, now if evaluate else None, roles, whole
        )
        marked = await asyncio.get_running_loop().run_in_executor(self.shell.reads, fold)
        if marked is not None:
            self.shell.metrics.memory(marked)

    def _follow(self) -> Any:
        """The current run, its book begun if it is new (wherever a new run is seen first: a
        pull, the recorder's look); the last run's book kept for its record (``_Kept``)."""
        run = self.shell.run
        if run.name != self.run_name:  # (read on the event loop; the reads thread folds into
            self.kept = _Kept(  # the book a pull handed it, never ``self.book`` anew)
                self.book_run, self.book, self.where, list(self.snapshots), self.bands
            )
            self.book, self.run_name, self.book_run, self.where = MemoryBook(), run.name, run, {}
            self.snapshots = collections.deque(maxlen=SNAPSHOTS)
            self.bands, self._entry = {}, None
        return run

    def _fold_all(
        self,
        book: MemoryBook,
        by_node: dict[str, dict[int, Key]],
        got: list[AgentMemoryReply | None],
        evaluate_at: float | None,
        roles: dict[Key, str],
        whole: bool = True,
    ) -> list[MemoryMark] | None:
        """On the reads thread (the book is only touched there): the agents' samples folded,
        the leak marks made when due (the long span for every rank when ``whole``: a
        twentieth of it apart, the short one at every pull), ``status()["memory"]`` made
        anew; the marks when made."""
        pid_key = {pid: key for pids in by_node.values() for pid, key in pids.items()}
        pid_key.update({rm.pid: k for k, rm in book.ranks.items() if rm.pid is not None})
        for node, reply in zip(by_node, got, strict=True):
            if reply is not None:
                self._fold(book, node, reply, pid_key)
        cfg = self.shell.run.config.memory
        if evaluate_at is not None:
            book.evaluate(
                evaluate_at, cfg.leak_span_s, cfg.leak_min_bytes_per_s, cfg.leak_fast(), whole
            )
        entry = status_entry(book, roles, cfg.sample_s, list(self.snapshots))
        if book is self.book:  # (not a run that ended meanwhile)
            self._entry = entry
        return entry["marked"] if evaluate_at is not None else None

    async def _place(self) -> dict[str, dict[int, Key]]:
        """node -> {pid: rank} of the run's ranks; ``where`` says why a rank has no place."""
        st = self.shell.run.state
        missing: dict[Key, str] = {}
        for t in st.trainers.values():
            for r, h in t.handles.items():
                rec = st.ranks.get((t.trainer_id, r))
                if rec is None or rec.pid is None or rec.node_id is None:
                    aid = actor_id(h)
                    if aid:
                        missing[(t.trainer_id, r)] = aid
        if missing and (
            st.ranks_version != self._placed_version or set(missing.values()) - set(self._placed)
        ):
            loop = asyncio.get_running_loop()
            self._placed = await loop.run_in_executor(None, place_actors, set(missing.values()))
            self._placed_version = st.ranks_version
        by_node: dict[str, dict[int, Key]] = {}
        for key, rec in st.ranks.items():
            node, pid, why = rec.node_id, rec.pid, None
            if key in missing:
                place = self._placed.get(missing[key])
                node, pid = (place.node_id, place.pid) if place is not None else (None, None)
                if place is not None and not place.alive:
                    why = place.death or "its actor exited"
            if rec.state == "lost":
                why = (
                    str((rec.reason or {}).get("message") or "lost")
                    if isinstance(rec.reason, dict)
                    else "lost"
                )
            if node is None or pid is None:
                why = why or "its pid and node are not known yet"
            self.where[key] = (node, pid, why)
            if why is None and node is not None and pid is not None:
                by_node.setdefault(node, {})[pid] = key
        return by_node

    async def _watch(
        self, node: str, pids: dict[int, Key], sample_s: float
    ) -> AgentMemoryReply | None:
        name = agent_name(node)
        watch = {
            "targets": [{"pid": p} for p in sorted(pids)],
            "sample_s": sample_s,
            "watcher": f"{self.shell.namespace}/{self.shell.name}",
        }
        try:
            agent = await self.agents.get(name)
            reply: AgentMemoryReply = await asyncio.wait_for(
                agent.watch_memory.remote(watch), AGENT_TIMEOUT_S
            )
            return reply
        except Exception as exc:
            self.agents.forget(name)
            why = (
                f"no node agent on node {node[:12]}"
                if isinstance(exc, ValueError)
                else f"node {node[:12]}'s agent did not answer: {type(exc).__name__}: {exc}"[:300]
            )
            for key in pids.values():
                node_, pid, _ = self.where[key]
                self.where[key] = (node_, pid, why)
            return None

    def _fold(
        self, book: MemoryBook, node: str, reply: AgentMemoryReply, pid_key: dict[int, Key]
    ) -> None:
        if reply.get("gpu"):
            self.gpu[node] = str(reply["gpu"])
        else:
            self.gpu.pop(node, None)
        self.cpu_s[node] = float(reply.get("cpu_s") or 0.0)
        if nm := reply.get("node_memory"):  # (an older agent sends none)
            book.nodes[node] = nm
        for p in reply.get("processes") or []:
            key = pid_key.get(p["pid"])
            if key is None:
                continue
            if p["samples"]:
                book.add(key, p["pid"], p["samples"], p.get("error"), node)
            if p.get("gone"):
                book.lose(key, str(p["gone"]))
        for note in reply.get("snapshots") or []:
            key = pid_key.get(note.get("pid", -1))
            if key is not None and book is self.book:
                self.snapshots.append(
                    {"trainer_id": key[0], "rank": key[1], "on": note["on"],
                     "path": note.get("path"), "error": note.get("error"),
                     "at": float(note.get("at") or time.time())}
                )  # fmt: skip

    async def snapshot(self, ranks: list[int] | None, trainer_id: str | None) -> SnapshotReply:
        """Ask the run's ranks (``ranks`` of ``trainer_id``: None for all) for a CUDA memory
        snapshot now, through their node agents; each one notes its file when written."""
        run = self.shell.run
        self.snapshots_asked += 1
        n = self.snapshots_asked
        by_node = await self._place()
        trainers = run.state.trainers
        asked: list[SnapshotAsk] = []
        calls: dict[str, list[tuple[Key, int, str]]] = {}
        for key, (node, pid, why) in sorted(self.where.items()):
            t = trainers.get(key[0])
            if t is None or (trainer_id is not None and key[0] != trainer_id):
                continue
            if ranks is not None and key[1] not in ranks:
                continue
            name = f"demand-{n:03d}/{t.role}/rank{key[1]}.memory.pickle"
            local = t.run_dir and not is_remote(t.run_dir)
            path = os.path.join(t.run_dir, "memory", name) if local else name  # type: ignore[arg-type]
            if why is not None or node is None or pid is None or node not in by_node:
                asked.append(_ask(key, path, why or "not placed"))
            else:
                calls.setdefault(node, []).append((key, pid, path))
        for got in await asyncio.gather(*(self._ask_node(n_, c) for n_, c in calls.items())):
            asked += got
        return {"request": n, "ranks": sorted(asked, key=lambda a: (a["trainer_id"], a["rank"]))}

    async def _ask_node(self, node: str, calls: list[tuple[Key, int, str]]) -> list[SnapshotAsk]:
        name = agent_name(node)
        try:
            agent = await self.agents.get(name)
            req = {"targets": [(pid, path) for _, pid, path in calls]}
            got = await asyncio.wait_for(agent.request_snapshots.remote(req), AGENT_TIMEOUT_S)
            by_pid = {g["pid"]: g for g in got}
        except Exception as exc:
            self.agents.forget(name)
            why = f"node {node[:12]}'s agent: {type(exc).__name__}: {exc}"[:300]
            return [_ask(key, path, why) for key, _, path in calls]
        return [
            _ask(key, path, (by_pid.get(pid) or {}).get("reason", "no answer"))
            for key, pid, path in calls
        ]

    # ------------------------------------------------------------------ readers

    def _roles(self, run: Any = None) -> dict[Key, str]:
        """Each registered rank's role (read on the event loop, which owns the trainers)."""
        return {
            (t.trainer_id, r): t.role
            for t in (run or self.shell.run).state.trainers.values()
            for r in set(t.ranks) | set(t.handles)
        }

    def entry(self) -> MemoryStatusEntry:
        """``status()["memory"]``, as the last fold made it (nothing is computed here)."""
        sample_s = float(self.shell.run.config.memory.sample_s)
        if self._entry is None or self.run_name != self.shell.run.name:
            return status_entry(MemoryBook(), {}, sample_s, [])
        return {**self._entry, "sample_s": sample_s}

    async def recorded(
        self, run: str, series: bool = True, trainer_id: str | None = None
    ) -> MemoryReply | None:
        """``memory(series, trainer_id)`` for run ``run``'s record (``run_recorder``; the
        findings' ``memory_leak`` asks for the marks alone, ``series`` False); None while this
        watcher holds none of it (another run's). A run that ends before the first pull (a
        short one) is recorded too: its ranks with no sample, not "memory was not recorded";
        the run before the current one is answered from its kept book (it ended, and the next
        began, before the recorder's look), so its record gets its last memory; an older kept
        run this watcher never saw current, with its ranks and no sample."""
        live = self._follow()  # (the run may have begun since the last pull)
        if run == live.name:
            return await self.reply(series, trainer_id)
        kept = self.kept
        if kept is not None and kept.run.name == run:  # (the run before: its last memory)
            _band(kept.bands, kept.run, time.time())
            return await self._made(kept, series, trainer_id)
        old = next((r for r in self.shell.previous if r.name == run), None)
        if old is not None:  # (current only between two looks, never seen: its ranks, no sample)
            return await self._made(_Kept(old, MemoryBook(), {}, [], {}), series, trainer_id)
        return None

    async def reply(self, series: bool, trainer_id: str | None) -> MemoryReply:
        """``memory()``: every rank of the run (of ``trainer_id``), oldest trainer first; made
        on the reads thread, where the book is folded."""
        run = self._follow()
        _band(self.bands, run, time.time())
        now = _Kept(run, self.book, self.where, list(self.snapshots), self.bands)
        return await self._made(now, series, trainer_id)

    async def _made(self, of: _Kept, series: bool, trainer_id: str | None) -> MemoryReply:
        """``memory()`` of a run's book, made on the reads thread."""
        roles = self._roles(of.run)
        wanted = [
            ((t.trainer_id, r), t.role)
            for t in of.run.state.trainers.values()
            if trainer_id is None or t.trainer_id == trainer_id
            for r in sorted(set(t.ranks) | set(t.handles))
        ]
        of = _Kept(of.run, of.book, dict(of.where), list(of.snapshots), dict(of.bands))
        nodes = (dict(self.gpu), dict(self.cpu_s))
        make = functools.partial(_reply, of, nodes, roles, wanted, series)
        return await asyncio.get_running_loop().run_in_executor(self.shell.reads, make)


def _reply(
    of: _Kept,
    nodes: tuple[dict[str, str], dict[str, float]],
    roles: dict[Key, str],
    wanted: list[tuple[Key, str]],
    series: bool,
) -> MemoryReply:
    """``memory()`` of a run's book (on the reads thread); ``nodes``: each node's GPU note
    and its agent's CPU seconds."""
    run, book = of.run, of.book
    culprits = book.culprits(roles)
    cfg = run.config.memory
    fast = cfg.leak_fast() or (0.0, 0.0)
    return {
        "run": run.name,
        "sample_s": float(cfg.sample_s),
        "leak_span_s": float(cfg.leak_span_s),
        "leak_min_bytes_per_min": cfg.leak_min_mib_per_min * MiB,
        "leak_fast_span_s": fast[0],
        "leak_fast_min_bytes_per_min": fast[1] * 60.0,
        "taken_at": time.time(),
        "ranks": [
            rank_entry(book, key, role, of.where.get(key), series, key in culprits)
            for key, role in wanted
        ],
        "culprits": culprit_lines(marks(book, roles), roles),
        "windows": [(i, a, b) for i, (a, b) in sorted(of.bands.items())],
        "gpu": dict(nodes[0]),
        "agent_cpu_s": dict(nodes[1]),
        "snapshots": list(of.snapshots),
        "nodes": dict(book.nodes),
    }


def _band(bands: dict[int, tuple[float, float]], run: Any, now: float) -> None:
    """The run's windows as chart bands: when each opened and closed (still open: now)."""
    for rec in list(run.state.windows.values()):
        if rec.opened_at is not None:
            bands[rec.window.index] = (rec.opened_at, rec.closed_at or now)
    while len(bands) > SNAPSHOTS:
        bands.pop(min(bands))


def _ask(key: Key, path: str, why: str | None) -> SnapshotAsk:
    return {"trainer_id": key[0], "rank": key[1], "path": path, "asked": why is None, "reason": why}
