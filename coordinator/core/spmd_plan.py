"""Captures for SPMD ranks, on both sides: where the coordinator plans one, and how a rank takes
it into its own copy of the plan. Pure.

SPMD ranks run ahead of the coordinator's plan (rank 0 reports at most every 0.1 s, and the
other ranks may be a step or two ahead of it) and learn of a capture only when they next look
at their node's board (``coordinator.protocol.plan_board``). So the coordinator plans a capture
at a step no rank can have reached by then (``earliest_step``), and numbers it by its steps
(``WindowPlan.index_for``): the scheduled windows that open before it keep their numbers on a
rank that opened them before it learnt of the capture. A rank takes each capture it has not
seen (``take_captures``): into its plan when its warm-up is still ahead, else as ``late`` (its
index left as a gap, so the windows after it keep the run's numbers).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from coordinator.core.schedule import Window
from coordinator.core.state import CoordinatorState
from coordinator.core.window_plan import WindowPlan

Key = tuple[str, int]

LEAD_S = 2.0
"""How far ahead of the ranks a capture for SPMD ranks is planned, in time: the board's way to
every rank (the coordinator's calls to the node agents, a rank's next look) fits well inside."""
SPREAD_STEPS = 4
"""Steps an SPMD rank may run ahead of rank 0's report (ranks a step or two apart, and the
step rank 0 is running), added to ``LEAD_S``."""
UNKNOWN_STEP_S = 0.001
"""The step time assumed before rank 0 has reported two steps (a short step: a long lead)."""
MAX_SINCE_REPORT_S = 1.0


def earliest_step(
    next_boundary: int, step_s: float | None, since_report_s: float | None, lead_s: float = LEAD_S
) -> int:
    """The first step at which a capture's warm-up may begin for SPMD ranks: past where any rank
    can be once the plan has reached it.

    Args:
        next_boundary: the first step rank 0 has not reported.
        step_s: the median step time from rank 0's reports, if known.
        since_report_s: seconds since rank 0's last report (it may have run steps since).
        lead_s: how long the plan may take to reach every rank.

    >>> earliest_step(100, 0.5, 0.2)
    109
    >>> earliest_step(100, 0.01, 0.05)
    309
    """
    pace = step_s if step_s is not None and step_s > 0 else UNKNOWN_STEP_S
    since = min(max(since_report_s or 0.0, 0.0), MAX_SINCE_REPORT_S)
    return next_boundary + SPREAD_STEPS + math.ceil((since + lead_s) / pace)


MAX_KEPT = 64
"""Captures for SPMD ranks a run keeps on its boards after they opened (the latest)."""


@dataclass
class PlannedCapture:
    """A capture planned for SPMD ranks, as the coordinator keeps it for the boards: its window,
    its ranks, and those that will not record it (with why). It stays on the boards after it
    opens (the latest ``MAX_KEPT``), so a rank that hears of it only then still keeps its
    number free."""

    window: Window
    keys: list[Key]
    missed: dict[Key, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Capture:
    """A capture as a board carries it: its window, its ranks (None: every selected rank), and
    whether the coordinator's plan has opened it already."""

    window: Window
    ranks: tuple[int, ...] | None
    opened: bool = False


@dataclass
class Taken:
    """What a rank did with a board: the captures it holds, those it read too late, and why it
    cannot follow the plan any more (its windows could no longer carry the run's numbers)."""

    held: list[int] = field(default_factory=list)
    late: list[int] = field(default_factory=list)
    off: str | None = None


def take_captures(
    plan: WindowPlan,
    captures: Iterable[Capture],
    rank: int,
    next_step: int | None,
    seen: set[int],
    not_mine: set[int],
) -> Taken:
    """Take a board's captures into a rank's ``plan``.

    Args:
        plan: the rank's own plan.
        captures: the board's captures.
        rank: this rank.
        next_step: the first step whose window the plan has not yet decided: a capture whose
            warm-up begins there or later is taken; None (before the loop starts) takes every
            capture not yet opened (the plan's start moves them as the coordinator's did), and
            leaves the opened ones to ``rank_start``'s numbering.
        seen: the captures this rank took already (updated).
        not_mine: the captures this rank holds but does not record (updated).
    """
    taken = Taken()
    for cap in sorted(captures, key=lambda c: c.window.warmup_start):
        w = cap.window
        opened = plan.current is not None and plan.current.index == w.index
        if w.index in seen:
            if w.index in plan.gaps:
                taken.late.append(w.index)
                continue
            if not opened:  # (its ranks may have changed: a rank named late is left out)
                _mine(cap, rank, not_mine)
            taken.held.append(w.index)
            continue
        seen.add(w.index)
        if next_step is None and cap.opened:  # (the run's numbering from rank_start has it)
            taken.held.append(w.index)
            continue
        if next_step is None or w.warmup_start >= next_step:
            plan.add_capture(w)
            _mine(cap, rank, not_mine)
            taken.held.append(w.index)
            continue
        if plan.next_index > w.index:  # a window here already took its number
            taken.off = (
                f"capture {w.index} (steps {w.first}-{w.last}) reached rank {rank} at step "
                f"{next_step}, after it had numbered later windows: its windows can no longer "
                "be matched with the run's"
            )
            return taken
        plan.gaps.add(w.index)
        taken.late.append(w.index)
    return taken


def _mine(cap: Capture, rank: int, not_mine: set[int]) -> None:
    if cap.ranks is None or rank in cap.ranks:
        not_mine.discard(cap.window.index)
    else:
        not_mine.add(cap.window.index)


def apply_misses(st: CoordinatorState, index: int, misses: dict[Key, str]) -> None:
    """Window ``index`` of a run's state is partial for each missed rank, with its reason."""
    w = st.windows.get(index)
    if w is None:
        return
    for key, why in misses.items():
        if key in st.ranks:
            w.participants.add(key)
            st.summary_failed(key, index, why)
            w.partial = True
