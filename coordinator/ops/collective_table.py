"""``ray-profiler collectives`` (and ``summarise --collectives``): a window's collectives matched
across its ranks as text (docs/collectives.md). Pure.

Bounded for a run of a thousand ranks: at most ``RANK_ROWS`` ranks (those that arrived last
most, then the clocks set by an offset) and ``COLLECTIVE_ROWS`` collectives (the largest skews),
each cut said; ``--json`` lists every one the reply holds. Texts that may come from a record
(group names, problems) are printed through ``printable``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from coordinator.core.printable import printable
from coordinator.core.stacks import ranges
from coordinator.protocol.collective_replies import MatchedCollective, RankCollectives

RANK_ROWS = 32
COLLECTIVE_ROWS = 20
PROBLEM_ROWS = 40


def _ms(us: float | None, digits: int = 1) -> str:
    return "-" if us is None else f"{us / 1e3:,.{digits}f}"


def render_collectives(reply: Mapping[str, Any]) -> str:
    """A ``collectives()`` reply (``WindowCollectivesReply``; an offline one has the same
    keys) as lines: the header, a row per rank, the collectives with the largest skew, then
    every problem."""
    lines = [_header(reply)]
    last = reply.get("last_arriver")
    if isinstance(last, Mapping) and last.get("reason"):
        lines.append(f"last arriver: rank {last.get('rank')}: {printable(str(last['reason']))}")
    ranks: list[RankCollectives] = list(reply.get("ranks") or [])
    if ranks:
        lines += ["", *_rank_rows(ranks, _steps_of(reply))]
    matched: list[MatchedCollective] = list(reply.get("collectives") or [])
    if matched:
        lines += ["", *_collective_rows(matched)]
    problems = [printable(str(p)) for p in reply.get("problems") or []]
    if problems:
        lines += ["", f"problems ({len(problems)}):"]
        lines += [f"  {p}" for p in problems[:PROBLEM_ROWS]]
        if len(problems) > PROBLEM_ROWS:
            lines.append(f"  ... {len(problems) - PROBLEM_ROWS} more (--json lists every one)")
    return "\n".join(lines)


def _steps_of(reply: Mapping[str, Any]) -> int:
    steps = reply.get("steps")
    return len(steps) if isinstance(steps, list) and steps else 0


def _header(reply: Mapping[str, Any]) -> str:
    """What window, whose ranks, how much was matched."""
    window, steps = reply.get("window"), reply.get("steps")
    if window is None:
        return "collectives: no window has closed yet (or the run keeps none)"
    span = f"steps {steps[0]}-{steps[-1]}" if isinstance(steps, list) and steps else "no steps"
    who = reply.get("role") or reply.get("trainer_id")
    without = reply.get("ranks_without") or []
    parts = [
        f"collectives of window {window} ({span}) of run {printable(str(reply.get('run')))}",
        f"role {printable(str(who))}" if who else None,
        f"{reply.get('ranks_recorded', len(reply.get('ranks') or []))} ranks recorded",
        f"ranks {ranges(without)} without a collective" if without else None,
        f"{reply.get('matched', 0)} matched, {reply.get('shown', 0)} listed",
    ]
    return "; ".join(p for p in parts if p)


def _rank_rows(ranks: Sequence[RankCollectives], steps: int) -> list[str]:
    """A row a rank, in rank order: when there are more than ``RANK_ROWS``, those that made
    the others wait most (then arrived last most, then clocks set)."""
    kept = ranks
    if len(ranks) > RANK_ROWS:
        kept = sorted(ranks, key=_weight)[:RANK_ROWS]
        kept = sorted(kept, key=lambda p: p["rank"])
    head = (
        f"{'rank':>6} {'colls':>6} {'last':>5} {'made wait ms':>13} {'wait ms':>10} "
        f"{'ms/step':>9} {'of step':>8} "
        f"{'clock offset ms':>22} {'set':>4} {'cut':>5}"
    )
    out = [head]
    for p in kept:
        per_step = p["wait_us"] / steps if steps else None
        spread = p["clock_spread_us"]
        clock = _ms(p["clock_offset_us"], 3) + (
            f" ± {_ms(spread, 3)}" if spread is not None else " (none)"
        )
        if p["clock_reference"] != p["rank"] and p["clock_reference"] != 0:
            clock += f" vs {p['clock_reference']}"
        out.append(
            f"{p['rank']:>6} {p['collectives']:>6} {p['arrived_last']:>5} "
            f"{_ms(p['made_wait_us']):>13} {_ms(p['wait_us']):>10} {_ms(per_step):>9} "
            f"{_share(p.get('wait_share')):>8} {clock:>22} "
            f"{'yes' if p['clock_corrected'] else 'no':>4} {p['cut']:>5}"
        )
    if len(kept) < len(ranks):
        out.append(
            f"  ... {len(ranks) - len(kept)} more ranks left out (those shown made the others "
            "wait most; --json lists every one)"
        )
    return out


def _weight(p: RankCollectives) -> tuple[float, int, bool, int]:
    return (-p["made_wait_us"], -p["arrived_last"], not p["clock_corrected"], p["rank"])


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _collective_rows(matched: Sequence[MatchedCollective]) -> list[str]:
    """The ``COLLECTIVE_ROWS`` collectives with the largest skew, largest first."""
    top = sorted(matched, key=lambda m: -m["skew_us"])[:COLLECTIVE_ROWS]
    out = [
        f"largest skews ({len(top)} of {len(matched)} listed):",
        f"{'group':>8} {'step':>6} {'seq':>5} {'kind':<14} {'ranks':<12} {'last':>5} "
        f"{'skew ms':>9} {'transfer ms':>11} {'bytes':>13} {'busbw GB/s':>10}",
    ]
    for m in top:
        group = printable(m["group"])[:8]
        step = "-" if m["step"] is None else str(m["step"])
        who = ranges(m["ranks"], shown=3)
        who = who if len(who) <= 12 else f"{len(m['ranks'])} ranks"
        busbw = "-" if m["busbw_gbps"] is None else f"{m['busbw_gbps']:.2f}"
        out.append(
            f"{group:>8} {step:>6} {m['seq']:>5} {m['name']:<14} {who:<12} {m['last_rank']:>5} "
            f"{_ms(m['skew_us'], 2):>9} {_ms(m['transfer_us'], 3):>11} {m['bytes']:>13,} "
            f"{busbw:>10}"
        )
    return out
