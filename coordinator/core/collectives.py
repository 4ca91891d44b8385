"""Who makes the others wait: a window's collectives matched across each group's ranks (pure).

Each rank's summary carries its collectives (``RankCollective``: group, sequence, kind, bytes,
arrival, work, end). A collective is keyed by (group, sequence): ``Seq`` where the trace has it,
else its order within the group, as TraceLens's ``NcclAnalyser`` keys them. For each one matched
on two or more of its group's ranks:

- ``last_rank``: the rank that arrived last; ``skew_us``: the latest arrival minus the earliest;
  ``wait_us[r]``: the latest arrival minus rank r's (what r spent waiting for the others);
- ``transfer_us``: the shortest duration of its work across the ranks (torch-tb-profiler's and
  TraceLens's reading: the rank that waited least was moving data all along);
- ``algbw_gbps`` = bytes / transfer time and ``busbw_gbps`` = algbw x nccl-tests' factor:
  2(n-1)/n for all_reduce; (n-1)/n for all_gather, reduce_scatter, all_to_all, gather, scatter;
  1 for broadcast, reduce, send and recv.

Clocks: every rank leaves a blocking collective at nearly the same instant, so a rank's clock
offset against the reference rank (the lowest) is the median difference of their ends over the
window's blocking collectives, with its spread (the median absolute deviation). Groups that share
no rank with the reference are reached through a rank they share with a group that does. A rank
on another node is always set by its offset; one on the reference's node (or of an unknown node)
only when the offset is over ``max(3 x spread, SAME_CLOCK_US)``: one host has one clock, and
below that the estimate is the ends' own jitter.

Nothing is dropped in silence: ranks whose counts disagree are matched as far as they agree and
the rest is a line in ``problems``, as is each entry that is not a collective's (an end before
its arrival), a group naming ranks the window did not record, and a group recorded by one rank.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence

from coordinator.protocol.collective_replies import (
    CollectivesReply,
    MatchedCollective,
    RankCollective,
    RankCollectives,
)

# Kinds after which every rank of the group has what the others sent: their ends line up.
BLOCKING = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier"})
# Within one host the ranks share a clock: an offset below this is the ends' jitter, not a clock.
SAME_CLOCK_US = 1_000.0
# A collective whose arrivals spread less than this has no rank that made the others wait (the
# trace's own timing noise on a CPU rank is of this order).
SKEW_FLOOR_US = 10.0
# The most matched collectives a reply lists (the largest skews kept); every one is counted.
SHOWN = 500

# Names as torch writes them (NCCL's "Collective name", gloo's op and thread names, c10d's ops),
# lowercased with "_" removed; the longest match wins, so "reducescatter" is not "scatter".
_KINDS = (
    ("allreduce", "all_reduce"),
    ("reducescatter", "reduce_scatter"),
    ("allgather", "all_gather"),
    ("alltoall", "all_to_all"),
    ("broadcast", "broadcast"),
    ("barrier", "barrier"),
    ("gather", "gather"),
    ("scatter", "scatter"),
    ("reduce", "reduce"),
    ("send", "send"),
    ("recv", "recv"),
)


def kind_of(name: str) -> str | None:
    """The collective's kind for an op or kernel name (``c10d::allreduce_``,
    ``gloo:all_reduce``, ``_allgather_base``, ``ncclDevKernel_AllReduce_Sum_f32_RING_LL``,
    NCCL's "Collective name" ``allreduce``); None for a name that is no collective."""
    flat = name.lower().replace("_", "")
    for part, kind in _KINDS:
        if part in flat:
            return kind
    return None


def busbw_factor(kind: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor for ``kind`` over ``n`` ranks."""
    if n < 2:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    return 1.0


Keyed = dict[str, dict[int, dict[int, RankCollective]]]  # group -> seq -> rank -> collective


def index(per_rank: Mapping[int, Sequence[RankCollective]], problems: list[str]) -> Keyed:
    """The window's collectives by group, sequence and rank; an entry that cannot be a
    collective's (times not finite, work or end before arrival) and a sequence a rank recorded
    twice are left out, a line for each rank saying how many."""
    keyed: Keyed = {}
    for rank in sorted(per_rank):
        bad = twice = 0
        for c in per_rank[rank]:
            times = (c.arrive_us, c.work_us, c.end_us)
            if not all(math.isfinite(t) for t in times) or c.work_us < 0 or c.end_us < c.arrive_us:
                bad += 1
                continue
            at = keyed.setdefault(c.group, {}).setdefault(c.seq, {})
            if rank in at:
                twice += 1
                continue
            at[rank] = c
        if bad:
            problems.append(
                f"rank {rank}: {bad} collective(s) with times that cannot be a "
                "collective's (not finite, or ending before they start) left out"
            )
        if twice:
            problems.append(
                f"rank {rank}: {twice} collective(s) recorded twice with one "
                "sequence number: the first kept"
            )
    return keyed


def members(keyed: Keyed, window: Iterable[int], problems: list[str]) -> dict[str, list[int]]:
    """Each group's ranks in this window: those its traces name (``group_ranks``), else those
    that recorded it. Ranks a group names that the window did not record are said."""
    ranks, out = set(window), {}
    for group, seqs in sorted(keyed.items()):
        named = {r for at in seqs.values() for c in at.values() for r in c.group_ranks}
        seen = {r for at in seqs.values() for r in at}
        outside = sorted(named - ranks)
        if outside:
            problems.append(
                f"group {group}: ranks {_ranges(outside)} of the group were not "
                "recorded in this window; matched among the ranks that were"
            )
        out[group] = sorted((named & ranks) | seen)
    return out


def clock_offsets(
    keyed: Keyed, groups: Mapping[str, list[int]], problems: list[str]
) -> tuple[int | None, dict[int, tuple[float, float | None]]]:
    """The reference rank and each rank's (offset, spread), microseconds: its clock minus the
    reference's, from the ends of the blocking collectives it shares with a rank already set
    (module docstring). A rank no blocking collective links to the reference is (0.0, None),
    and said."""
    ranks = sorted({r for g in groups.values() for r in g})
    if not ranks:
        return None, {}
    ref, set_ = ranks[0], {ranks[0]: (0.0, 0.0)}
    grew = True
    while grew:  # (each pass sets at least one rank, or stops: at most len(ranks) passes)
        grew = False
        for group, seqs in sorted(keyed.items()):
            known = [r for r in groups[group] if r in set_]
            for r in groups[group]:
                if r in set_ or not known:
                    continue
                est = _offset(seqs, known[0], r)
                if est is not None:
                    set_[r] = (set_[known[0]][0] + est[0], est[1])
                    grew = True
    unlinked = [r for r in ranks if r not in set_]
    if unlinked:
        problems.append(
            f"ranks {_ranges(unlinked)}: no blocking collective links their clocks "
            f"to rank {ref}'s; their arrivals are read as recorded"
        )
    return ref, {r: set_.get(r, (0.0, None)) for r in ranks}


def _offset(
    seqs: Mapping[int, Mapping[int, RankCollective]], known: int, rank: int
) -> tuple[float, float] | None:
    """Rank ``rank``'s clock minus rank ``known``'s and its spread, from the ends of the
    blocking collectives both recorded; None when they share none."""
    diffs = [
        at[rank].end_us - at[known].end_us
        for at in seqs.values()
        if rank in at and known in at and at[rank].name in BLOCKING
    ]
    if not diffs:
        return None
    mid = statistics.median(diffs)
    return mid, statistics.median(abs(d - mid) for d in diffs)


def corrections(
    offsets: Mapping[int, tuple[float, float | None]],
    ref: int | None,
    nodes: Mapping[int, str] | None,
) -> dict[int, float]:
    """What to take off each rank's times: its offset, where the module docstring says so."""
    out = {}
    for r, (off, spread) in offsets.items():
        other_node = (
            nodes is not None and ref is not None and r in nodes and ref in nodes
            and nodes[r] != nodes[ref]
        )  # fmt: skip
        if spread is not None and (other_node or abs(off) > max(3 * spread, SAME_CLOCK_US)):
            out[r] = off
    return out


def match_one(
    group: str, seq: int, at: Mapping[int, RankCollective], size: int, shift: Mapping[int, float]
) -> MatchedCollective:
    """One collective recorded by two or more ranks of its group, matched (module docstring);
    ``shift``: what to take off each rank's times, ``size``: the group's size."""
    arrive = {r: c.arrive_us - shift.get(r, 0.0) for r, c in at.items()}
    latest = max(arrive.values())
    last = max(arrive, key=lambda r: (arrive[r], r))
    transfer = min(c.work_us for c in at.values())
    nbytes = max(c.nbytes for c in at.values())
    first = at[min(at)]
    algbw = nbytes / transfer / 1e3 if nbytes > 0 and transfer > 0 else None
    factor = busbw_factor(first.name, size)
    return {
        "group": group,
        "seq": seq,
        "name": first.name,
        "ranks": sorted(at),
        "missing": [],
        "step": first.step,
        "last_rank": last,
        "skew_us": latest - min(arrive.values()),
        "wait_us": {str(r): latest - a for r, a in sorted(arrive.items())},
        "transfer_us": transfer,
        "bytes": nbytes,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * factor if algbw is not None else None,
    }


def match_window(
    per_rank: Mapping[int, Sequence[RankCollective]],
    nodes: Mapping[int, str] | None = None,
    shown: int = SHOWN,
    skew_floor_us: float = SKEW_FLOOR_US,
) -> CollectivesReply:
    """A window's collectives matched across each group's ranks, and each rank's part;
    ``per_rank``: each recorded rank's collectives (a rank with none: an empty list), ``nodes``:
    each rank's node where known. What could not be matched is in ``problems``."""
    problems: list[str] = []
    keyed = index(per_rank, problems)
    groups = members(keyed, per_rank, problems)
    ref, offsets = clock_offsets(keyed, groups, problems)
    shift = corrections(offsets, ref, nodes)
    matched: list[MatchedCollective] = []
    for group, seqs in sorted(keyed.items()):
        matched += _match_group(group, seqs, groups[group], shift, problems)
    silent = sorted(r for r, cs in per_rank.items() if not cs)
    if silent and keyed:
        problems.append(f"ranks {_ranges(silent)}: no collective in their traces")
    ranks = _rank_parts(matched, per_rank, offsets, shift, skew_floor_us)
    kept = sorted(matched, key=lambda m: -m["skew_us"])[: max(0, shown)]
    kept.sort(key=lambda m: (m["group"], m["seq"]))
    return {
        "collectives": kept,
        "ranks": ranks,
        "reference_rank": ref,
        "matched": len(matched),
        "shown": len(kept),
        "problems": problems,
    }


def _match_group(
    group: str,
    seqs: Mapping[int, Mapping[int, RankCollective]],
    member: list[int],
    shift: Mapping[int, float],
    problems: list[str],
) -> list[MatchedCollective]:
    """A group's collectives matched as far as its ranks agree; the rest said."""
    if len({r for at in seqs.values() for r in at}) < 2:
        only = sorted({r for at in seqs.values() for r in at})
        problems.append(f"group {group}: only rank {_ranges(only)} recorded it; nothing to match")
        return []
    out, lacking, disagree = [], dict[int, list[int]](), []
    for seq, at in sorted(seqs.items()):
        for r in member:
            if r not in at:
                lacking.setdefault(r, []).append(seq)
        if len({c.name for c in at.values()}) > 1:
            disagree.append(seq)
        elif len(at) >= 2:
            m = match_one(group, seq, at, len(member), shift)
            m["missing"] = [r for r in member if r not in at]
            out.append(m)
    for r, seqs_ in sorted(lacking.items()):
        problems.append(
            f"group {group}: rank {r} lacks {len(seqs_)} of its {len(seqs)} "
            f"collectives ({_ranges(seqs_)}); the others matched without it"
        )
    if disagree:
        problems.append(
            f"group {group}: the ranks disagree on the kind of collectives "
            f"{_ranges(disagree)} (their orders differ); those are not matched"
        )
    return out


def _rank_parts(
    matched: Sequence[MatchedCollective],
    per_rank: Mapping[int, Sequence[RankCollective]],
    offsets: Mapping[int, tuple[float, float | None]],
    shift: Mapping[int, float],
    skew_floor_us: float,
) -> list[RankCollectives]:
    """Each recorded rank's waits, last arrivals and clock, from the matched collectives."""
    parts: dict[int, RankCollectives] = {
        r: {
            "rank": r,
            "collectives": 0,
            "arrived_last": 0,
            "wait_us": 0.0,
            "wait_us_per_step": {},
            "clock_offset_us": shift.get(r, 0.0),
            "clock_spread_us": offsets.get(r, (0.0, None))[1],
        }
        for r in sorted(per_rank)
    }
    for m in matched:
        for key, wait in m["wait_us"].items():
            p = parts[int(key)]
            p["collectives"] += 1
            p["wait_us"] += wait
            step = str(m["step"]) if m["step"] is not None else "none"
            p["wait_us_per_step"][step] = p["wait_us_per_step"].get(step, 0.0) + wait
        if m["skew_us"] > skew_floor_us:
            parts[m["last_rank"]]["arrived_last"] += 1
    return list(parts.values())


def _ranges(values: Sequence[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``1-3, 7``."""
    out: list[str] = []
    for v in sorted(values):
        if out and out[-1].split("-")[-1] == str(v - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ", ".join(out)
