"""The coordinator's bookkeeping: trainers, rank states, windows, counters. Pure: no Ray, no I/O.

The actor feeds it every worker reply (``apply_reply``) and failure (``rank_failed``); it decodes
summaries strictly, folds them into per-window aggregates and keeps history bounded.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable
from typing import Any, cast

from coordinator.core.aggregate import WindowAggregate, empty_summary
from coordinator.core.records import RankRecord, TrainerRecord, WindowRecord, optimizer_steps_of
from coordinator.core.roles import trainer_of_role
from coordinator.core.schedule import Window
from coordinator.core.steps import Steps
from coordinator.core.validate import is_int
from coordinator.protocol.partial_codec import decode_partial
from coordinator.protocol.replies import (
    AgentError,
    KernelSummaryReply,
    RankState,
    Reason,
    WindowTrace,
)
from coordinator.protocol.summary_codec import SummaryDecodeError, decode_summary


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
        self.ranks_version = 0  # moves whenever a rank's record may have changed (checkpoints)

    # ----------------------------------------------------------- trainers

    def register(
        self,
        trainer: TrainerRecord,
        advances_step: bool | None,
        selects: Callable[[int], bool],
    ) -> list[tuple[str, int]]:
        """Record ``trainer``, replacing an earlier registration of its id and its ranks' records.

        The first trainer, or one registered with ``advances_step=True``, advances the global
        step. Returns the keys of the ranks ``selects`` picks for profiling.
        """
        tid = trainer.trainer_id
        self.trainers[tid] = trainer
        if advances_step or self.stepping_trainer is None:
            self.stepping_trainer = tid
        for key in [k for k in self.ranks if k[0] == tid]:
            del self.ranks[key]
        keys = []
        for r in trainer.ranks:
            selected = selects(r)
            self.ranks[(tid, r)] = RankRecord(tid, r, selected)
            if selected:
                keys.append((tid, r))
        self.counters["registrations"] += 1
        self.ranks_version += 1
        return keys

    # ----------------------------------------------------------- windows

    def open_window(
        self,
        window: Window,
        participants: list[tuple[str, int]],
        planned: Window | None = None,
    ) -> WindowRecord:
        roles = {t.trainer_id: t.role for t in self.trainers.values()}
        rec = WindowRecord(window, planned, set(participants), threshold=self.straggler_threshold)
        rec.roles, rec.primary, rec.opened_at = roles, self.stepping_trainer, time.time()
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
        rec.closed, rec.closed_at = True, time.time()
        self.counters["windows_closed"] += 1
        _expect_spmd_closes(self, rec)
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
        self.ranks_version += 1
        if not isinstance(reply, dict) or "state" not in reply:
            message = f"malformed reply from the worker: {reply!r:.200}"
            self.rank_failed(
                key,
                "disabled",
                {"where": "coordinator", "type": "MalformedReply", "message": message},
            )
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
        if isinstance(reply.get("pid"), int):
            rec.pid = reply["pid"]
        if isinstance(reply.get("stack_dump"), dict):
            rec.stack_dump = reply["stack_dump"]
        rec.note = reply.get("note", rec.note)
        if isinstance(reply.get("windows_captured"), int):
            rec.windows_captured = reply["windows_captured"]
        if reply.get("last_trace_path"):
            rec.last_trace_path = reply["last_trace_path"]
        if isinstance(reply.get("agent"), dict):
            rec.agent = reply["agent"]
        if isinstance(reply.get("last_agent_error"), dict):
            rec.last_agent_error = reply["last_agent_error"]
        pending = set(p) if isinstance(p := reply.get("summaries_pending"), list) else set()
        closed = reply.get("closed")
        if isinstance(closed, dict):
            self._apply_closed(key, closed, pending)
        for blob in reply.get("summaries") or []:
            self.ingest_summary(key, blob)
        for failure in reply.get("summary_failures") or []:
            if isinstance(failure, dict):
                self.summary_failed(key, failure.get("window"), failure)
        for w in _awaiting_summaries(self):  # (not every window kept: O(ranks x windows))
            if key in w.summaries_pending and w.window.index not in pending:
                w.summaries_pending.discard(key)

    def _apply_closed(
        self, key: tuple[str, int], closed: dict[str, Any], pending: set[Any]
    ) -> None:
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
        _note_optimizer_steps(w, key, closed.get("optimizer_steps"))
        if index in pending and not w.has_summary(key):  # (a push can come before the close)
            w.summaries_pending.add(key)
            _awaiting_summaries(self, index)

    def ingest_summary(self, key: tuple[str, int], blob: Any) -> int | None:
        """Decode strictly; a bad summary marks that rank's window bad and nothing else.
        Returns the window's index when the summary was folded in."""
        trainer_id, rank = key
        try:
            s = decode_summary(blob)
        except SummaryDecodeError as exc:
            self.counters["bad_summaries"] += 1
            for w in reversed(self.windows.values()):
                if key in w.participants:
                    w.aggregate(trainer_id).mark_bad(rank, str(exc))
                    w.summaries_pending.discard(key)
                    break
            return None
        found = self.windows.get(s.window)
        if found is None or key not in found.participants or s.rank != rank:
            self.counters["unexpected_summaries"] += 1
            return None
        added = found.aggregate(trainer_id).add(s)
        self.counters["summaries" if added else "duplicate_summaries"] += 1
        found.summaries_pending.discard(key)
        return s.window if added else None

    def ingest_partial_steps(self, trainer_id: str, blob: Any) -> Steps[tuple[bool, int | None]]:
        """Decode a node partial strictly and fold it into its window, in steps (``core.steps``).
        Returns (accepted, the window folded into). Accepted and no window: nobody wants it
        (its window is not kept). Not accepted: refused whole (it is malformed, names a rank
        that is not in the window, or repeats one already in); the agent then lets each rank
        send its own summary, judged by itself.
        """
        try:
            p = decode_partial(blob)
        except SummaryDecodeError:
            self.counters["bad_partials"] += 1
            return False, None
        w = self.windows.get(p.window)
        if w is None:
            self.counters["unexpected_summaries"] += len(p.ranks)
            return True, None
        keys = [(trainer_id, part.rank) for part in p.ranks]
        if any(k not in w.participants for k in keys):
            self.counters["unexpected_partials"] += 1
            return False, None
        yield  # (the decode and the checks: a step)
        if (yield from w.aggregate(trainer_id).add_partial_steps(p)) is None:
            self.counters["duplicate_partials"] += 1
            return False, None
        self.counters["partials"] += 1
        self.counters["summaries"] += len(keys)
        w.summaries_pending.difference_update(keys)
        return True, p.window

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
        w.changes = getattr(w, "changes", 0) + 1
        self.ranks_version += bool(error)
        w.traces_pending.discard(key)
        if error:
            self.counters["trace_failures"] += 1
            # (an agent's report, bounded to a few short strings by the caller)
            err = {"window": window, **error, "trace_path": path}
            self.ranks[key].last_agent_error = cast(AgentError, err)
        return True

    def summary_failed(self, key: tuple[str, int], window: Any, reason: Any) -> bool:
        """A rank's summary for ``window`` is lost (its agent failed): mark it bad, stop waiting.

        False (and nothing changes) for a window or rank this run does not know.
        """
        w = self.windows.get(window) if isinstance(window, int) else None
        if w is None or key not in w.participants:
            self.counters["unexpected_summaries"] += 1
            return False
        self.ranks_version += 1
        if isinstance(reason, dict):
            message = f"{reason.get('where')}: {reason.get('type')}: {reason.get('message')}"
            err = {str(k): v for k, v in reason.items()}
            self.ranks[key].last_agent_error = cast(AgentError, err)
        else:
            message = str(reason)
        if not w.has_summary(key):
            self.counters["lost_summaries"] += 1
        w.aggregate(key[0]).mark_bad(key[1], message[:2000])
        w.changes = getattr(w, "changes", 0) + 1
        w.summaries_pending.discard(key)
        if isinstance(reason, dict) and reason.get("where") == "agent":
            # The agent died: nobody will finish this trace; it stays where the rank wrote it.
            w.traces_pending.discard(key)
            path = reason.get("trace_path")
            w.traces.setdefault(
                key,
                WindowTrace(
                    path=path,
                    local_path=path,
                    node=self.ranks[key].node_id,
                    error={"where": "agent", "message": message[:1000]},
                ),
            )
        return True

    def rank_failed(self, key: tuple[str, int], state: RankState, reason: Reason) -> None:
        """Rank ``key`` stopped taking part (``state`` says how, ``reason`` why); the first
        reason stays, and no window waits for the rank any more."""
        rec = self.ranks[key]
        self.ranks_version += 1
        if rec.state == "ok":
            rec.state, rec.reason = state, reason
            self.counters[f"ranks_{state}"] += 1
        for w in self.windows.values():
            w.summaries_pending.discard(key)


def rank_counts(st: CoordinatorState) -> dict[str, int]:
    """How many ranks are in each state ``status()`` shows (``RankRecord.public_state``); kept
    until a rank's record may have changed (``ranks_version``): every step report and
    ``status()`` ask, and at 10,000 ranks counting takes milliseconds of the event loop."""
    key = (st.ranks_version, len(st.ranks))
    kept = st.__dict__.get("_rank_counts")
    if kept is None or kept[0] != key:
        counts = collections.Counter(r.public_state for r in st.ranks.values())
        kept = st.__dict__["_rank_counts"] = (key, dict(counts))
    return dict(kept[1])


def _expect_spmd_closes(st: CoordinatorState, rec: WindowRecord) -> None:
    """A closed window waits for the summaries of its SPMD ranks, which close by themselves and
    say so later (``rank_status``); that status, the summary, or ``summary_failed`` (late)
    ends each wait."""
    spmd = {t.trainer_id for t in st.trainers.values() if t.spmd}
    late = [k for k in rec.participants - rec.acked if k[0] in spmd and not rec.has_summary(k)]
    if late:
        rec.summaries_pending.update(late)
        _awaiting_summaries(st, rec.window.index)


def _awaiting_summaries(st: CoordinatorState, add: int | None = None) -> list[WindowRecord]:
    """The windows that may still wait for a rank's summary (their indices are kept in the
    state's ``_awaiting``, pruned here); ``add`` records one more."""
    idx: set[int] | None = st.__dict__.get("_awaiting")
    if idx is None:  # (a checkpoint from before)
        idx = st.__dict__["_awaiting"] = {i for i, w in st.windows.items() if w.summaries_pending}
    if add is not None:
        idx.add(add)
        return []
    out = []
    for i in list(idx):
        w = st.windows.get(i)
        if w is None or not w.summaries_pending:
            idx.discard(i)
        else:
            out.append(w)
    return out


def kernel_summary(
    st: CoordinatorState,
    window: int | None,
    top_k: int,
    trainer_id: str | None,
    per_rank: bool = False,
    by: str = "kernel",
) -> KernelSummaryReply:
    """The cross-rank table of ``window`` (the last closed one when None) for a trainer."""
    tid = trainer_id or st.stepping_trainer
    rec = pick_window(st, window)
    if rec is None:
        return empty_summary()
    agg = rec.aggregates.get(tid) if tid else None
    table = agg.to_dict(top_k, st.straggler_threshold, per_rank, by) if agg is not None else None
    out = with_window(table, rec, tid)
    out["by"] = by
    return out


def trainer_window(
    st: CoordinatorState, window: int | None, trainer_id: str | None, role: str | None
) -> tuple[str | None, WindowRecord | None, WindowAggregate | None]:
    """The trainer a read names (``role``'s, else ``trainer_id``, else the stepping one), the
    window (``pick_window``) and that trainer's aggregate of it (None: none yet)."""
    if role is not None:
        roles = {t.trainer_id: t.role for t in st.trainers.values()}
        trainer_id = trainer_of_role(roles, role, trainer_id)
    tid = trainer_id or st.stepping_trainer
    rec = pick_window(st, window)
    return tid, rec, rec.aggregates.get(tid) if rec is not None and tid else None


def pick_window(st: CoordinatorState, window: int | None) -> WindowRecord | None:
    """Window ``window``, or the last closed one (None before any closed); ValueError for a
    window that is not kept."""
    if window is None:
        closed = st.closed_windows()
        return closed[-1] if closed else None
    found = st.windows.get(window)
    if found is None:
        known = [w.window.index for w in st.closed_windows()]
        raise ValueError(
            f"no window {window}: the closed windows kept are {known} "
            f"(history holds the last {st.max_windows})"
        )
    return found


def with_window(
    table: KernelSummaryReply | None, rec: WindowRecord, tid: str | None
) -> KernelSummaryReply:
    """``table`` (a trainer's aggregate of ``rec``, or None) with what the window adds."""
    out = table if table is not None else empty_summary()
    out["window"] = rec.window.index
    out["steps"] = list(rec.steps) if rec.steps else out["steps"]
    out["partial"] = rec.partial
    out["closed"] = rec.closed
    out["trainer_id"] = tid
    out["role"] = getattr(rec, "roles", {}).get(tid or "") if tid else None
    out["summaries_pending"] = sorted(r for t, r in rec.summaries_pending if t == tid)
    if opt := optimizer_steps_of(rec, tid):
        out["optimizer_steps"] = opt["optimizer_steps"]
    return out


def _note_optimizer_steps(w: WindowRecord, key: tuple[str, int], steps: Any) -> None:
    """A rank's optimizer steps of the window (``ClosedWindow.optimizer_steps``): the first
    rank to say them, rank 0 over any other; anything but two ordered step numbers ignored."""
    if not (isinstance(steps, list) and len(steps) == 2 and all(is_int(s) for s in steps)):
        return
    first, last = steps
    if not 0 <= first <= last < 2**62:
        return
    kept = w.__dict__.setdefault("optimizer_steps", {})  # (a checkpoint from before: none)
    if key[0] not in kept or key[1] == 0:
        kept[key[0]] = (first, last)
        w.changes += 1
