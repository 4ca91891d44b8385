"""A rank's collectives of a window, from the digest its trace reader already made (issue 56).

Each collective is found from the op c10d runs on the calling thread (``c10d::allreduce_``,
``c10d::_allgather_base_``, ...), its arrival; its work is

- on a GPU rank, the NCCL kernel its launch started (linked by the launch's correlation): the
  arrival is then the kernel's start, where the rank joined the collective on the device;
- on gloo, the backend's own span on one of the process group's threads (``gloo:all_reduce``),
  paired with the calls of its kind in order, each with the first span to start after it;
- else (neither in the trace) the op itself.

Its process group, ``Seq``, sizes and dtype are read from NCCL's ``record_param_comms`` under
the op where the trace has it (newer torch adds ``Seq``). gloo's spans name no group: a rank's
gloo threads are split into its groups (``distributedInfo.pg_config``, in their order) in the
order of the threads' ids, as each group makes its threads when it is made: evenly, as each
group makes as many (else at the widest gaps of their ids, said); with one group there is
nothing to split. A trace with no group at all is taken as the default group's
("0"). NCCL kernels no op launched (a trace of device activity alone) are collectives of their
own, their kind from the kernel's name.

Bounded: whole steps are kept, in order, up to ``cap`` collectives; those past it are folded
per (group, kind, bytes) with their count, and the cut is said.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Sequence
from typing import Any

from coordinator.core.collectives import kind_of
from coordinator.protocol.collective_replies import (
    DEFAULT_COLLECTIVES_CAP,
    MAX_FOLDED,
    MAX_GROUPS,
    MAX_NOTES,
    CollectiveBlock,
    FoldedCollective,
    RankCollective,
)
from worker_ext.agent.trace_reader import RUNTIME, CommArgs, TraceDigest

DEFAULT_CAP = DEFAULT_COLLECTIVES_CAP
DEFAULT_GROUP = "0"
MAX_LISTED_RANKS = 65_536
"""Ranks a summary lists in its process groups, all together (about 200 KB)."""
_DIGITS = re.compile(r"-?[0-9]{1,19}")

# Bytes per element, by the names torch writes for a dtype ("Float", "float", "c10::BFloat16").
_ITEMSIZE = {
    "float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2,
    "bfloat16": 2, "c10::half": 2, "c10::bfloat16": 2, "long": 8, "int64": 8, "int": 4,
    "int32": 4, "short": 2, "int16": 2, "char": 1, "int8": 1, "signed char": 1, "byte": 1,
    "unsigned char": 1, "uint8": 1, "bool": 1, "complexfloat": 8, "complexdouble": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "c10::float8_e4m3fn": 1, "c10::float8_e5m2": 1,
}  # fmt: skip
# Kinds whose output is the group's inputs side by side, and whose input is that.
_GATHERS = frozenset({"all_gather", "gather"})
_SCATTERS = frozenset({"reduce_scatter", "scatter"})


class _Call:
    """One c10d op on a calling thread, as it is being put together."""

    __slots__ = ("args", "end", "kernel", "kind", "own", "shaped", "start", "thread", "work")

    def __init__(self, thread: int, start: int, end: int, kind: str, own: CommArgs | None) -> None:
        self.thread, self.start, self.end, self.kind = thread, start, end, kind
        self.own = own  # the op's own arguments (its tensors' shapes, with record_shapes)
        self.args: CommArgs | None = None  # record_param_comms' arguments
        self.shaped: CommArgs | None = None  # the nccl: span's under it (its input shapes)
        self.kernel: tuple[int, int] | None = None  # device start, end (ns)
        self.work: tuple[int, int, CommArgs | None, int] | None = None  # backend's span, thread


def collectives_of(
    d: TraceDigest, cap: int = DEFAULT_CAP, in_steps: bool = False
) -> CollectiveBlock | None:
    """The window's collectives of one rank's digest (module docstring); None when its trace
    has no collective at all. ``in_steps``: only those in the recorded steps (a trace that
    spans more than its window: libkineto's), the others said."""
    notes: list[str] = []
    groups = _groups(d.groups, d.world_size, notes)
    calls = _calls(d)
    if not calls and not any(_kernel_kind(d, e[2]) for e in d.device):
        return None
    _link_kernels(d, calls)
    _pair_backend_spans(d, calls, notes)
    mine = [g for g, ranks in groups.items() if d.rank is None or d.rank in ranks]
    threads = _thread_groups(d, mine, notes) if len(mine) > 1 else {}
    found = [_collective(d, c, _group_of(c, mine, threads), groups, notes) for c in calls]
    notes += _unsized(calls, found)
    found += _lone_kernels(d, calls, groups)
    kept = [c for c in found if c is not None]
    if in_steps and d.steps:
        outside = sum(c.step is None for c in kept)
        kept = [c for c in kept if c.step is not None]
        if outside:
            notes.append(f"{outside} collective(s) outside the window's steps were left out")
    kept.sort(key=lambda c: c.arrive_us)
    calls_kept, folded, cut = bounded(kept, cap)
    if cut:
        notes.append(
            f"{cut} of {len(kept)} collectives past the cap of {cap} a window were folded per "
            "(group, kind, bytes); raise collectives_cap to match them all"
        )
    return CollectiveBlock(
        calls=tuple(calls_kept),
        folded=tuple(folded),
        cut=cut,
        groups=tuple((name, tuple(ranks)) for name, ranks in groups.items()),
        notes=tuple(n[:500] for n in notes[:MAX_NOTES]),
    )


def bounded(
    found: Sequence[RankCollective], cap: int
) -> tuple[list[RankCollective], list[FoldedCollective], int]:
    """Whole steps of ``found`` (in their order) up to ``cap`` collectives (the first step's
    first ``cap`` when it alone is over), the rest folded per (group, kind, bytes), and how
    many were folded."""
    if len(found) <= cap:
        return list(found), [], 0
    keep = cap
    while keep > 0 and found[keep - 1].step == found[keep].step:
        keep -= 1
    keep = keep or cap
    fold: dict[tuple[str, str, int], list[float]] = {}
    for c in found[keep:]:
        row = fold.setdefault((c.group, c.name, c.nbytes), [0, 0.0])
        row[0] += 1
        row[1] += c.work_us
    rows = sorted(fold.items(), key=lambda kv: -kv[1][1])[:MAX_FOLDED]
    folded = [FoldedCollective(g, n, b, int(v[0]), v[1]) for (g, n, b), v in rows]
    return list(found[:keep]), folded, len(found) - keep


def _groups(config: Any, world: int | None, notes: list[str]) -> dict[str, list[int]]:
    """The process groups ``pg_config`` lists (name -> ranks), in the trace's order; entries
    that are not a group's are said and left out. At most ``MAX_LISTED_RANKS`` ranks are listed
    in all (a summary has a size cap): a group past it keeps its name, its ranks not listed
    (said). No ``pg_config``: the default group of ``world`` ranks, where the trace says it."""
    if config is None:
        fits = world is not None and 1 < world <= MAX_LISTED_RANKS
        return {DEFAULT_GROUP: list(range(world))} if fits and world is not None else {}
    out: dict[str, list[int]] = {}
    bad = listed = 0
    for g in config if isinstance(config, list) else []:
        name = g.get("pg_name") if isinstance(g, dict) else None
        ranks = g.get("ranks") if isinstance(g, dict) else None
        if isinstance(ranks, str):  # ("[0, 1]" in some versions)
            ranks = _int_list(ranks)
        if not isinstance(name, (str, int)) or not isinstance(ranks, list):
            bad += 1
            continue
        members: list[int] = [r for r in ranks if type(r) is int and 0 <= r < 2**62]
        if len(members) != len(ranks):
            bad += 1
        elif len(out) < MAX_GROUPS:
            key = str(name)[:256] or DEFAULT_GROUP
            fits = listed + len(members) <= MAX_LISTED_RANKS
            out[key] = sorted(set(members)) if fits else []
            listed += len(members) if fits else 0
            if not fits:
                notes.append(
                    f"group {key} lists {len(members):,} ranks, past the {MAX_LISTED_RANKS:,} a "
                    "summary lists: its ranks are those recorded"
                )
    if bad or not isinstance(config, list):
        notes.append(f"the trace's process groups (pg_config) hold {bad or 1} malformed entries")
    return out


def _int_list(text: str) -> list[int] | None:
    """``"[0, 1]"`` as ints; None when any part is not one (or the text is over the cap)."""
    if len(text) > 8 * MAX_LISTED_RANKS:
        return None
    out = [_int(x) for x in text.strip("[] ").split(",") if x.strip()]
    return None if any(x is None for x in out) else [x for x in out if x is not None]


def _calls(d: TraceDigest) -> list[_Call]:
    """The outermost c10d collective ops of each thread, in order of start, each with the
    ``record_param_comms`` inside it."""
    calls: list[_Call] = []
    last_end: dict[int, int] = {}
    params: list[tuple[int, int, str, CommArgs | None]] = []
    for thread, start, end, name, args in sorted(d.comm, key=lambda e: (e[1], -e[2])):
        if name == "record_param_comms" or name.startswith("nccl:"):
            params.append((thread, start, name, args))
            continue
        kind = kind_of(name) if name.startswith("c10d::") else None
        if kind is None or start < last_end.get(thread, -(2**62)):
            continue
        last_end[thread] = end
        calls.append(_Call(thread, start, end, kind, args))
    by_thread = _by_thread(calls)
    for thread, start, name, args in params:
        owner = _enclosing(by_thread.get(thread), start)
        if owner is None or args is None:
            continue
        if name == "record_param_comms" and owner.args is None:
            owner.args = args
        elif name != "record_param_comms" and owner.shaped is None:
            owner.shaped = args
    return calls


def _by_thread(calls: list[_Call]) -> dict[int, tuple[list[int], list[_Call]]]:
    """Each thread's calls (sorted by start, not overlapping) and their starts, to bisect."""
    out: dict[int, tuple[list[int], list[_Call]]] = {}
    for c in calls:
        starts, mine = out.setdefault(c.thread, ([], []))
        starts.append(c.start)
        mine.append(c)
    return out


def _enclosing(found: tuple[list[int], list[_Call]] | None, t: int) -> _Call | None:
    """The call of one thread's (``_by_thread``) whose span holds ``t``."""
    if found is None:
        return None
    starts, calls = found
    i = bisect.bisect_right(starts, t) - 1
    return calls[i] if i >= 0 and calls[i].start <= t <= calls[i].end else None


def _kernel_kind(d: TraceDigest, name_id: int) -> str | None:
    name = d.names[name_id]
    return kind_of(name) if name[:4].lower() == "nccl" else None


def _link_kernels(d: TraceDigest, calls: list[_Call]) -> None:
    """Each call's NCCL kernels (their span), by the correlation of the launches inside it."""
    kernels = {e[6]: (e[0], e[1]) for e in d.device if e[6] >= 0 and _kernel_kind(d, e[2])}
    if not kernels or not calls:
        return
    cpu = d.cpu()
    by_thread = _by_thread(calls)
    for i in (cpu.kind == RUNTIME).nonzero()[0].tolist():
        span = kernels.get(int(cpu.corr[i]))
        if span is None:
            continue
        owner = _enclosing(by_thread.get(int(cpu.thread[i])), int(cpu.start[i]))
        if owner is not None:
            k = owner.kernel
            owner.kernel = span if k is None else (min(k[0], span[0]), max(k[1], span[1]))


def _pair_backend_spans(d: TraceDigest, calls: list[_Call], notes: list[str]) -> None:
    """Each call with no kernel gets the first unpaired backend span of its kind (``gloo:``,
    ``nccl:`` on another thread) that starts after it; spans left over are said."""
    spans: dict[str, list[tuple[int, int, int, CommArgs | None]]] = {}
    for thread, start, end, name, args in d.comm:
        if name.startswith(("gloo:", "nccl:")) and (kind := kind_of(name)) is not None:
            spans.setdefault(kind, []).append((start, end, thread, args))
    calling = {c.thread for c in calls}
    for kind, found in spans.items():
        found = sorted(s for s in found if s[2] not in calling)  # (nccl: on the caller: not work)
        starts = [s[0] for s in found]
        used, nxt = [False] * len(found), 0  # (calls come in order of start: so do their spans)
        for c in (c for c in calls if c.kind == kind and c.kernel is None):
            i = max(bisect.bisect_left(starts, c.start), nxt)
            if i < len(found):
                used[i], nxt = True, i + 1
                c.work = (found[i][0], found[i][1], found[i][3], found[i][2])
        if not all(used):
            notes.append(
                f"{used.count(False)} {kind} span(s) of the backend's threads matched no call"
            )


def _collective(
    d: TraceDigest, c: _Call, group: str, groups: dict[str, list[int]], notes: list[str]
) -> RankCollective | None:
    """One call as ``RankCollective``; None (said) when its times cannot be a collective's."""
    base = d.base_us
    if c.kernel is not None:
        start, end = c.kernel
        arrive = start
    elif c.work is not None:
        start, end = c.work[0], c.work[1]
        arrive = c.start
    else:
        start, end, arrive = c.start, c.end, c.start
    args = c.args
    size = len(groups.get(group, ())) or _int(getattr(args, "group_size", None)) or 0
    nbytes, dtype = _size(c, args, size)
    arrive_us, end_us = base + arrive / 1e3, base + end / 1e3
    if not (math.isfinite(arrive_us) and math.isfinite(end_us)) or end < start:
        notes.append(f"a {c.kind} with times that cannot be a collective's was left out")
        return None
    return RankCollective(
        group=group,
        seq=_int(getattr(args, "seq", None)),
        name=c.kind,
        nbytes=nbytes,
        dtype=dtype,
        step=_step_of(d, c.start),
        arrive_us=arrive_us,
        work_us=(end - start) / 1e3,
        end_us=end_us,
    )


def _group_of(c: _Call, mine: list[str], threads: dict[int, str]) -> str:
    """The call's process group: ``record_param_comms``' name, else its gloo thread's group
    (``threads``), else the first group holding the rank (``mine``), else the default group."""
    name = getattr(c.args, "group", None)
    if isinstance(name, (str, int)) and str(name):
        return str(name)[:256]
    if c.work is not None and c.work[3] in threads:
        return threads[c.work[3]]
    return mine[0] if mine else DEFAULT_GROUP


def _thread_groups(d: TraceDigest, mine: list[str], notes: list[str]) -> dict[int, str]:
    """The backend's threads (by digest thread index) split into the rank's groups ``mine``,
    in order of their ids (module docstring): evenly, as every group of a job makes as many
    threads (gloo's ``threads`` option, 2 by default), when their count allows it; else at the
    widest gaps between their ids (said: the split may then mix groups)."""
    threads = sorted(
        {t for t, _, _, name, _ in d.comm if name.startswith("gloo:")},
        key=lambda t: _tid(d.threads[t][1]),
    )
    tids = [_tid(d.threads[t][1]) for t in threads]
    if len(tids) % len(mine) == 0:
        each = len(tids) // len(mine)
        cuts = [each * g for g in range(1, len(mine))]
    else:
        cuts = sorted(
            sorted(range(1, len(tids)), key=lambda i: -(tids[i] - tids[i - 1]))[: len(mine) - 1]
        )
        notes.append(
            f"{len(tids)} gloo threads do not split evenly into the rank's {len(mine)} groups "
            "(a thread idle in the window?): split at the widest gaps of their ids, which may "
            "mix the groups' collectives"
        )
    out, g = {}, 0
    for i, t in enumerate(threads):
        while g < len(cuts) and i >= cuts[g]:
            g += 1
        out[t] = mine[min(g, len(mine) - 1)]
    return out


def _tid(tid: Any) -> int:
    return tid if type(tid) is int else 0


def _size(c: _Call, args: CommArgs | None, group_size: int) -> tuple[int, str]:
    """(bytes nccl-tests measures it by, dtype): from NCCL's element counts, else from the
    input shapes of the backend's span or the op."""
    dtype = getattr(args, "dtype", None)
    dtype = dtype if isinstance(dtype, str) else ""
    n_in, n_out = _int(getattr(args, "in_nelems", None)), _int(getattr(args, "out_nelems", None))
    if n_in is None and n_out is None:
        spans = (c.work[2] if c.work is not None else None, c.shaped, args)
        n_in, dtype = _first_shape(spans)
        n_op, op_type = _op_size(c.own, c.kind, group_size)
        if n_op is not None:  # (the op's own tensors: its output too, where it has one)
            n_in, dtype = n_op, op_type or dtype
        elif n_in is not None and c.kind in _GATHERS and group_size:
            n_out = n_in * group_size
    if c.kind == "barrier":
        return 0, ""
    item = _ITEMSIZE.get(dtype.lower(), 0)
    nbytes = max(n_in or 0, n_out or 0) * item
    return (nbytes if 0 <= nbytes < 2**62 else 0), dtype[:32]


def _unsized(calls: list[_Call], found: list[RankCollective | None]) -> list[str]:
    """A line per kind for the calls whose size the trace does not give (0 bytes): those whose
    size arguments are there but malformed, and those with none (``record_shapes`` off)."""
    odd: dict[tuple[str, bool], int] = {}
    for c, f in zip(calls, found, strict=True):
        if f is None or f.nbytes > 0 or f.name == "barrier":
            continue
        sources = (c.args, c.shaped, c.work[2] if c.work is not None else None)
        given = any(
            getattr(a, k, None) is not None
            for a in sources
            for k in ("in_nelems", "out_nelems", "input_dims")
        )
        odd[(f.name, given)] = odd.get((f.name, given), 0) + 1
    return [
        f"{n} {kind} collective(s) with size arguments that are malformed (In/Out msg nelems, "
        "dtype, Input Dims): counted as 0 bytes"
        if given
        else f"{n} {kind} collective(s) with no size in the trace (no record_param_comms "
        "sizes, no input shapes: record_shapes off?): counted as 0 bytes"
        for (kind, given), n in sorted(odd.items())
    ]


def _first_shape(sources: tuple[CommArgs | None, ...]) -> tuple[int | None, str]:
    """``_shape_elems`` of the first source that has a shape."""
    for args in sources:
        n, dtype = _shape_elems(args)
        if n is not None:
            return n, dtype
    return None, ""


def _op_size(own: CommArgs | None, kind: str, group_size: int) -> tuple[int | None, str]:
    """The largest of a c10d op's tensors (its output where the trace records it:
    ``_allgather_base_(output, input)``), elements and dtype ("" for a tensor list); a
    gather whose output list is not recorded (``allgather_``): its input times the group."""
    dims, types = getattr(own, "input_dims", None), getattr(own, "input_type", None)
    if not isinstance(dims, list) or not isinstance(types, list):
        return None, ""
    sizes: list[tuple[int, str]] = []
    for shape, kind_of_arg in zip(dims, types, strict=False):
        if kind_of_arg in ("", "Scalar", "ScalarList") or not isinstance(shape, list) or not shape:
            continue
        n, dtype = _shape_elems(CommArgs(input_dims=[shape], input_type=[kind_of_arg]))
        if n is None:
            return None, ""
        sizes.append((n, dtype))
    if not sizes or max(sizes)[0] <= 0:
        return None, ""
    n, dtype = max(sizes)
    if kind in _GATHERS and len(sizes) == 1 and group_size:
        n *= group_size
    return n, dtype


def _shape_elems(args: CommArgs | None) -> tuple[int | None, str]:
    """Elements of the first tensor (or tensor list) input, and its dtype."""
    dims, types = getattr(args, "input_dims", None), getattr(args, "input_type", None)
    if not isinstance(dims, list) or not isinstance(types, list):
        return None, ""
    for shape, kind in zip(dims, types, strict=False):
        if not isinstance(shape, list) or not shape or not isinstance(kind, str):
            continue
        shapes = shape if isinstance(shape[0], list) else [shape]
        try:
            n = sum(math.prod(int(x) for x in s) for s in shapes)
        except (TypeError, ValueError):
            return None, ""
        return n, ("" if kind == "TensorList" else kind)
    return None, ""


def _lone_kernels(
    d: TraceDigest, calls: list[_Call], groups: dict[str, list[int]]
) -> list[RankCollective | None]:
    """NCCL kernels no call launched, when the trace has no call at all (device activity
    alone): each a collective of the rank's one group, else the default one."""
    if calls:
        return []
    mine = [g for g, ranks in groups.items() if d.rank is None or d.rank in ranks]
    group = mine[0] if len(mine) == 1 else DEFAULT_GROUP
    base, out = d.base_us, list[RankCollective | None]()
    for start, end, name_id, _, _, _, _ in d.device:
        kind = _kernel_kind(d, name_id)
        if kind is None or end < start:
            continue
        out.append(
            RankCollective(
                group,
                None,
                kind,
                0,
                "",
                _step_of(d, start),
                base + start / 1e3,
                (end - start) / 1e3,
                base + end / 1e3,
            )  # fmt: skip
        )
    return out


def _step_of(d: TraceDigest, t: int) -> int | None:
    for step, start, end in d.steps:
        if start <= t <= end:
            return step
    return None


def _int(value: Any) -> int | None:
    """``value`` as an int within +-2**62 (an int, or a string of at most 19 ASCII digits);
    None for anything else: a trace's arguments never raise here."""
    if type(value) is int and -(2**62) < value < 2**62:
        return value
    if isinstance(value, str) and len(value) <= 20 and _DIGITS.fullmatch(value.strip()):
        return _int(int(value))
    return None
