"""The coordinator's bookkeeping: trainers, rank states, windows, counters. Pure: no Ray, no I/O.

The actor feeds it every worker reply (``apply_reply``) and failure (``rank_failed``); it decodes
summaries strictly, folds them into per-window aggregates and keeps history bounded.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from coordinator.aggregate import WindowAggregate, empty_summary
from coordinator.replies import (
    KernelSummary,
    RankEntry,
    TrainerEntry,
    WindowEntry,
    WindowTrace,
)
from coordinator.schedule import Window
from coordinator.summary_codec import SummaryDecodeError, decode_summary

RankState = Literal["ok", "disabled", "lost", "unresponsive", "not_selected"]
RANK_STATES: tuple[RankState, ...] = ("ok", "disabled", "lost", "unresponsive", "not_selected")


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
    summary_helper: Any = None
    last_helper_error: Any = None
    node_id: str | None = None

    @property
    def active(self) -> bool:
        """Whether RPCs still go to this rank."""
        return self.selected and self.state == "ok"

    def to_dict(self) -> RankEntry:
        return {
            "trainer_id": self.trainer_id,
            "rank": self.rank,
            "state": self.state if self.selected else "not_selected",
            "reason": self.reason,
            "device": self.device,
            "note": self.note,
            "windows_captured": self.windows_captured,
            "last_trace_path": self.last_trace_path,
            "summary_helper": self.summary_helper,
            "last_helper_error": self.last_helper_error,
            "node_id": self.node_id,
        }


@dataclass
class TrainerRecord:
    trainer_id: str
    role: str
    ranks: list[int]
    handles: dict[int, Any]
    run_dir: str | None

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
    pending: set[tuple[str, int]] = field(default_factory=set)
    # Where each rank's trace is once the node agent has finished it: {"path", "error"}.
    # A rank whose trace was written but not yet finished is in ``traces_pending``.
    traces: dict[tuple[str, int], WindowTrace] = field(default_factory=dict)
    traces_pending: set[tuple[str, int]] = field(default_factory=set)
    threshold: float = 1.25  # straggler threshold
    unopened: str | None = None  # why a planned window never opened (the run stopped first)
    stopped_at: int | None = None  # the last step when stop() cut the window short
    cut: str | None = None  # why the window was cut short, when not by the trainer's stop()

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

    def to_dict(self) -> WindowEntry:
        captured = sorted(
            (t, r) for (t, r) in self.acked if (t, r) in self.participants and self.steps
        )
        plan = self.planned or self.window
        kept, why = self.promise()
        return {
            "index": self.window.index,
            "kind": self.window.kind,  # type: ignore[typeddict-item]
            "planned": [plan.first, plan.last],
            "steps": list(self.steps) if self.steps else None,
            "kept": kept,
            "reason": why,
            "partial": self.partial,
            "ranks": sorted({r for _, r in captured}),
            "trace_dir": next(iter(self.trace_dirs.values()), None),
            "trace_dirs": dict(self.trace_dirs),
            "summaries_pending": sorted(r for _, r in self.pending),
            "traces_pending": sorted(r for _, r in self.traces_pending),
            "trace_errors": {
                r: err for (_, r), t in sorted(self.traces.items()) if (err := t["error"])
            },
            "traces": {r: t for (_, r), t in sorted(self.traces.items())},
            "stragglers": sorted(
                {
                    r
                    for a in self.aggregates.values()
                    for r in a.stragglers(self.threshold)["flagged"]
                }
            ),
        }


class CoordinatorState:
    """Everything the coordinator knows; every method is synchronous and pure."""

    def __init__(
        self, max_windows: int, detail_windows: int = 8, straggler_threshold: float = 1.25
    ) -> None:
        self.detail_windows = detail_windows
        self.straggler_threshold = straggler_threshold
        self.trainers: dict[str, TrainerRecord] = {}
        self.stepping_trainer: str | None = None
        self.ranks: dict[tuple[str, int], RankRecord] = {}
        self.windows: collections.OrderedDict[int, WindowRecord] = collections.OrderedDict()
        self.max_windows = max_windows
        self.global_step: int | None = None
        self.counters: collections.Counter[str] = collections.Counter()

    # ----------------------------------------------------------- windows

    def open_window(
        self,
        window: Window,
        participants: list[tuple[str, int]],
        planned: Window | None = None,
    ) -> WindowRecord:
        rec = WindowRecord(
            window,
            planned=planned,
            participants=set(participants),
            threshold=self.straggler_threshold,
        )
        self.windows[window.index] = rec
        self.counters["windows_opened"] += 1
        return rec

    def never_opened(self, window: Window, reason: str) -> None:
        """A planned window the run ended before: listed with its reason, nothing recorded."""
        rec = WindowRecord(window, closed=True, unopened=reason)
        self.windows[window.index] = rec
        self.windows = collections.OrderedDict(sorted(self.windows.items()))
        self.counters["windows_never_opened"] += 1

    def current_window(self) -> WindowRecord | None:
        for rec in reversed(self.windows.values()):
            if not rec.closed:
                return rec
        return None

    def closed_windows(self) -> list[WindowRecord]:
        return [w for w in self.windows.values() if w.closed]

    def close_window(self, rec: WindowRecord) -> None:
        """Mark ``rec`` closed (its closing command was answered) and bound the history."""
        if rec.closed:
            return
        rec.closed = True
        self.counters["windows_closed"] += 1
        closed = self.closed_windows()
        for old in closed[: max(0, len(closed) - self.detail_windows)]:
            for agg in old.aggregates.values():
                agg.drop_detail()
        while len(self.closed_windows()) > self.max_windows:
            oldest = next(i for i, w in self.windows.items() if w.closed)
            del self.windows[oldest]
            self.counters["windows_evicted"] += 1

    # ----------------------------------------------------------- replies

    def apply_reply(self, key: tuple[str, int], reply: Any) -> None:
        """Fold one worker reply into the state. Never raises on a bad reply."""
        rec = self.ranks[key]
        if not isinstance(reply, dict) or "state" not in reply:
            self.rank_failed(key, "disabled", f"malformed reply from the worker: {reply!r:.200}")
            return
        state = reply.get("state")
        if state == "disabled" and rec.state == "ok":
            rec.state, rec.reason = "disabled", reply.get("reason")
            self.counters["ranks_disabled"] += 1
        elif state == "not_configured" and rec.state == "ok":
            rec.state = "disabled"
            rec.reason = {
                "where": "coordinator",
                "type": "NotConfigured",
                "message": "the worker lost its profiler configuration (restarted?)",
            }
            self.counters["ranks_disabled"] += 1
        rec.device = reply.get("device", rec.device)
        if isinstance(reply.get("node_id"), str):
            rec.node_id = reply["node_id"]
        rec.note = reply.get("note", rec.note)
        if isinstance(reply.get("windows_captured"), int):
            rec.windows_captured = reply["windows_captured"]
        if reply.get("last_trace_path"):
            rec.last_trace_path = reply["last_trace_path"]
        if isinstance(reply.get("summary_helper"), dict):
            rec.summary_helper = reply["summary_helper"]
        if isinstance(reply.get("last_helper_error"), dict):
            rec.last_helper_error = reply["last_helper_error"]
        closed = reply.get("closed")
        if isinstance(closed, dict):
            self._apply_closed(key, closed)
        for blob in reply.get("summaries") or []:
            self.ingest_summary(key, blob)
        for failure in reply.get("summary_failures") or []:
            if isinstance(failure, dict):
                self.summary_failed(key, failure.get("window"), failure)
        pending = set(reply.get("summary_pending") or [])
        for w in self.windows.values():
            if key in w.pending and w.window.index not in pending:
                w.pending.discard(key)

    def _apply_closed(self, key: tuple[str, int], closed: dict[str, Any]) -> None:
        index = closed.get("window")
        w = self.windows.get(index) if isinstance(index, int) else None
        if w is None:
            return
        w.acked.add(key)
        steps = closed.get("steps")
        if steps:
            steps = (int(steps[0]), int(steps[1]))
            if w.steps is None:
                w.steps = steps
            elif w.steps != steps:
                self.counters["step_mismatches"] += 1
            path = closed.get("trace_path")
            if path:
                w.trace_dirs.setdefault(key[0], os.path.dirname(path))
                if key not in w.traces:  # (the agent can report it before the closing reply)
                    w.traces_pending.add(key)
        w.partial = w.partial or bool(closed.get("partial"))
        if closed.get("summary_pending") and not w.has_summary(key):
            w.pending.add(key)  # (a pushed summary can arrive before the closing reply)

    def ingest_summary(self, key: tuple[str, int], blob: Any) -> None:
        """Decode strictly; a bad summary marks that rank's window bad and nothing else."""
        trainer_id, rank = key
        try:
            s = decode_summary(blob)
        except SummaryDecodeError as exc:
            self.counters["bad_summaries"] += 1
            for w in reversed(self.windows.values()):
                if key in w.participants:
                    w.aggregate(trainer_id).mark_bad(rank, str(exc))
                    w.pending.discard(key)
                    break
            return
        found = self.windows.get(s.window)
        if found is None or key not in found.participants or s.rank != rank:
            self.counters["unexpected_summaries"] += 1
            return
        if found.aggregate(trainer_id).add(s):
            self.counters["summaries"] += 1
        else:
            self.counters["duplicate_summaries"] += 1
        found.pending.discard(key)

    def trace_stored(
        self,
        key: tuple[str, int],
        window: Any,
        path: str | None,
        error: dict[str, str] | None,
        local_path: str | None = None,
        node: str | None = None,
    ) -> bool:
        """The node agent finished a rank's trace of ``window``: where it is, or why not.

        False (and nothing changes) for a window or rank this run does not know.
        """
        w = self.windows.get(window) if isinstance(window, int) else None
        if w is None or key not in w.participants:
            self.counters["unexpected_trace_reports"] += 1
            return False
        w.traces[key] = WindowTrace(path=path, local_path=local_path, node=node, error=error)
        w.traces_pending.discard(key)
        if error:
            self.counters["trace_failures"] += 1
            self.ranks[key].last_helper_error = {"window": window, **error, "trace_path": path}
        return True

    def summary_failed(self, key: tuple[str, int], window: Any, reason: Any) -> bool:
        """A rank's summary for ``window`` is lost (its helper failed): mark it bad, stop waiting.

        False (and nothing changes) for a window or rank this run does not know.
        """
        w = self.windows.get(window) if isinstance(window, int) else None
        if w is None or key not in w.participants:
            self.counters["unexpected_summaries"] += 1
            return False
        if isinstance(reason, dict):
            message = f"{reason.get('where')}: {reason.get('type')}: {reason.get('message')}"
            self.ranks[key].last_helper_error = {str(k): v for k, v in reason.items()}
        else:
            message = str(reason)
        if not w.has_summary(key):
            self.counters["lost_summaries"] += 1
        w.aggregate(key[0]).mark_bad(key[1], message[:2000])
        w.pending.discard(key)
        if isinstance(reason, dict) and reason.get("where") == "helper":
            # The helper died: nobody will finish this trace; it stays where the rank wrote it.
            w.traces_pending.discard(key)
            path = reason.get("trace_path")
            w.traces.setdefault(
                key,
                WindowTrace(
                    path=path,
                    local_path=path,
                    node=self.ranks[key].node_id,
                    error={"where": "helper", "message": message[:1000]},
                ),
            )
        return True

    def rank_failed(self, key: tuple[str, int], state: RankState, reason: Any) -> None:
        rec = self.ranks[key]
        if rec.state == "ok":
            rec.state, rec.reason = state, reason
            self.counters[f"ranks_{state}"] += 1
        for w in self.windows.values():
            w.pending.discard(key)

    # ----------------------------------------------------------- queries

    def kernel_summary(
        self, window: int | None, top_k: int, trainer_id: str | None, per_rank: bool = False
    ) -> KernelSummary:
        tid = trainer_id or self.stepping_trainer
        if window is None:
            closed = self.closed_windows()
            if not closed:
                return empty_summary()
            rec = closed[-1]
        else:
            found = self.windows.get(window)
            if found is None:
                known = [w.window.index for w in self.closed_windows()]
                raise ValueError(
                    f"no window {window}: the closed windows kept are {known} "
                    f"(history holds the last {self.max_windows})"
                )
            rec = found
        agg = rec.aggregates.get(tid) if tid else None
        if agg is not None:
            out = agg.to_dict(top_k, self.straggler_threshold, per_rank)
        else:
            out = empty_summary()
            out["window"] = rec.window.index
        out["steps"] = list(rec.steps) if rec.steps else out["steps"]
        out["partial"] = rec.partial
        out["closed"] = rec.closed
        out["trainer_id"] = tid
        out["pending_ranks"] = sorted(r for t, r in rec.pending if t == tid)
        return out
