"""The coordinator's records of one run: a rank, a trainer, a window. Pure: no Ray, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from coordinator.core.aggregate import WindowAggregate
from coordinator.core.schedule import Window
from coordinator.protocol.replies import (
    AgentEntry,
    AgentError,
    AutoTrigger,
    RankEntry,
    RankState,
    RegressionEntry,
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
        }


@dataclass
class TrainerRecord:
    trainer_id: str
    role: str
    ranks: list[int]
    handles: dict[int, Any]
    run_dir: str | None
    driver: dict[str, Any] | None = None  # the driver's pid, node_id and stack dump

    def to_dict(self, stepping: bool) -> TrainerEntry:
        return {
            "trainer_id": self.trainer_id,
            "role": self.role,
            "world_size": len(self.ranks),
            "ranks": self.ranks,
            "advances_step": stepping,
            "run_dir": self.run_dir,
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
    regression: RegressionEntry | None = None  # against the run's baseline (diffs.mark)

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

    def to_dict(self, complete: bool = True) -> WindowEntry:
        """The window's entry; ``complete=False`` (a large run's default ``status()``) cuts
        each per-rank list to its first ``LISTED`` ranks and lists only the failed traces."""
        captured = sorted({r for _, r in self.acked & self.participants} if self.steps else ())
        plan = self.planned or self.window
        kept, why = self.promise()

        def cut(xs: list[Any]) -> list[Any]:
            return xs if complete else xs[:LISTED]

        by_key = sorted(self.traces.items(), key=lambda kt: kt[0])
        failed = [(r, t) for (_, r), t in by_key if t["error"]]
        traces = [(r, t) for (_, r), t in by_key] if complete else failed
        return {
            "index": self.window.index,
            "kind": self.window.kind,  # type: ignore[typeddict-item]
            "planned": [plan.first, plan.last],
            "steps": list(self.steps) if self.steps else None,
            "kept": kept,
            "reason": why,
            "partial": self.partial,
            "ranks": cut(captured),
            "rank_count": len(captured),
            "complete": complete,
            "trace_dir": next(iter(self.trace_dirs.values()), None),
            "trace_dirs": dict(self.trace_dirs),
            "summaries_pending": cut(sorted(r for _, r in self.summaries_pending)),
            "traces_pending": cut(sorted(r for _, r in self.traces_pending)),
            "trace_errors": {r: t["error"] for r, t in cut(failed) if t["error"]},
            "traces": dict(cut(traces)),
            "stragglers": cut(
                sorted(
                    {r for a in self.aggregates.values() for r in a.flagged(self.threshold) or []}
                )
            ),
            "trigger": self.trigger,
            "regression": getattr(self, "regression", None),  # (a checkpoint from before)
        }
