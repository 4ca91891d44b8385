"""Who makes the others wait: a window's collectives matched across each group's ranks (pure).

Each rank's summary carries its collectives (``RankCollective``: group, ``Seq``, kind, bytes,
arrival, work, end, step) in the order it ran them. A collective is keyed within its group by the
trace's ``Seq`` where every rank's trace has one (TraceLens's ``NcclAnalyser`` keys them so);
else by its step and its order among the group's collectives of that step: windows begin and end
on step boundaries, so a rank whose window was cut short lacks whole steps, and never shifts
every later collective by one. For each collective matched on two or more of its group's ranks:

- ``last_rank``: the rank that arrived last; ``skew_us``: the latest arrival minus the earliest;
  ``wait_us[r]``: the latest arrival minus rank r's (what r spent waiting for the others);
- ``transfer_us``: the shortest duration of its work across the ranks (torch-tb-profiler's and
  TraceLens's reading: the rank that waited least was moving data all along);
- ``algbw_gbps`` = bytes / transfer time and ``busbw_gbps`` = algbw x nccl-tests' factor:
  2(n-1)/n for all_reduce; (n-1)/n for all_gather, reduce_scatter, all_to_all, gather, scatter;
  1 for broadcast, reduce; n is the group's size.

Clocks: every rank leaves a blocking collective at nearly the same instant, so a rank's clock
offset against its reference (the lowest rank its blocking collectives link it to, through any
groups) is the median difference of their ends, with its spread (the median absolute deviation,
added along the chain). A rank on another node than its reference is set by its offset when
the offset is over its spread (below it, the estimate cannot tell the clocks apart); one on the
same node (or of an unknown node) only when the offset is over
``max(3 x spread, SAME_CLOCK_US)``: one host has one clock, and below that the estimate is the
ends' own jitter. Every estimate is reported, applied or not; a clock set by over a minute
(``CLOCK_SAID_US``: a host whose time is not kept) is also a line in ``problems``.

Nothing is dropped in silence: ranks whose counts disagree are matched as far as they agree and
the rest is a line in ``problems``, as is each entry that is not a collective's (an end before
its arrival), a step whose ranks ran different numbers of a group's collectives, a group naming
ranks the window did not record, a group recorded by one rank, and point-to-point ops (send,
recv: two ranks of a group, keyed by their peers, not matched in this version).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from coordinator.protocol.collective_replies import (
    CollectiveBlock,
    CollectivesReply,
    LastArriver,
    MatchedCollective,
    RankCollective,
    RankCollectives,
    decode_block,
)

# Kinds after which every rank of the group has what the others sent: their ends line up.
BLOCKING = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier"})
POINT_TO_POINT = frozenset({"send", "recv"})
# Within one host the ranks share a clock: an offset below this is the ends' jitter, not a clock.
SAME_CLOCK_US = 1_000.0
# A clock set by more than this (a minute) is said in ``problems``: a host whose time is not
# kept (NTP keeps hosts' clocks within milliseconds). At most ``CLOCK_LINES`` lines.
CLOCK_SAID_US = 60e6
CLOCK_LINES = 8
# A collective whose arrivals spread less than this has no rank that made the others wait (the
# trace's own timing noise on a CPU rank is of this order).
SKEW_FLOOR_US = 10.0
# The most matched collectives a reply lists (the largest skews kept); every one is counted.
SHOWN = 500
# The most lines ``problems`` holds (the last says how many more there were).
MAX_PROBLEMS = 64
# The most runs ``_ranges`` writes out (``0-3, 7, ...``) before it says how many in all.
MAX_RUNS = 16
# A rank is named the last arriver when it is last at over this share of its collectives (with
# a skew over the floor), at least ``MIN_LAST`` of them (in a steady run the last one changes),
# and the others wait for it at least ``LAST_STEP_SHARE`` of the median step a step (at least
# ``LAST_MIN_WAIT_MS`` where the step time is not known): with two ranks one is always last.
LAST_SHARE = 0.5
MIN_LAST = 3
LAST_STEP_SHARE = 0.05
LAST_MIN_WAIT_MS = 1.0

# The names torch writes, lowercased without "_": c10d's ops (``c10d::_allgather_base_``),
# gloo's (``gloo:all_reduce``), ``nccl:`` record functions, NCCL's kernels
# (``ncclDevKernel_AllReduce_Sum_f32_RING_LL``: the part before the first "_") and NCCL's
# "Collective name" argument (``allreduce``, ``_allgather_base``).
_KINDS = {
    "allreduce": "all_reduce",
    "allreducecoalesced": "all_reduce",
    "allgather": "all_gather",
    "allgatherbase": "all_gather",
    "allgathercoalesced": "all_gather",
    "allgatherintotensorcoalesced": "all_gather",
    "reducescatter": "reduce_scatter",
    "reducescatterbase": "reduce_scatter",
    "reducescattertensorcoalesced": "reduce_scatter",
    "alltoall": "all_to_all",
    "alltoallbase": "all_to_all",
    "broadcast": "broadcast",
    "barrier": "barrier",
    "gather": "gather",
    "scatter": "scatter",
    "reduce": "reduce",
    "send": "send",
    "recv": "recv",
    "recvanysource": "recv",
    "sendrecv": "send",
}
_PREFIXES = ("c10d::", "gloo:", "nccl:", "nccldevkernel_", "ncclkernel_")


def kind_of(name: str) -> str | None:
    """The collective's kind for an op, kernel or NCCL "Collective name" (module table); None
    for any other name (``aten::gather`` and ``aten::broadcast_tensors`` are no collectives)."""
    low = name.strip().lower()
    for prefix in _PREFIXES:
        if low.startswith(prefix):
            rest = low[len(prefix) :].split(" ")[0]
            if prefix.startswith("nccl") and prefix.endswith("_"):
                rest = rest.split("_")[0]
            return _KINDS.get(rest.replace("_", ""))
    return _KINDS.get(low.replace("_", "")) if "::" not in low and ":" not in low else None


def busbw_factor(kind: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor for ``kind`` over ``n`` ranks."""
    if n < 2:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    return 1.0


Key = tuple[int, int]  # (SEQ, Seq), or (step, order among the group's collectives of the step)
Keyed = dict[str, dict[Key, dict[int, RankCollective]]]  # group -> key -> rank -> collective
SEQ = -(2**62)  # (the key's first part when the trace's Seq keys the group)
NO_STEP = -1  # (a collective outside every step, keyed by its order there)


def _arrival(c: RankCollective) -> float:
    return c.arrive_us


def index(per_rank: Mapping[int, Sequence[RankCollective]], problems: list[str]) -> Keyed:
    """The window's collectives by group, key and rank (module docstring); an entry that
    cannot be a collective's (times not finite, work or end before arrival), a ``Seq`` a rank
    recorded twice, and point-to-point ops are left out, a line for each rank saying how many."""
    kept: dict[int, dict[str, list[RankCollective]]] = {}
    for rank in sorted(per_rank):
        bad = p2p = 0
        groups: dict[str, list[RankCollective]] = {}
        for c in sorted(per_rank[rank], key=_arrival):
            # (a sum of finite times is finite: one check, not three; the wire's are finite)
            finite = math.isfinite(c.arrive_us + c.work_us + c.end_us)
            if not finite or c.work_us < 0 or c.end_us < c.arrive_us:
                bad += 1
            elif c.name in POINT_TO_POINT:
                p2p += 1
            elif (mine := groups.get(c.group)) is not None:
                mine.append(c)
            else:
                groups[c.group] = [c]
        if groups:
            kept[rank] = groups
        if bad:
            problems.append(
                f"rank {rank}: {bad} collective(s) with times that cannot be a collective's "
                "(not finite, or ending before they start) left out"
            )
        if p2p:
            problems.append(f"rank {rank}: {p2p} point-to-point op(s) (send, recv) not matched")
    by_seq = {
        group: all(c.seq is not None for cs in kept.values() for c in cs.get(group, ()))
        for group in {g for cs in kept.values() for g in cs}
    }
    keyed: Keyed = {}
    for rank, groups in kept.items():
        for group, cs in groups.items():
            twice = _key_rank(keyed.setdefault(group, {}), rank, cs, by_seq[group])
            if twice:
                problems.append(
                    f"rank {rank}: {twice} collective(s) of group {group} recorded twice with "
                    "one Seq: the first kept"
                )
    return keyed


def _key_rank(at: dict[Key, dict[int, RankCollective]], rank: int, cs: list[RankCollective],
              by_seq: bool) -> int:  # fmt: skip
    """Rank ``rank``'s collectives of one group (in the order it ran them) under their keys;
    how many had a ``Seq`` already taken."""
    twice, order = 0, dict[int, int]()
    for c in cs:
        if by_seq:
            key = (SEQ, int(c.seq or 0))
        else:
            step = NO_STEP if c.step is None else c.step
            key = (step, order.get(step, 0))
            order[step] = key[1] + 1
        if rank in at.setdefault(key, {}):
            twice += 1
        else:
            at[key][rank] = c
    return twice


def members(
    keyed: Keyed,
    window: Sequence[int],
    named: Mapping[str, Sequence[int]],
    problems: list[str],
) -> dict[str, list[int]]:
    """Each group's ranks in this window: those the traces' process groups name
    (``named``), else those that recorded it. Ranks a group names that the window did not record
    are said; the group's size stays what it names."""
    ranks, out = set(window), {}
    for group, keys in sorted(keyed.items()):
        seen = {r for at in keys.values() for r in at}
        outside = sorted(set(named.get(group, ())) - ranks)
        if outside:
            problems.append(
                f"group {group}: ranks {_ranges(outside)} of the group were not recorded in "
                "this window; matched among the ranks that were"
            )
        out[group] = sorted((set(named.get(group, ())) & ranks) | seen)
    return out


def clock_offsets(
    keyed: Keyed, groups: Mapping[str, list[int]], problems: list[str]
) -> dict[int, tuple[int, float, float | None]]:
    """Each rank's (reference, offset, spread), microseconds: its clock minus its reference's,
    from the ends of the blocking collectives it shares with a rank already set (module
    docstring); a rank no blocking collective links to another is its own reference, spread None."""
    out: dict[int, tuple[int, float, float | None]] = {}
    for start in sorted({r for g in groups.values() for r in g}):
        if start in out:
            continue
        out[start] = (start, 0.0, 0.0)
        grew = True
        while grew:  # (each pass sets a rank or stops: at most as many passes as ranks)
            grew = False
            for group, keys in sorted(keyed.items()):
                known = next((r for r in groups[group] if out.get(r, (None,))[0] == start), None)
                if known is None:
                    continue
                for r in groups[group]:
                    est = None if r in out else _offset(keys, known, r)
                    if est is not None:
                        base = out[known]
                        out[r] = (start, base[1] + est[0], (base[2] or 0.0) + est[1])
                        grew = True
        if all(r == start or out[r][0] != start for r in out):  # alone: nothing links it
            out[start] = (start, 0.0, None)
    refs = sorted({ref for ref, _, _ in out.values() if ref != min(out, default=0)})
    if out and refs:
        problems.append(
            f"ranks {_ranges(refs)}: no blocking collective links their clocks to rank "
            f"{min(out)}'s; each is set against its own reference (clock_reference)"
        )
    return out


def _offset(
    keys: Mapping[Key, Mapping[int, RankCollective]], known: int, rank: int
) -> tuple[float, float] | None:
    """Rank ``rank``'s clock minus rank ``known``'s and its spread, from the ends of the
    blocking collectives both recorded; None when they share none."""
    diffs = [
        at[rank].end_us - at[known].end_us
        for at in keys.values()
        if rank in at and known in at and at[rank].name in BLOCKING
    ]
    if not diffs:
        return None
    mid = statistics.median(diffs)
    return mid, statistics.median(abs(d - mid) for d in diffs)


def corrections(
    offsets: Mapping[int, tuple[int, float, float | None]], nodes: Mapping[int, str] | None
) -> dict[int, float]:
    """What to take off each rank's times: its offset, where the module docstring says so."""
    out = {}
    for r, (ref, off, spread) in offsets.items():
        other_node = nodes is not None and r in nodes and ref in nodes and nodes[r] != nodes[ref]
        if spread is None or r == ref:
            continue
        if (other_node and abs(off) > spread) or abs(off) > max(3 * spread, SAME_CLOCK_US):
            out[r] = off
    return out


def clock_lines(
    offsets: Mapping[int, tuple[int, float, float | None]], shift: Mapping[int, float]
) -> list[str]:
    """A line for each rank whose clock was set by an offset over ``CLOCK_SAID_US`` (a clock
    that far off is worth knowing of: a host's time not kept in step), the first
    ``CLOCK_LINES`` of them, then how many more."""
    far = [r for r in sorted(shift) if abs(shift[r]) > CLOCK_SAID_US]
    out = [
        f"rank {r}: its clock reads {shift[r] / 1e6:+,.3f} s off rank {offsets[r][0]}'s "
        f"(the ends of their blocking collectives, spread {(offsets[r][2] or 0.0) / 1e3:.3f} "
        "ms); its times were set by it before matching"
        for r in far[:CLOCK_LINES]
    ]
    if len(far) > CLOCK_LINES:
        out.append(f"ranks {_ranges(far[CLOCK_LINES:])}: their clocks too are over a minute off")
    return out


def match_one(
    group: str, key: Key, at: Mapping[int, RankCollective], size: int, shift: Mapping[int, float]
) -> MatchedCollective:
    """One collective recorded by two or more ranks of its group, matched (module docstring);
    ``shift``: what to take off each rank's times, ``size``: the group's size."""
    if shift:
        arrive = {r: c.arrive_us - shift.get(r, 0.0) for r, c in at.items()}
    else:
        arrive = {r: c.arrive_us for r, c in at.items()}
    latest, last, earliest = -math.inf, -1, math.inf
    for r, a in arrive.items():  # (one pass: the latest, the highest rank of a tie, earliest)
        if a > latest or (a == latest and r > last):
            latest, last = a, r
        earliest = a if a < earliest else earliest
    transfer = min([c.work_us for c in at.values()])
    nbytes = max([c.nbytes for c in at.values()])
    first = at[min(at)]
    algbw = nbytes / transfer / 1e3 if nbytes > 0 and transfer > 0 else None
    factor = busbw_factor(first.name, size)
    return {
        "group": group,
        "seq": key[1],
        "name": first.name,
        "ranks": sorted(at),
        "missing": [],
        "step": first.step,
        "last_rank": last,
        "skew_us": latest - earliest,
        "wait_us": {str(r): latest - a for r, a in sorted(arrive.items())},
        "transfer_us": transfer,
        "bytes": nbytes,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * factor if algbw is not None else None,
    }


def match_window(
    per_rank: Mapping[int, Sequence[RankCollective]],
    groups: Mapping[str, Sequence[int]] | None = None,
    nodes: Mapping[int, str] | None = None,
    shown: int = SHOWN,
    skew_floor_us: float = SKEW_FLOOR_US,
    step_ms: float | None = None,
) -> CollectivesReply:
    """A window's collectives matched across each group's ranks, and each rank's part;
    ``per_rank``: each recorded rank's collectives (a rank with none: an empty list),
    ``groups``: the ranks of each process group where the traces name them (``pg_config``),
    ``nodes``: each rank's node where known; ``step_ms``: the window's median step time (for
    ``last_arriver``). What could not be matched is in ``problems``."""
    problems: list[str] = []
    keyed = index(per_rank, problems)
    member = members(keyed, sorted(per_rank), groups or {}, problems)
    offsets = clock_offsets(keyed, member, problems)
    shift = corrections(offsets, nodes)
    problems += clock_lines(offsets, shift)
    matched: list[MatchedCollective] = []
    for group, keys in sorted(keyed.items()):
        size = max(len(member[group]), len((groups or {}).get(group, ())))
        matched += _match_group(group, keys, member[group], size, shift, problems)
    silent = sorted(r for r, cs in per_rank.items() if not cs)
    if silent and keyed:
        problems.append(f"ranks {_ranges(silent)}: no collective in their traces")
    ranks = _rank_parts(matched, per_rank, offsets, shift, skew_floor_us)
    kept = sorted(matched, key=lambda m: -m["skew_us"])[: max(0, shown)]
    kept.sort(key=lambda m: (m["group"], m["step"] if m["step"] is not None else NO_STEP, m["seq"]))
    return {
        "collectives": kept,
        "ranks": ranks,
        "matched": len(matched),
        "shown": len(kept),
        "last_arriver": last_arriver(matched, skew_floor_us, step_ms),
        "problems": problems,
    }


def _match_group(
    group: str,
    keys: Mapping[Key, Mapping[int, RankCollective]],
    member: list[int],
    size: int,
    shift: Mapping[int, float],
    problems: list[str],
) -> list[MatchedCollective]:
    """A group's collectives matched as far as its ranks agree; the rest said."""
    seen = sorted({r for at in keys.values() for r in at})
    if len(seen) < 2:
        problems.append(f"group {group}: only rank {_ranges(seen)} recorded it; nothing to match")
        return []
    counts = _step_counts(keys)
    uneven = sorted(s for s, per in counts.items() if len(set(per.values())) > 1)
    skipped = set(uneven)
    out, lacking, disagree = [], dict[int, int](), []
    for key, at in sorted(keys.items()):
        if key[0] != SEQ and key[0] in skipped:
            continue
        missing = [r for r in member if r not in at] if len(at) < len(member) else []
        for r in missing:
            lacking[r] = lacking.get(r, 0) + 1
        if len({c.name for c in at.values()}) > 1:
            disagree.append(key)
        elif len(at) >= 2:
            m = match_one(group, key, at, size, shift)
            m["missing"] = missing
            out.append(m)
    _said(group, len(keys), lacking, uneven, disagree, counts, problems)
    return out


def _step_counts(keys: Mapping[Key, Mapping[int, RankCollective]]) -> dict[int, dict[int, int]]:
    """Order-keyed steps -> rank -> how many of the group's collectives it ran in the step."""
    counts: dict[int, dict[int, int]] = {}
    for (step, _), at in keys.items():
        if step != SEQ:
            for r in at:
                counts.setdefault(step, {})[r] = counts.setdefault(step, {}).get(r, 0) + 1
    return counts


def _said(
    group: str,
    total: int,
    lacking: Mapping[int, int],
    uneven: list[int],
    disagree: list[Key],
    counts: Mapping[int, Mapping[int, int]],
    problems: list[str],
) -> None:
    """The lines for what of a group could not be matched whole."""
    for r, n in sorted(lacking.items()):
        problems.append(
            f"group {group}: rank {r} lacks {n} of its {total} collectives; the others matched "
            "without it"
        )
    for step in uneven:
        per = ", ".join(f"rank {r}: {n}" for r, n in sorted(counts[step].items()))
        problems.append(
            f"group {group}: in step {step} the ranks ran different numbers of its collectives "
            f"({per}); that step is not matched"
        )
    if disagree:
        where = ", ".join(_where(k) for k in disagree[:8])
        problems.append(
            f"group {group}: the ranks disagree on the kind of {len(disagree)} collective(s) "
            f"({where}): their orders differ; those are not matched"
        )


def _where(key: Key) -> str:
    return f"Seq {key[1]}" if key[0] == SEQ else f"step {key[0]} #{key[1]}"


def _rank_parts(
    matched: Sequence[MatchedCollective],
    per_rank: Mapping[int, Sequence[RankCollective]],
    offsets: Mapping[int, tuple[int, float, float | None]],
    shift: Mapping[int, float],
    skew_floor_us: float,
) -> list[RankCollectives]:
    """Each recorded rank's waits, last arrivals and clock, from the matched collectives."""
    parts: dict[int, RankCollectives] = {}
    for r in sorted(per_rank):
        ref, off, spread = offsets.get(r, (r, 0.0, None))
        parts[r] = {
            "rank": r,
            "collectives": 0,
            "arrived_last": 0,
            "arrived_last_per_step": {},
            "made_wait_us": 0.0,
            "wait_us": 0.0,
            "wait_us_per_step": {},
            "wait_share": None,
            "clock_reference": ref,
            "clock_offset_us": off,
            "clock_spread_us": spread,
            "clock_corrected": r in shift,
            "cut": 0,
        }
    for m in matched:
        step = str(m["step"]) if m["step"] is not None else "none"
        for key, wait in m["wait_us"].items():
            p = parts[int(key)]
            p["collectives"] += 1
            p["wait_us"] += wait
            p["wait_us_per_step"][step] = p["wait_us_per_step"].get(step, 0.0) + wait
        if m["skew_us"] > skew_floor_us:
            last = parts[m["last_rank"]]
            last["arrived_last"] += 1
            last["arrived_last_per_step"][step] = last["arrived_last_per_step"].get(step, 0) + 1
            others = len(m["wait_us"]) - 1
            last["made_wait_us"] += sum(m["wait_us"].values()) / others if others else 0.0
    return list(parts.values())


def window_collectives(
    blocks: Mapping[int, CollectiveBlock | bytes | None],
    nodes: Mapping[int, str] | None = None,
    shown: int = SHOWN,
    step_ms: float | None = None,
    rank_step_ms: Mapping[int, float] | None = None,
) -> CollectivesReply:
    """``match_window`` over the blocks the ranks' summaries carried (None: a rank whose trace
    had no collective): the process groups their traces name, joined (a group two traces name
    with different ranks is said, the larger kept), what each rank's reader noted, each
    rank's collectives past its cap (``cut``), and its wait a step against its mean step time
    (``rank_step_ms``: ``wait_share``). Blocks kept as bytes are decoded here."""
    per_rank: dict[int, Sequence[RankCollective]] = {}
    groups: dict[str, list[int]] = {}
    notes: list[str] = []
    said: dict[str, list[int]] = {}  # a reader's note -> the ranks that noted it
    blocks = _decoded(blocks, notes)
    for rank, block in sorted(blocks.items()):
        per_rank[rank] = block.calls if block is not None else ()
        if block is None:
            continue
        for name, ranks in block.groups:
            if name in groups and groups[name] != list(ranks):
                notes.append(
                    f"group {name}: rank {rank}'s trace names ranks {_ranges(list(ranks))}, "
                    f"another's {_ranges(groups[name])}; the larger kept"
                )
            if len(ranks) > len(groups.get(name, ())):
                groups[name] = list(ranks)
        for n in block.notes:
            said.setdefault(n, []).append(rank)
    notes += _merged(said)
    reply = match_window(per_rank, groups, nodes, shown, step_ms=step_ms)
    for part in reply["ranks"]:
        block = blocks.get(part["rank"])
        part["cut"] = block.cut if block is not None else 0
        mine = (rank_step_ms or {}).get(part["rank"])
        if mine and part["wait_us_per_step"]:
            part["wait_share"] = part["wait_us"] / len(part["wait_us_per_step"]) / (mine * 1e3)
    problems = notes + reply["problems"]
    if len(problems) > MAX_PROBLEMS:
        left = len(problems) - MAX_PROBLEMS + 1
        problems = problems[: MAX_PROBLEMS - 1] + [f"... and {left} more problem lines"]
    reply["problems"] = problems
    return reply


def _merged(said: Mapping[str, list[int]]) -> list[str]:
    """Each reader's note once, with the ranks that noted it (``ranks 0-1023: ...``)."""
    out = []
    for note, ranks in sorted(said.items(), key=lambda kv: (kv[1][0], kv[0])):
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranges(ranks)}"
        out.append(f"{who}: {note}")
    return out


def _decoded(
    blocks: Mapping[int, CollectiveBlock | bytes | None], notes: list[str]
) -> dict[int, CollectiveBlock | None]:
    """The blocks, those kept as bytes decoded; one that cannot be is said, and none."""
    out: dict[int, CollectiveBlock | None] = {}
    for rank, block in blocks.items():
        if isinstance(block, bytes):
            try:
                block = decode_block(block)
            except ValueError as exc:
                notes.append(f"rank {rank}: its collectives cannot be read ({exc}); left out")
                block = None
        out[rank] = block
    return out


def last_arriver(
    matched: Sequence[MatchedCollective],
    skew_floor_us: float = SKEW_FLOOR_US,
    step_ms: float | None = None,
) -> LastArriver | None:
    """The rank the others waited for (``LastArriver``), from every matched collective (not
    only those a reply lists); None when no rank is last often enough, or the wait is small
    against the median step ``step_ms`` (constants above)."""
    last: dict[int, list[MatchedCollective]] = {}
    taking: dict[int, int] = {}
    for m in matched:
        for r in m["ranks"]:
            taking[r] = taking.get(r, 0) + 1
        if m["skew_us"] > skew_floor_us:
            last.setdefault(m["last_rank"], []).append(m)
    if not last:
        return None
    rank = max(last, key=lambda r: (len(last[r]), sum(m["skew_us"] for m in last[r]), -r))
    n, total = len(last[rank]), taking[rank]
    if n < MIN_LAST or n <= LAST_SHARE * total:
        return None
    waited: dict[int, float] = {}
    for m in last[rank]:
        for key, w in m["wait_us"].items():
            if int(key) != rank:
                waited[int(key)] = waited.get(int(key), 0.0) + w
    steps = {m["step"] for m in matched if rank in m["ranks"]}
    per_step = sum(waited.values()) / max(1, len(waited)) / max(1, len(steps)) / 1e3
    if per_step < (LAST_STEP_SHARE * step_ms if step_ms else LAST_MIN_WAIT_MS):
        return None
    others = sorted(waited)
    return {
        "rank": rank,
        "arrived_last": n,
        "collectives": total,
        "waiting_ranks": others,
        "wait_ms_per_step": per_step,
        "reason": (
            f"arrives last at {n} of {total} collectives; "
            + (f"rank {others[0]} waits" if len(others) == 1 else f"ranks {_ranges(others)} wait")
            + f" {per_step:.3g} ms a step"
        ),
        "agrees": False,
        "note": None,
    }


def _ranges(values: Sequence[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``1-3, 7``."""
    out: list[list[int]] = []
    for v in sorted(values):
        if out and out[-1][-1] == v - 1:
            out[-1] = [out[-1][0], v]
        else:
            out.append([v])
    text = ", ".join("-".join(map(str, run)) for run in out[:MAX_RUNS])
    return text + (f", ... ({len(values)} in all)" if len(out) > MAX_RUNS else "")
