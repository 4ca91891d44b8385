"""The coordinator's records of one run: a rank, a trainer, a window. Pure: no Ray, no I/O."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from coordinator.core.aggregate import WindowAggregate, busy_ms_per_step, step_ms
from coordinator.core.marks import WindowProfile
from coordinator.core.schedule import Window
from coordinator.protocol.replies import (
    AgentEntry,
    AgentError,
    AttachedEntry,
    AutoTrigger,
    OptimizerSteps,
    RankEntry,
    RankState,
    RegressionEntry,
    RoleWindow,
    TrainerEntry,
    WindowEntry,
    WindowTrace,
)
from coordinator.protocol.stack_replies import StackDump

Key = tuple[str, int]
"""A rank of a trainer: ``(trainer_id, rank)``."""
LISTED = 64
"""Per-rank lists in a large run's default ``status()`` stop after this many ranks."""


@dataclass
class RankRecord:
    """What the coordinator knows about one rank of one trainer."""

    trainer_id: str
    rank: int
    selected: bool
    state: RankState = "ok"
    reason: Any = None
    device: str | None = None
    note: str | None = None
    windows_captured: int = 0
    last_trace_path: str | None = None
    agent: AgentEntry | None = None
    last_agent_error: AgentError | None = None
    node_id: str | None = None
    pid: int | None = None
    stack_dump: StackDump | None = None  # how its agent reads its stack without py-spy
    attached: AttachedEntry | None = None  # a rank the setup hook attached: job, class, pid

    @property
    def active(self) -> bool:
        """Whether RPCs still go to this rank."""
        return self.selected and self.state == "ok"

    @property
    def public_state(self) -> RankState:
        """The state ``status()`` shows (``not_selected`` for a rank nobody profiles)."""
        return self.state if self.selected else "not_selected"

    def to_dict(self) -> RankEntry:
        return {
            "trainer_id": self.trainer_id,
            "rank": self.rank,
            "state": self.public_state,
            "reason": self.reason,
            "device": self.device,
            "note": self.note,
            "windows_captured": self.windows_captured,
            "last_trace_path": self.last_trace_path,
            "agent": self.agent,
            "last_agent_error": self.last_agent_error,
            "node_id": self.node_id,
            "attached": self.attached,
        }


@dataclass
class TrainerRecord:
    trainer_id: str
    role: str
    ranks: list[int]
    handles: dict[int, Any]
    run_dir: str | None
    driver: dict[str, Any] | None = None  # the driver's pid, node_id and stack dump
    spmd: bool = False  # its ranks step themselves (RankSession): the coordinator never calls them
    world: int | None = None  # an SPMD trainer's world size (``ranks``: those attached so far)
    attaches: dict[int, int] = field(default_factory=dict)  # SPMD: rank -> times it attached
    epochs: dict[tuple[int, int], int] = field(default_factory=dict)  # SPMD: (generation,
    # first step) -> the index of the first window its ranks' plans open (``rank_start``)

    def to_dict(self, stepping: bool) -> TrainerEntry:
        return {
            "trainer_id": self.trainer_id,
            "role": self.role,
            "world_size": self.world if self.world is not None else len(self.ranks),
            "ranks": self.ranks,
            "advances_step": stepping,
            "run_dir": self.run_dir,
            "spmd": self.spmd,
        }


@dataclass
class WindowRecord:
    """One window the run opened; closed once every participating rank acknowledged."""

    window: Window
    planned: Window | None = None  # as planned, when the window opened moved (see kept)
    participants: set[tuple[str, int]] = field(default_factory=set)
    acked: set[tuple[str, int]] = field(default_factory=set)
    steps: tuple[int, int] | None = None
    partial: bool = False
    closed: bool = False
    trace_dirs: dict[str, str] = field(default_factory=dict)
    aggregates: dict[str, WindowAggregate] = field(default_factory=dict)
    summaries_pending: set[tuple[str, int]] = field(default_factory=set)
    # Where each rank's trace is once the node agent has finished it: {"path", "error"}.
    # A rank whose trace was written but not yet finished is in ``traces_pending``.
    traces: dict[tuple[str, int], WindowTrace] = field(default_factory=dict)
    traces_pending: set[tuple[str, int]] = field(default_factory=set)
    threshold: float = 1.25  # straggler threshold
    unopened: str | None = None  # why a planned window never opened (the run stopped first)
    stopped_at: int | None = None  # the last step when stop() cut the window short
    cut: str | None = None  # why the window was cut short, when not by the trainer's stop()
    trigger: AutoTrigger | None = None  # why an auto capture was taken
    marks: dict[str, RegressionEntry] = field(default_factory=dict)  # trainer_id -> its marks
    profiles: dict[str, WindowProfile] = field(default_factory=dict)  # trainer_id -> (marks)
    counted_slower: bool = False  # in the run's "regressions" count (once, whatever baseline)
    roles: dict[str, str] = field(default_factory=dict)  # trainer_id -> role, at the opening
    primary: str | None = None  # the stepping trainer: the per-rank fields are its ranks
    changes: int = 0  # bumped where a trace or a lost summary is recorded over another
    # trainer_id -> (first, last) optimizer steps, for ranks whose steps are a driver's
    optimizer_steps: dict[str, tuple[int, int]] = field(default_factory=dict)
    opened_at: float | None = None  # wall clock (the memory chart's bands)
    closed_at: float | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Copied without the cache of role parts."""
        state = dict(self.__dict__)
        state.pop("_parts_cache", None)
        return state

    @property
    def settled(self) -> bool:
        """Closed, with no summary or trace still to come: it can no longer change."""
        return self.closed and not self.summaries_pending and not self.traces_pending

    def snapshot(self) -> WindowRecord:
        """A copy that later changes to this window do not reach, to save or read off the event
        loop: its sets and dicts copied (C-speed), its aggregates snapshot (the values they hold
        are replaced, never changed in place)."""
        snap = copy.copy(self)
        for name, value in vars(snap).items():
            if isinstance(value, (set, dict)):
                setattr(snap, name, value.copy())
        snap.aggregates = {tid: agg.snapshot() for tid, agg in self.aggregates.items()}
        return snap

    def aggregate(self, trainer_id: str) -> WindowAggregate:
        agg = self.aggregates.get(trainer_id)
        if agg is None:
            agg = self.aggregates[trainer_id] = WindowAggregate(self.window.index)
        return agg

    def has_summary(self, key: tuple[str, int]) -> bool:
        agg = self.aggregates.get(key[0])
        return agg is not None and (key[1] in agg.rank_totals or key[1] in agg.bad_ranks)

    def promise(self) -> tuple[bool, str | None]:
        """Whether the window recorded exactly the steps planned for it, and if not, why."""
        plan = self.planned or self.window
        want = f"{plan.first}-{plan.last}"
        if self.unopened:
            return False, self.unopened
        if self.steps == (plan.first, plan.last) and not self.partial:
            return True, None
        got = f"{self.steps[0]}-{self.steps[1]}" if self.steps else "nothing"
        if self.partial and self.cut:
            return False, f"{self.cut}: recorded {got} of {want}"
        if self.partial:
            return False, (
                f"the run stopped at step {self.stopped_at} inside the window: "
                f"recorded {got} of {want}"
            )
        return (
            False,
            f"the trainer skipped past the planned steps: recorded {got} instead of {want}",
        )

    def to_dict(
        self, complete: bool = True, parts: dict[str, RoleWindow] | None = None
    ) -> WindowEntry:
        """The window's entry; ``complete=False`` (a large run's default ``status()``) cuts
        each per-rank list to its first ``LISTED`` ranks and lists only the failed traces.
        ``parts``: its trainers' parts as made off the event loop (``Readers.status``)."""
        plan = self.planned or self.window
        kept, why = self.promise()
        roles = dict(parts) if parts is not None else self._role_parts(complete)
        marks = getattr(self, "marks", {})  # (a checkpoint from before has none)
        roles = {tid: {**part, "regression": marks.get(tid)} for tid, part in roles.items()}
        main = roles.get(getattr(self, "primary", None) or "") or next(iter(roles.values()), None)
        captured = main["ranks"] if main else []
        return {
            "index": self.window.index,
            "kind": self.window.kind,  # type: ignore[typeddict-item]
            "planned": [plan.first, plan.last],
            "steps": list(self.steps) if self.steps else None,
            "kept": kept,
            "reason": why,
            "partial": self.partial,
            "ranks": captured,
            "rank_count": main["rank_count"] if main else 0,
            "complete": complete,
            "trace_dir": main["trace_dir"] if main else None,
            "trace_dirs": dict(self.trace_dirs),
            "summaries_pending": main["summaries_pending"] if main else [],
            "traces_pending": main["traces_pending"] if main else [],
            "trace_errors": {
                r: t["error"] for r, t in (main["traces"] if main else {}).items() if t["error"]
            },
            "traces": main["traces"] if main else {},
            "stragglers": main["stragglers"] if main else [],
            "last_arriver": main["last_arriver"] if main else None,
            "launch_bound": main["launch_bound"] if main else [],
            "trigger": self.trigger,
            "regression": main["regression"] if main else None,  # the stepping trainer's
            "roles": roles,
        }

    def _role_parts(self, complete: bool) -> dict[str, RoleWindow]:
        """Each trainer's part, built once for as long as nothing they read has changed: a
        window's parts cost O(ranks) (about 6-20 ms at 10,000 ranks) and ``status()`` lists
        every window kept, so without this a status call grew with the run's history."""
        key = (complete, self._fingerprint())
        cached = self.__dict__.get("_parts_cache")
        if cached is not None and cached[0] == key:
            return dict(cached[1])
        parts = {tid: self._role_part(tid, complete) for tid in self._trainer_ids()}
        self.__dict__["_parts_cache"] = (key, parts)
        return dict(parts)

    def parts_kept(self, complete: bool) -> bool:
        """Whether the trainers' parts kept are those of the window as it is now."""
        cached = self.__dict__.get("_parts_cache")
        return cached is not None and cached[0] == (complete, self._fingerprint())

    def keep_parts_of(self, snap: WindowRecord) -> None:
        """Keep the parts a snapshot of this window made (``_role_parts``), if nothing they
        read has changed here since."""
        cached = snap.__dict__.get("_parts_cache")
        if cached is not None and cached[0][1] == self._fingerprint():
            self.__dict__["_parts_cache"] = cached

    def _fingerprint(self) -> tuple[Any, ...]:
        """What changes whenever something a role part reads changes: every set and dict a
        part lists only ever grows or shrinks, ``changes`` counts what is written over, and a
        large window's stragglers appear once a table has computed them off the loop."""
        aggs = tuple(
            (t, len(a.rank_totals), len(a.bad_ranks), a.stragglers_known)
            for t, a in self.aggregates.items()
        )
        sizes = (len(self.participants), len(self.acked), len(self.traces))
        pending = (len(self.traces_pending), len(self.summaries_pending))
        return (self.closed, self.steps, getattr(self, "changes", 0), sizes, pending, aggs)

    def _trainer_ids(self) -> list[str]:
        """The trainers in this window: its primary first, then the others by id."""
        ids = {tid for tid, _ in self.participants} | set(self.aggregates)
        primary = getattr(self, "primary", None)  # (a checkpoint from before has none)
        return sorted(ids, key=lambda tid: (tid != primary, tid))

    def _role_part(self, tid: str, complete: bool) -> RoleWindow:
        """Trainer ``tid``'s part of the window (``complete=False``: lists cut as in
        ``to_dict``)."""

        def cut(xs: list[Any]) -> list[Any]:
            return xs if complete else xs[:LISTED]

        mine = sorted(r for t, r in self.acked & self.participants if t == tid)
        captured = mine if self.steps else []
        by_rank = sorted((r, t) for (t_id, r), t in self.traces.items() if t_id == tid)
        traces = by_rank if complete else [(r, t) for r, t in by_rank if t["error"]]
        agg = self.aggregates.get(tid)
        busy = busy_ms_per_step(agg) if agg is not None else None
        return {
            "trainer_id": tid,
            "role": getattr(self, "roles", {}).get(tid, "policy"),
            "ranks": cut(captured),
            "rank_count": len(captured),
            "trace_dir": self.trace_dirs.get(tid),
            "traces": dict(cut(traces)),
            "traces_pending": cut(sorted(r for t, r in self.traces_pending if t == tid)),
            "summaries_pending": cut(sorted(r for t, r in self.summaries_pending if t == tid)),
            "stragglers": cut(sorted(agg.flagged(self.threshold) or [])) if agg else [],
            "launch_bound": cut(sorted(agg.gpu.launch_bound)) if agg else [],
            "busy_ms_per_step": busy[0] if busy else None,
            "busy_ms_per_step_max": busy[1] if busy else None,
            "last_arriver": _last_arriver_line(agg, self.threshold) if agg else None,
            "step_ms": step_ms(agg) if agg is not None else {},
            "regression": None,  # filled in by to_dict (marks change without a new part)
            **optimizer_steps_of(self, tid),
        }


def optimizer_steps_of(rec: WindowRecord, tid: str | None) -> OptimizerSteps:
    """``{"optimizer_steps": [first, last]}`` of trainer ``tid`` in ``rec``, when its ranks
    said them (a checkpoint or record from before has none: ``{}``)."""
    steps = getattr(rec, "optimizer_steps", {}).get(tid or "")
    return {"optimizer_steps": list(steps)} if steps else {}


def _last_arriver_line(agg: WindowAggregate, threshold: float) -> str | None:
    """``stragglers["last_arriver"]`` in a line, when the stragglers are known (or cheap)."""
    found = agg.known_stragglers(threshold)
    last = found.get("last_arriver") if found is not None else None
    return f"rank {last['rank']} {last['reason']}" if last else None
