"""The readers' calls: ``status``, ``kernel_summary``, ``wait_window``, ``ping``, ``get_config``.

None of them changes a run. ``wait_window`` waits on the shell's change event instead of
polling ``status()``: it wakes when a report about a window arrives, and answers as soon as the
window is done (its summaries in, or its traces finished too).
"""

from __future__ import annotations

import asyncio
import collections
import os
import sys
import time
from typing import Any, Literal

from coordinator.core.aggregate import CHEAP_RANKS, TABLES
from coordinator.core.kineto_fit import kineto_schedule_problems
from coordinator.core.phases import EXACT_STEPS, MAX_BUCKETS
from coordinator.core.run import Run
from coordinator.core.state import kernel_summary, rank_counts, trainer_window, with_window
from coordinator.core.step_series import MAX_POINTS, step_series
from coordinator.core.validate import is_int, is_number, role_problem, trainer_id_problem
from coordinator.protocol.collective_replies import WindowCollectivesReply
from coordinator.protocol.finding_replies import StatusFindings
from coordinator.protocol.replies import (
    KernelSummaryReply,
    NodesEntry,
    PhaseTimesReply,
    PingReply,
    PreviousRunEntry,
    RanksPage,
    RoleWindow,
    StatusReply,
    StepSeriesReply,
    WaitWindowReply,
    WindowEntry,
)
from coordinator.service import collective_reads
from coordinator.service.node_fanout import NodeFanOut
from coordinator.service.shell import CoordinatorShell
from coordinator.service.status_findings import FindingCache

WaitUntil = Literal["summaries", "traces"]
FULL_STATUS_RANKS = 256  # up to this many ranks, status() lists every one by default
LISTED_RANKS = 128  # above it, at most this many ranks not ok are listed
LISTED_NODES = 64
RANK_STATES = ("ok", "disabled", "lost", "unresponsive", "not_selected")
MAX_WAIT_S = 3600.0


class Readers:
    """What operators, notebooks and the CLI read (see the actor's docs)."""

    def __init__(self, shell: CoordinatorShell) -> None:
        self.shell = shell
        self.findings: FindingCache | None = None  # set by whoever answers advise()
        self._series: tuple[tuple[str, int, int], StepSeriesReply] | None = None

    async def status(self, ranks: str = "summary") -> StatusReply:
        if ranks not in ("summary", "all"):
            raise ValueError(f"ranks must be 'summary' or 'all', got {ranks!r:.80}")
        sh = self.shell
        if sh.recovering:
            async with sh.lock:
                await sh.recover()
        run = sh.run
        complete = ranks == "all" or len(run.state.ranks) <= FULL_STATUS_RANKS
        parts = await self._large_parts(complete)
        found = await self.latest_findings(run)
        st, plan = run.state, run.plan
        cur, nxt = plan.current, plan.next_window()
        listed = [r.to_dict() for r in st.ranks.values() if complete or r.reason is not None]
        return {
            "name": sh.name,
            "namespace": sh.namespace,
            "run": run.info(),
            "phase": sh.phase(),
            "config": run.config.public_dict(),
            "run_dir": run.run_dir,
            "global_step": st.global_step,
            "current_window": cur.to_dict() if cur else None,
            "next_window": nxt.to_dict() if nxt else None,
            "windows": [w.to_dict(complete, parts.get(id(w))) for w in st.closed_windows()],
            "trainers": [
                t.to_dict(t.trainer_id == st.stepping_trainer) for t in st.trainers.values()
            ],
            "ranks": listed[: None if complete else LISTED_RANKS],
            "ranks_complete": complete,
            "rank_counts": rank_counts(st),
            "nodes": nodes_entry(sh.nodes, complete),
            "counters": {
                "worker_rpcs": 0,
                "ignored_steps": 0,
                "skipped_windows": plan.skipped_windows,
                **dict(st.counters),
            },
            "metrics": sh.metrics.snapshot(),
            "process": {
                "pid": os.getpid(),
                "torch_loaded": "torch" in sys.modules,
                "worker_handle_stubs": sh.stubs,
                "loop": sh.loop_watch.entry(),
            },
            "restarts": sh.restarts,
            "last_restart": sh.last_restart_at,
            "checkpoint": sh.checkpoint.entry(),  # type: ignore[typeddict-item]
            "record": sh.record_entry(),
            "previous_runs": [_previous(r) for r in sh.previous],
            "auto_capture": sh.auto_capture_entry(),
            "stalls": [dict(s) for s in sh.stalls],  # type: ignore[misc]
            "attach_problems": [dict(p) for p in sh.attach_problems],  # type: ignore[misc]
            "schedule_problems": kineto_schedule_problems(
                run.config, run.detector.step_s() if run.detector else None
            ),
            "memory": sh.memory_entry(),
            "findings": found,
        }

    async def latest_findings(self, run: Run, wait: bool = False) -> list[StatusFindings]:
        """``status()["findings"]``: ``run``'s latest closed window's, as kept (none kept:
        a ``Readers`` no ``advise`` was given to, ``advise_reads.keep_findings``)."""
        return await self.findings.latest(run, wait) if self.findings is not None else []

    async def ranks(
        self, offset: int, limit: int, state: str | None, trainer_id: str | None
    ) -> RanksPage:
        if not is_int(offset) or offset < 0:
            raise ValueError(f"offset must be an int >= 0, got {offset!r:.80}")
        if not is_int(limit) or not 1 <= limit <= 10_000:
            raise ValueError(f"limit must be an int in 1..10000, got {limit!r:.80}")
        if state is not None and state not in RANK_STATES:
            raise ValueError(f"state must be one of {', '.join(RANK_STATES)}, got {state!r:.80}")
        if trainer_id is not None and (problem := trainer_id_problem(trainer_id)):
            raise ValueError(problem)
        found = [
            rec
            for key, rec in sorted(self.shell.run.state.ranks.items())
            if (state is None or rec.public_state == state)
            and (trainer_id is None or key[0] == trainer_id)
        ]
        page = [rec.to_dict() for rec in found[offset : offset + limit]]
        return {"total": len(found), "offset": offset, "limit": limit, "ranks": page}

    async def _large_parts(self, complete: bool) -> dict[int, dict[str, RoleWindow]]:
        """The trainers' parts of each window of over ``CHEAP_RANKS`` ranks whose kept parts
        are stale, made from a snapshot off the event loop (O(ranks): 4.4 ms at 10,000 ranks in
        process, 20-26 ms of a turn in the 10,000-rank simulation, after every partial folded
        in); by ``id`` of the window."""
        out: dict[int, dict[str, RoleWindow]] = {}
        loop = asyncio.get_running_loop()
        for rec in self.shell.run.state.closed_windows():
            if len(rec.participants) <= CHEAP_RANKS or rec.parts_kept(complete):
                continue
            snap = rec.snapshot()
            made = await loop.run_in_executor(self.shell.status_parts, snap._role_parts, complete)
            rec.keep_parts_of(snap)
            out[id(rec)] = made
        return out

    async def kernel_summary(
        self,
        window: int | None,
        top_k: int,
        trainer_id: str | None,
        per_rank: bool,
        run: str | None,
        role: str | None = None,
        by: str = "kernel",
    ) -> KernelSummaryReply:
        if not is_int(top_k) or not 0 <= top_k <= 100_000:
            raise ValueError(f"top_k must be an int in 0..100000, got {top_k!r:.80}")
        if window is not None and not is_int(window):
            raise ValueError(f"window must be an int or None, got {window!r:.80}")
        if trainer_id is not None and (problem := trainer_id_problem(trainer_id)):
            raise ValueError(problem)
        if not isinstance(per_rank, bool):
            raise ValueError(f"per_rank must be True or False, got {per_rank!r:.80}")
        if role is not None and (problem := role_problem(role)):
            raise ValueError(problem)
        if by not in TABLES:
            raise ValueError(f"by must be one of {', '.join(TABLES)}, got {by!r:.80}")
        target = self._run(run)
        st = target.state
        tid, rec, agg = trainer_window(st, window, trainer_id, role)
        if rec is None or agg is None or agg.cheap:
            out = kernel_summary(st, window, top_k, tid, bool(per_rank), by)
        else:  # O(ranks) of Python: on a snapshot, off the event loop
            snap = agg.snapshot()
            loop = asyncio.get_running_loop()
            table = await loop.run_in_executor(
                self.shell.reads, snap.to_dict, top_k, st.straggler_threshold, bool(per_rank), by
            )
            agg.keep_stragglers(snap)
            out = with_window(table, rec, tid)
            out["by"] = by
        out["run"] = target.name
        return out

    async def collectives(
        self, window: Any, trainer_id: Any, run: Any, role: Any, shown: Any
    ) -> WindowCollectivesReply:
        return await collective_reads.collectives(
            self.shell, self._run(run), window, trainer_id, role, shown
        )

    async def wait_window(
        self, window: int, run: str | None, until: WaitUntil, timeout_s: float
    ) -> WaitWindowReply:
        if not is_int(window) or window < 0:
            raise ValueError(f"window must be an int >= 0, got {window!r:.80}")
        if run is not None and not isinstance(run, str):
            raise ValueError(f"run must be a run's name or None, got {run!r:.80}")
        if until not in ("summaries", "traces"):
            raise ValueError(f"until must be 'summaries' or 'traces', got {until!r:.80}")
        if not is_number(timeout_s) or not 0 <= timeout_s <= MAX_WAIT_S:
            raise ValueError(f"timeout_s must be a number in 0..{MAX_WAIT_S:g}, got {timeout_s!r}")
        name = run if run is not None else self.shell.run.name
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._window_now(name, window, until)
            left = deadline - time.monotonic()
            gone = reply["window"] is None and reply["reason"] is not None
            if reply["done"] or gone or left <= 0:
                return reply
            await self.shell.wait_for_change(left)

    def _window_now(self, name: str, index: int, until: WaitUntil) -> WaitWindowReply:
        """Where window ``index`` of run ``name`` stands now."""
        target = self.shell.find_run(name)
        if target is None:
            why = f"run {name!r} is not kept by this coordinator (it keeps {self._kept()})"
            return {"run": name, "done": False, "window": None, "lifecycle": None, "reason": why}
        rec = target.state.windows.get(index)
        entry: WindowEntry | None = rec.to_dict() if rec is not None and rec.closed else None
        ended = target.lifecycle in ("stopped", "abandoned")
        out: WaitWindowReply = {
            "run": name,
            "done": entry is not None and _done(entry, until),
            "window": entry,
            "lifecycle": target.lifecycle,
            "reason": None,
        }
        if entry is None and ended:
            out["reason"] = target.ended_reason or target.lifecycle
        elif rec is None and index not in target.plan.promised and _later_kept(target, index):
            out["reason"] = (
                f"window {index} of run {name} is not kept (dropped from the history, or a "
                "cancelled capture)"
            )
        return out

    def _kept(self) -> list[str]:
        return [self.shell.run.name, *(r.name for r in self.shell.previous)]

    def _run(self, run: Any) -> Run:
        """The run named ``run`` (None: the current one); ValueError naming the kept ones."""
        if run is not None and not isinstance(run, str):
            raise ValueError(f"run must be a run's name or None, got {run!r:.80}")
        target = self.shell.find_run(run)
        if target is None:
            raise ValueError(f"no run {run!r:.80}: this coordinator keeps {self._kept()}")
        return target

    async def phase_times(self, last: Any, run: Any, buckets: Any) -> PhaseTimesReply:
        for name, value, top in (("last", last, EXACT_STEPS), ("buckets", buckets, MAX_BUCKETS)):
            if not is_int(value) or not 0 <= value <= top:
                raise ValueError(f"{name} must be an int in 0..{top}, got {value!r:.80}")
        found = self._run(run)
        return self.shell.phases.log(found.name).reply(
            last, buckets, found.name, found.state.stepping_trainer
        )

    async def step_series(self, points: Any, run: Any) -> StepSeriesReply:
        if not is_int(points) or not 1 <= points <= MAX_POINTS:
            raise ValueError(f"points must be an int in 1..{MAX_POINTS}, got {points!r:.80}")
        found = self._run(run)
        log = self.shell.phases.log(found.name)
        key = (found.name, log.steps_seen, points)
        if self._series is None or self._series[0] != key:  # one pass per new step at most
            series = step_series(log, points, found.name, found.state.stepping_trainer)
            self._series = (key, series)
        return self._series[1]

    async def ping(self) -> PingReply:
        run = self.shell.run
        live = run.lifecycle in ("configured", "running")
        return {"run": run.name, "restarts": self.shell.restarts, "live": live}

    async def get_config(self) -> dict[str, Any]:
        return self.shell.run.config.public_dict()


def nodes_entry(nodes: NodeFanOut, complete: bool) -> NodesEntry:
    """``status()["nodes"]``: counts by path; every node, or (not complete) the direct ones."""
    routes = sorted(nodes.routes.values(), key=lambda r: r.node)
    shown = routes if complete else [r for r in routes if r.path == "direct"][:LISTED_NODES]
    return {
        "by_path": dict(collections.Counter(r.path for r in routes)),
        "listed": [r.to_dict() for r in shown],
        "complete": complete,
    }


def _done(entry: WindowEntry, until: WaitUntil) -> bool:
    """Nothing more will arrive for this window that ``until`` waits for, from any role. A
    window that recorded nothing is done at once."""
    if entry["steps"] is None:
        return True
    parts = list(entry["roles"].values())
    if entry["summaries_pending"] or any(p["summaries_pending"] for p in parts):
        return False
    pending = entry["traces_pending"] or any(p["traces_pending"] for p in parts)
    return until == "summaries" or not pending


def _later_kept(run: Run, index: int) -> bool:
    """Whether the run keeps a window numbered after ``index`` (so ``index`` will not come)."""
    return any(i > index for i in run.state.windows)


def _previous(run: Run) -> PreviousRunEntry:
    return {
        "run": run.info(),
        "config": run.config.public_dict(),
        "windows": [w.to_dict() for w in run.state.closed_windows()],
    }
