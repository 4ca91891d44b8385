"""Each trainer's findings of a window, made once per window and kept, for ``status()`` and the
tracker (issue 57; docs/advise.md#in-status-and-the-tracker).

``status()`` is polled, and a window's findings cost ``advise()``'s reads (its table, its
collectives matched: about 1 s at 1,024 ranks of 200 collectives) and the rules (8-9 ms): they
are made by ``advise()`` itself (on the shell's reads thread, never on the event loop), kept
until the window changes (a summary more, a trace written over) or falls out of the ``KEPT``
latest, and ``status()`` never waits for them: it shows what is kept and has them made in the
background, one window at a time (``latest``). A fault of the rules is kept too, as a problem
line: ``status()`` and the tracker answer with it and never fail.

``status()["findings"]`` lists one entry per trainer of the latest closed window (its stepping
trainer first, at most ``MAX_TRAINERS``), not one for the run: a policy and its rollout each
have their own part of a window, and their own findings, as ``advise(role=...)`` answers them.
Each entry carries its ``SHOWN`` costliest findings, without their evidence, their ranks
bounded as the evidence bounds them (``EVIDENCE_RANKS``).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from typing import Any

from coordinator.core.findings import EVIDENCE_RANKS
from coordinator.core.records import WindowRecord
from coordinator.core.run import Run
from coordinator.protocol.finding_replies import (
    Finding,
    FindingsReply,
    StatusFinding,
    StatusFindings,
)

SHOWN = 3  # findings a trainer's entry lists, the costliest
MAX_TRAINERS = 8  # trainers of a window listed in status()
KEPT = 32  # (run, window, trainer) findings kept
MAX_PROBLEMS = 4  # problem lines an entry carries
Advise = Callable[..., Awaitable[FindingsReply]]
"""``advise_reads.advise`` bound to the readers: ``(window=, trainer_id=, run=)``."""


def status_finding(f: Finding) -> StatusFinding:
    """``f`` without evidence or steps; over ``EVIDENCE_RANKS`` ranks, the ones its evidence
    lists (its costliest), else its first."""
    ranks = f["ranks"]
    if len(ranks) > EVIDENCE_RANKS:
        listed = (f.get("evidence") or {}).get("ms_per_step")
        ranks = sorted(map(int, listed)) if isinstance(listed, dict) else ranks[:EVIDENCE_RANKS]
    return {
        "rule": f["rule"],
        "ranks": ranks[:EVIDENCE_RANKS],
        "ranks_total": len(f["ranks"]),
        "all_ranks": f["all_ranks"],
        "cost_ms_per_step": f["cost_ms_per_step"],
        "advice": f["advice"],
    }


RUN_THREATS = ("memory_leak", "memory_peak")
"""Findings that cost a step nothing (0 ms) but threaten the run: never left out of an entry
for cheaper ones."""


def bounded(reply: FindingsReply, shown: int = SHOWN) -> StatusFindings:
    """``advise()``'s reply as ``status()`` carries it: its ``shown`` costliest findings, but a
    ``RUN_THREATS`` finding listed in place of the cheapest of them."""
    found = reply["findings"]
    threats = [f for f in found if f["rule"] in RUN_THREATS][:shown]
    others = [f for f in found if f["rule"] not in RUN_THREATS][: shown - len(threats)]
    chosen = {id(f) for f in threats + others}
    listed = [f for f in found if id(f) in chosen]  # (costliest first, as advise() has them)
    return {
        "window": reply["window"] if reply["window"] is not None else -1,
        "steps": reply["steps"],
        "trainer_id": reply["trainer_id"] or "",
        "role": reply["role"],
        "findings": [status_finding(f) for f in listed],
        "findings_total": len(found),
        "problems": reply["problems"][:MAX_PROBLEMS],
    }


def window_key(rec: WindowRecord, tid: str) -> tuple[Any, ...]:
    """What changes whenever trainer ``tid``'s figures of ``rec`` can change: a summary more
    (or a failed one), one less pending, the steps, a record written over."""
    agg = rec.aggregates.get(tid)
    sizes = (len(agg.rank_totals), len(agg.bad_ranks)) if agg is not None else (0, 0)
    pending = sum(1 for t, _ in rec.summaries_pending if t == tid)
    return (rec.closed, rec.steps, getattr(rec, "changes", 0), pending, sizes)


MAKING = "the findings of this window are being made: ask again (advise() waits for them)"
REMAKING = "the window changed (a summary more): its findings are being made again"


def failed(run: str, rec: WindowRecord, tid: str, exc: BaseException | None) -> FindingsReply:
    """The reply of a window whose findings could not be made (``exc``; None: not made yet):
    one problem line."""
    return {
        "run": run,
        "window": rec.window.index,
        "steps": list(rec.steps) if rec.steps else None,
        "trainer_id": tid,
        "role": getattr(rec, "roles", {}).get(tid),
        "findings": [],
        "quiet": [],
        "not_judged": {},
        "problems": [
            f"the findings could not be made: {type(exc).__name__}: {exc}"[:300]
            if exc is not None
            else MAKING
        ],
    }


class FindingCache:
    """A window's findings per trainer, made by ``advise`` once per change of the window, the
    ``kept`` latest kept (see the module docstring)."""

    def __init__(self, advise: Advise, kept: int = KEPT) -> None:
        self.advise, self.kept = advise, kept
        self.made = 0  # how often the rules ran (a test reads it)
        self._done: collections.OrderedDict[tuple[str, int, str], tuple[Any, FindingsReply]]
        self._done = collections.OrderedDict()
        self._lock = asyncio.Lock()  # (made one window at a time, on the reads thread)
        self._making: dict[tuple[str, int, str], asyncio.Task[FindingsReply]] = {}

    async def window(self, run: Run, rec: WindowRecord, tid: str) -> FindingsReply:
        """Trainer ``tid``'s findings of ``rec``, made now only when they changed; a fault is
        a problem line, never raised."""
        where, key = (run.name, rec.window.index, tid), window_key(rec, tid)
        async with self._lock:
            hit = self._done.get(where)
            if hit is not None and hit[0] == key:
                self._done.move_to_end(where)
                return hit[1]
            try:
                reply = await self.advise(window=rec.window.index, trainer_id=tid, run=run.name)
            except Exception as exc:  # (a rule's fault: said, never raised to status())
                reply = failed(run.name, rec, tid, exc)
            self.made += 1
            self._done[where] = (key, reply)
            self._done.move_to_end(where)
            while len(self._done) > self.kept:
                self._done.popitem(last=False)
            return reply

    async def latest(self, run: Run, wait: bool = False) -> list[StatusFindings]:
        """``status()["findings"]``: each trainer's part of ``run``'s latest closed window. It
        never waits for the rules (``wait``: it does, for a record's ``status()``): findings
        not kept for the window as it is now are made in the background (once at a time per
        window and trainer), and meanwhile the ones kept before, or none, are shown with a
        problem line saying so."""
        closed = run.state.closed_windows()
        if not closed:
            return []
        rec = closed[-1]  # (as advise() picks it)
        primary = getattr(rec, "primary", None)
        tids = sorted(rec.aggregates, key=lambda t: (t != primary, t))[:MAX_TRAINERS]
        if wait:
            return [bounded(await self.window(run, rec, tid)) for tid in tids]
        return [self._kept_or_soon(run, rec, tid) for tid in tids]

    def _kept_or_soon(self, run: Run, rec: WindowRecord, tid: str) -> StatusFindings:
        """Trainer ``tid``'s findings of ``rec`` as kept; when they are not kept for the window
        as it is now, their making begun (unless under way)."""
        where, key = (run.name, rec.window.index, tid), window_key(rec, tid)
        hit = self._done.get(where)
        if hit is not None and hit[0] == key:
            return bounded(hit[1])
        if where not in self._making:
            task = asyncio.get_running_loop().create_task(self.window(run, rec, tid))
            self._making[where] = task
            task.add_done_callback(lambda _: self._making.pop(where, None))
        if hit is None:
            return bounded(failed(run.name, rec, tid, None))
        entry = bounded(hit[1])
        entry["problems"] = [REMAKING, *entry["problems"]][:MAX_PROBLEMS]
        return entry
