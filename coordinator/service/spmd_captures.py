"""Captures at run time for SPMD ranks: planned ahead of every rank, delivered through the node
agents' plan boards, answered once every selected rank has acknowledged the plan.

``request_capture``, an auto capture and the web view's capture all come here when the stepping
trainer runs SPMD ranks (``trainers.RankSession``), which no coordinator call reaches:

1. Under the coordinator's lock, the capture is planned at ``spmd_plan.earliest_step`` or later
   (past where any rank can be once the plan reaches it) and numbered by its steps.
2. Without the lock, the trainer's board (its pending captures and the latest opened) goes to
   the agent of every node with one of its ranks (``post_plan``), which writes it where the
   ranks look and waits for the capture's ranks to acknowledge it.
3. Ranks that did not (dead, read it too late, silent for ``wait_s``) are named in the reply and
   the window is partial for each of them, with the reason ``late`` or ``lost``; the board goes
   out again without them, so one that reads it later does not record a window alone.
"""

from __future__ import annotations

import asyncio
import time

from coordinator.core.run import Run
from coordinator.core.schedule import Window
from coordinator.core.spmd_plan import MAX_KEPT, PlannedCapture, apply_misses, earliest_step
from coordinator.protocol.agent_rpc import PlanAnswer, PlanPost
from coordinator.protocol.names import agent_name
from coordinator.protocol.plan_board import Board, BoardEntry, board_id, encode_board
from coordinator.protocol.replies import CaptureReply, MissedRank
from coordinator.raylink.agents import AgentHandles
from coordinator.service.capture_rules import (
    accepted,
    auto_refused,
    capture_keys,
    count_capture,
    refusal,
)
from coordinator.service.shell import CaptureRequest, CoordinatorShell, Key

AGENT_MARGIN_S = 10.0  # beyond the acknowledgement wait: the agent's own answer


class SpmdCaptures:
    """Plans and delivers captures for SPMD ranks (see the module docstring)."""

    def __init__(self, shell: CoordinatorShell) -> None:
        self.shell = shell
        self._agents = AgentHandles()
        self._version = 0

    async def plan(self, req: CaptureRequest, wait_s: float) -> CaptureReply:
        """Plan ``req`` for the SPMD ranks and deliver it (steps 1-3 of the module docstring)."""
        sh = self.shell
        async with sh.lock:
            planned = self._reserve(req)
            if isinstance(planned, dict):
                return planned
            run, keys = sh.run, sh.run.capture_ranks[planned.index]
            posts = self._posts(run, planned.index, keys, wait_s)
        answers = await self._send(posts, wait_s + AGENT_MARGIN_S)
        misses = _misses(planned, keys, posts, answers, wait_s)
        async with sh.lock:
            if misses and sh.run is run:
                note_misses(run, run.spmd_captures[planned.index], misses)
                posts = self._posts(run, None, [], 0.0)
            else:
                posts = []
            sh.save()
        if posts:
            await self._send(posts, AGENT_MARGIN_S)
        return accepted(run, planned, keys, _missed(misses))

    def _reserve(self, req: CaptureRequest) -> Window | CaptureReply:
        """Step 1: the planned window, or the refusal."""
        sh, run = self.shell, self.shell.run
        no = refusal(sh, req)
        if no is None:
            watch = sh.stall_watch
            since = None if watch.last_at is None else time.monotonic() - watch.last_at
            earliest = earliest_step(run.plan.next_boundary, watch.median_step_s(), since)
            planned = run.plan.request_capture(
                req.warmup, req.active, req.start_step, req.kind, earliest, by_steps=True
            )
            no = planned if isinstance(planned, str) else None
        if no is not None:
            if req.kind == "auto":
                return auto_refused(sh, req, no)
            return sh.capture_no(no)
        assert isinstance(planned, Window)
        run.capture_ranks[planned.index] = keys = capture_keys(sh, req)
        run.spmd_captures[planned.index] = PlannedCapture(planned, keys)
        opened = [i for i in run.spmd_captures if i not in run.plan.promised]
        for i in opened[: max(0, len(opened) - MAX_KEPT)]:
            del run.spmd_captures[i]  # (the oldest opened)
        count_capture(sh, req, planned)
        sh.save()
        return planned

    def _posts(
        self, run: Run, window: int | None, keys: list[Key], wait_s: float
    ) -> list[tuple[str, list[Key], PlanPost]]:
        """Each SPMD trainer's board for every node with one of its selected ranks, waiting for
        the ranks of ``keys`` there: ``(node, keys waited for, post)``."""
        st, out = run.state, []
        self._version = max(self._version + 1, time.time_ns())
        for t in st.trainers.values():
            if not t.spmd:
                continue
            blob = encode_board(board(run, t.trainer_id, self._version))
            bid = board_id(self.shell.namespace, self.shell.name, run.name, t.trainer_id)
            nodes: dict[str | None, list[Key]] = {}
            for r in t.ranks:
                rec = st.ranks[(t.trainer_id, r)]
                if rec.selected:
                    nodes.setdefault(rec.node_id, [])
                    if (t.trainer_id, r) in keys:
                        nodes[rec.node_id].append((t.trainer_id, r))
            for node, waited in nodes.items():
                ranks = [(k[1], st.ranks[k].pid) for k in waited]
                post: PlanPost = {
                    "board": bid,
                    "blob": blob,
                    "version": self._version,
                    "window": window if waited else None,
                    "ranks": ranks,
                    "timeout_s": wait_s,
                }
                out.append((node or "", waited, post))
        return out

    async def _send(
        self, posts: list[tuple[str, list[Key], PlanPost]], timeout: float
    ) -> list[PlanAnswer | str]:
        """Each post to its node's agent: its answer, or why none came."""

        async def one(node: str, post: PlanPost) -> PlanAnswer | str:
            if not node:
                return "the rank never said which node it runs on"
            name = agent_name(node)
            try:
                agent = await self._agents.get(name)
                answer: PlanAnswer = await asyncio.wait_for(agent.post_plan.remote(post), timeout)
                return answer
            except Exception as exc:
                self._agents.forget(name)
                return f"its node agent could not be reached: {type(exc).__name__}: {exc}"[:500]

        return list(await asyncio.gather(*(one(node, post) for node, _, post in posts)))


def board(run: Run, trainer_id: str, version: int) -> Board:
    """The board of ``trainer_id``'s SPMD ranks: the captures planned for them (those not yet
    opened, the latest opened), each with its ranks of this trainer (those named late or lost
    left out)."""
    entries = []
    for pc in run.spmd_captures.values():
        c, opened = pc.window, pc.window.index not in run.plan.promised
        ranks = sorted(r for t, r in pc.keys if t == trainer_id and (t, r) not in pc.missed)
        entry = BoardEntry(c.index, c.warmup_start, c.first, c.last, c.kind, ranks, opened)
        entries.append(entry)
    return Board(run.name, trainer_id, version, entries)


def note_misses(run: Run, planned: PlannedCapture, misses: dict[Key, str]) -> None:
    """These ranks will not record ``planned``: it is partial for each, with the reason, when
    it opens (or now, if it already has)."""
    planned.missed.update(misses)
    if run.state.windows.get(planned.window.index) is not None:
        apply_misses(run.state, planned.window.index, misses)


def _misses(
    planned: Window,
    keys: list[Key],
    posts: list[tuple[str, list[Key], PlanPost]],
    answers: list[PlanAnswer | str],
    wait_s: float,
) -> dict[Key, str]:
    """The capture's ranks that did not acknowledge it, each with the reason."""
    out: dict[Key, str] = {}
    for (_, waited, post), answer in zip(posts, answers, strict=True):
        if not waited:
            continue
        if isinstance(answer, str):
            out.update({k: f"lost: rank {k[1]}: {answer}" for k in waited})
            continue
        t, pids = waited[0][0], dict(post["ranks"])
        for rank, step in answer["late"]:
            out[(t, rank)] = (
                f"late: rank {rank} read the plan at step {step}, after the warm-up of "
                f"window {planned.index} began (step {planned.warmup_start})"
            )
        for rank, why in answer["off"]:
            out[(t, rank)] = f"lost: rank {rank} can no longer follow the plan: {why}"
        for rank in answer["lost"]:
            out[(t, rank)] = f"lost: rank {rank}'s process (pid {pids.get(rank)}) is gone"
        for rank in answer["silent"]:
            out[(t, rank)] = (
                f"late: rank {rank} did not acknowledge the plan within {wait_s:g} s "
                "(in a long step, or stalled)"
            )
    return {k: v for k, v in out.items() if k in keys}


def _missed(misses: dict[Key, str]) -> list[MissedRank]:
    return [{"trainer_id": t, "rank": r, "reason": why} for (t, r), why in sorted(misses.items())]


def spmd_stepping(shell: CoordinatorShell) -> bool:
    """Whether the run's stepping trainer runs SPMD ranks."""
    st = shell.run.state
    t = st.trainers.get(st.stepping_trainer) if st.stepping_trainer is not None else None
    return t is not None and t.spmd
