"""Cross-rank kernel aggregation for one window: pure, incremental, bounded.

Each rank's summary, or each node partial of several ranks' summaries, is folded into running
per-kernel sums when it arrives, so a top-k query costs O(kernels), not O(ranks x kernels).
Sums are integers, so the table does not depend on the order of arrival or on how the ranks
were grouped into partials. Per-rank values (for rank x kernel views) are kept as float32
blocks until ``drop_detail``; the coordinator keeps them for recent windows.
"""

from __future__ import annotations

import copy
import math
import statistics
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import msgspec

from coordinator.core.collectives import window_collectives
from coordinator.core.device_views import DeviceFigures
from coordinator.core.partial import rank_part
from coordinator.core.row_table import RowTable
from coordinator.core.saved import AggregateFile
from coordinator.core.steps import Steps, run_steps
from coordinator.protocol.collective_replies import LastArriver
from coordinator.protocol.partial_codec import NS, NodePartial, RankPart
from coordinator.protocol.summary_codec import (
    BREAKDOWN_KEYS,
    UNIT,
    Breakdown,
    HostRow,
    RankSummary,
    StreamRow,
)

if TYPE_CHECKING:  # (the reply types are for checking: their module takes 6 ms to load)
    from coordinator.protocol.replies import (
        BreakdownTable,
        KernelStats,
        KernelSummaryReply,
        MemoryStats,
        MemoryTable,
        OpDetail,
        RankStraggler,
        Stragglers,
    )

TABLES = ("kernel", "op")
"""What ``kernel_summary(by=...)`` tables: kernels (CUDA) or CPU ops, or ops by device time."""
CHEAP_RANKS = 256
"""Up to this many ranks, a window's stragglers are computed wherever they are asked for..."""
CHEAP_COLLECTIVE_BYTES = 256 * 1024
"""... and while its ranks' collectives take up to this many bytes (about 4,500 collectives:
matching them takes about 20 ms)."""
STEP_ROWS, STEP_BLOCKS, STEP_RANKS = 1024, 32, 256
"""A partial's rows, detail blocks and ranks folded in one step (each a few ms)."""
_SNAPSHOT_COPIES = (
    *("_folding", "_torn", "devices", "rank_totals", "rank_step_ms", "rank_steps"),
    "step_ms_sum",
    *("step_ranks", "rank_dropped", "bad_ranks", "breakdowns", "streams", "peak_bytes"),
    "memory_flow",
    "collectives",
    "host",
)
"""What a snapshot copies (the rest it shares: per-rank values are only ever appended to)."""
TORN = (
    "the coordinator restarted while folding this rank's node partial: the window's kernel "
    "rows count it, its own figures are lost"
)


_Block = tuple[tuple[int, ...], "tuple[int, ...] | None", bytes]
"""Per-rank values of some kernels for some ranks, ``(ranks, ids, values)``: a rank's own
summary (every kernel it ran, ``ids`` None: ``values`` by kernel id), or a node's block of a
partial (its largest kernels, ``ids`` naming the columns; a kernel outside them is not known
per rank). ``values`` is float32, rank-major: ``values[n * len(ids) + column]``.

A plain tuple of tuples and bytes: the garbage collector stops tracking it by its second pass (a
window at 10,000 ranks keeps over a thousand blocks; as objects, every full pass walked three
objects for each)."""


def _block(ranks: Sequence[int], ids: Sequence[int] | None, values: array[float]) -> _Block:
    return (tuple(ranks), None if ids is None else tuple(ids), values.tobytes())


def _fill(block: _Block, out: dict[int, float], kernel: int | None) -> None:
    """Put each of the block's ranks' value of ``kernel`` into ``out``, where it is known."""
    ranks, ids, data = block
    values = memoryview(data).cast("f")
    if ids is None:
        known = kernel is not None and kernel < len(values)
        out[ranks[0]] = float(values[kernel]) if known else 0.0  # type: ignore[index]
        return
    if kernel not in ids:
        return
    col, width = ids.index(kernel), len(ids)
    for n, rank in enumerate(ranks):
        out[rank] = float(values[n * width + col])


class WindowAggregate:
    """Per-kernel statistics over the ranks that reported one window."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.steps: tuple[int, int] | None = None
        self.partial = False
        self.devices: set[str] = set()
        self.rank_totals: dict[int, float] = {}
        self.rank_step_ms: dict[int, float] = {}  # mean step time
        self.rank_steps: dict[int, tuple[tuple[int, float], ...]] = {}  # (step, ms) each
        self.step_ms_sum: dict[int, float] = {}  # global step -> its time summed over ranks
        self.step_ranks: dict[int, int] = {}  # global step -> the ranks that timed it
        self._stragglers: tuple[tuple[int, float], Stragglers] | None = None
        self._arriver: tuple[int, LastArriver | None] | None = None  # (blocks, found)
        self.rank_dropped: dict[int, tuple[int, float]] = {}
        self.bad_ranks: dict[int, str] = {}
        self.duplicates = 0
        self.breakdowns: dict[int, tuple[float, ...]] = {}  # Breakdown's fields (pickled fast)
        self.streams: dict[int, tuple[StreamRow, ...]] = {}
        self.peak_bytes: dict[int, int] = {}
        self.memory_flow: dict[int, tuple[int, int, int]] = {}  # peak step, allocated, freed
        self.collectives: dict[int, bytes] = {}  # each rank's, as ``encode_block`` made them
        self.host: dict[int, HostRow] = {}  # DataLoader and gradient-zeroing time a step
        self._kernels = RowTable(NS)
        self._memory = RowTable(1)
        self.gpu = DeviceFigures()  # what CUDA ranks add: ops, launches, device step times
        # Per-rank values for the rank x kernel views, in blocks of ranks (see ``_Block``).
        self._detail: list[_Block] | None = []
        self._folding: set[int] = set()  # ranks of the partial being folded
        self._torn: set[int] = set()  # see ``saved``

    @property
    def ranks(self) -> list[int]:
        return sorted(self.rank_totals)

    @property
    def dropped_rows(self) -> int:
        return sum(rows for rows, _ in self.rank_dropped.values())

    @property
    def dropped_us(self) -> float:
        return math.fsum(us for _, us in self.rank_dropped.values())

    def add(self, summary: RankSummary) -> bool:
        """Fold in one rank's summary; False (and nothing changes) for a repeat."""
        if summary.window != self.window:
            self.duplicates += 1
            return False
        if self._taken(summary.rank):
            self.duplicates += 1
            return False
        self._add_rank(rank_part(summary))
        values = self._kernels.add_rank(
            summary.rank, ((k.name, k.self_us, k.count) for k in summary.kernels)
        )
        if summary.peak_bytes is not None:
            rows = ((m.name, float(m.bytes), m.count) for m in summary.memory)
            self._memory.add_rank(summary.rank, rows)
        self.gpu.add_ops(summary.rank, summary.ops)
        if self._detail is not None:
            self._detail.append(_block([summary.rank], None, values))
        return True

    def add_partial(self, p: NodePartial) -> list[int] | None:
        """``add_partial_steps`` at once: the kernel row ids of its rows, or None."""
        return run_steps(self.add_partial_steps(p))

    def add_partial_steps(self, p: NodePartial) -> Steps[list[int] | None]:
        """Fold in a node partial in steps (``_partial_steps``)."""
        return _partial_steps(self, p)

    def _taken(self, rank: int) -> bool:  # (in, being folded in, or torn by a restart)
        return rank in self.rank_totals or rank in self._folding or rank in self._torn

    def _add_rank(self, part: RankPart) -> None:
        rank = part.rank
        self.bad_ranks.pop(rank, None)
        if self.steps is None:
            self.steps = part.steps
        self.partial = self.partial or part.partial
        self.devices.add(part.device)
        self.rank_totals[rank] = part.total_us
        self.gpu.add_rank(part)
        step_us = self.gpu.step_times(part)
        if step_us:
            self.rank_step_ms[rank] = statistics.fmean(us for _, us in step_us) / 1e3
            self.rank_steps[rank] = tuple((step, us / 1e3) for step, us in step_us)
            sums, counts = self.step_sums()
            for step, us in step_us:
                sums[step] = sums.get(step, 0.0) + us / 1e3
                counts[step] = counts.get(step, 0) + 1
        self.rank_dropped[rank] = part.dropped
        self.breakdowns[rank] = tuple(part.breakdown)
        if part.streams:
            self.streams[rank] = tuple(part.streams)
        if part.peak_bytes is not None:
            self.peak_bytes[rank] = part.peak_bytes
            if part.memory_flow is not None:
                self.memory_flow[rank] = tuple(part.memory_flow)  # type: ignore[assignment]
        if part.collectives is not None:
            self.collectives[rank] = part.collectives
        if part.host is not None:
            self.host[rank] = part.host

    def step_sums(self) -> tuple[dict[int, float], dict[int, int]]:
        """Each recorded step's time summed over ranks, and how many ranks timed it (made on
        first use: a checkpoint from before has neither)."""
        if not hasattr(self, "step_ms_sum"):
            self.step_ms_sum, self.step_ranks = {}, {}
        return self.step_ms_sum, self.step_ranks

    def drop_detail(self) -> None:
        """Forget per-rank values (the running statistics stay)."""
        self._detail = None

    def per_rank(self, names: list[str]) -> dict[str, dict[int, float]] | None:
        """Self time of each named kernel on each reporting rank, or None once dropped.

        A rank folded into a node partial has a value for its node's largest kernels
        (``MAX_PARTIAL_TOP``); it is left out of the others.
        """
        if self._detail is None:
            return None
        out: dict[str, dict[int, float]] = {name: {} for name in names}
        wanted = [(name, self._kernels.ids.get(name)) for name in names]
        for block in self._detail:
            for name, i in wanted:
                _fill(block, out[name], i)
        return {name: dict(sorted(by_rank.items())) for name, by_rank in out.items()}

    def stragglers(self, threshold: float) -> Stragglers:
        """Each rank's mean step time and compute time relative to the median over ranks.

        In a collective the fast ranks wait for the slow one, so communication time marks the
        victims: the culprit is the rank whose compute time is high. A rank is flagged when its
        step or compute ratio exceeds ``threshold``; ``comm_ms`` shows the waiting beside it.
        Kept until another rank arrives: every ``status()`` shows each window's stragglers.
        """
        key = (len(self.rank_totals), threshold)
        if self._stragglers is None or self._stragglers[0] != key:
            self._stragglers = (key, find_stragglers(self, threshold))
        return self._stragglers[1]

    @property
    def cheap(self) -> bool:
        """Whether its stragglers are cheap enough to compute on the event loop (else they are
        found off it: ``service/straggler_refresh.py``)."""
        if len(self.rank_totals) > CHEAP_RANKS:
            return False
        return sum(map(len, self.collectives.values())) <= CHEAP_COLLECTIVE_BYTES

    @property
    def stragglers_known(self) -> bool:
        """Whether the stragglers of the ranks in so far have been computed."""
        return self._stragglers is not None and self._stragglers[0][0] == len(self.rank_totals)

    def flagged(self, threshold: float) -> list[int] | None:
        """The flagged stragglers; None when they would have to be computed and the window has
        over ``CHEAP_RANKS`` ranks (``stragglers()`` then runs off the event loop)."""
        found = self.known_stragglers(threshold)
        return found["flagged"] if found is not None else None

    def known_stragglers(self, threshold: float) -> Stragglers | None:
        """The stragglers, if known or cheap (``cheap``); else None."""
        key = (len(self.rank_totals), threshold)
        if self._stragglers is not None and self._stragglers[0] == key:
            return self._stragglers[1]
        return self.stragglers(threshold) if self.cheap else None

    def snapshot(self) -> WindowAggregate:
        """A copy that later folds do not change, to read off the event loop (O(ranks) of
        C-speed copies, the per-rank values shared: they are only ever appended to), with the
        stragglers found so far (a tuple keyed by the rank count, replaced when found again)."""
        self.step_sums()  # (a checkpoint from before has none)
        snap = WindowAggregate.__new__(WindowAggregate)  # (copy.copy would go through
        snap.__dict__.update(self.__dict__)  # a restore)
        for name in _SNAPSHOT_COPIES:
            setattr(snap, name, copy.copy(getattr(self, name)))
        snap._kernels, snap._memory = self._kernels.copy(), self._memory.copy()
        snap.gpu = self.gpu.copy()
        snap._detail = list(self._detail) if self._detail is not None else None
        return snap

    def keep_stragglers(self, snap: WindowAggregate) -> None:
        """Keep the stragglers ``snap`` (a snapshot of this aggregate) computed, if no rank has
        arrived since."""
        if snap._stragglers is not None and snap._stragglers[0][0] == len(self.rank_totals):
            self._stragglers = snap._stragglers

    def mark_bad(self, rank: int, reason: str) -> None:
        """A rank whose summary for this window could not be used."""
        if rank not in self.rank_totals:
            self.bad_ranks[rank] = reason

    @property
    def device(self) -> str | None:
        if not self.devices:
            return None
        return next(iter(self.devices)) if len(self.devices) == 1 else "mixed"

    def top(self, k: int) -> list[dict[str, Any]]:
        """The ``k`` kernels with the largest total self time over ranks."""
        return self._kernels.top(
            k, len(self.rank_totals), math.fsum(self.rank_totals.values()), "us"
        )

    def breakdown(self) -> BreakdownTable:
        """Per rank and on average: compute, comm, memcpy and other time, and shares."""
        ranks = {
            r: _breakdown_row(Breakdown(*b), self.host.get(r))
            for r, b in sorted(self.breakdowns.items())
        }
        n = len(ranks)
        mean = (
            {key: sum(row.get(key, 0.0) for row in ranks.values()) / n for key in _keys(ranks)}
            if n
            else {}
        )
        return {"ranks": ranks, "mean": mean}

    def memory(self, k: int) -> MemoryTable | None:
        """Peak allocated bytes per rank and the top allocating ops across ranks."""
        if not self.peak_bytes:
            return None
        n = len(self.peak_bytes)
        max_peak = max(self.peak_bytes.values())
        grand = float(sum(self._memory.total))
        flow = {r: self.memory_flow.get(r) for r in sorted(self.peak_bytes)}
        return {
            "peak_bytes": dict(sorted(self.peak_bytes.items())),
            "max_peak_bytes": max(self.peak_bytes.values()),
            "max_peak_rank": min(r for r, b in self.peak_bytes.items() if b == max_peak),
            "peak_step": {
                r: f[0] if f is not None and f[0] >= 0 else None for r, f in flow.items()
            },
            "allocated_bytes": {r: f[1] if f is not None else None for r, f in flow.items()},
            "freed_bytes": {r: f[2] if f is not None else None for r, f in flow.items()},
            "ops": cast("list[MemoryStats]", self._memory.top(k, n, grand, "bytes")),
        }

    def to_dict(
        self,
        top_k: int,
        straggler_threshold: float = 1.25,
        per_rank: bool = False,
        by: str = "kernel",
    ) -> KernelSummaryReply:
        """The ``kernel_summary`` answer for this window (the caller fills in ``run``,
        ``closed``, ``summaries_pending`` and ``trainer_id``). ``by="op"``: on a window with
        CUDA ranks the op table (device time by the CPU op that launched it, ``ops`` holding
        each op's CPU time and kernels); on a CPU window the same table as ``by="kernel"``."""
        ops: dict[str, OpDetail] | None = None
        if by == "op" and "cuda" in self.devices:
            grand = math.fsum(self.rank_totals.values())
            rows, ops = self.gpu.op_table(top_k, len(self.rank_totals), grand)
            kernels = cast("list[KernelStats]", rows)
            per_rank = False  # (per-rank values are kept for kernels only)
        else:
            kernels = cast("list[KernelStats]", self.top(top_k))
            if by == "op":
                ops = {k["name"]: {"cpu_us": k["total_us"], "kernels": []} for k in kernels}
        reply: KernelSummaryReply = {
            "run": "",
            "window": self.window,
            "steps": list(self.steps) if self.steps else [],
            "partial": self.partial,
            "closed": False,
            "ranks": self.ranks,
            "summaries_pending": [],
            "bad_ranks": {int(r): why for r, why in sorted(self.bad_ranks.items())},
            "device": self.device,
            "unit": UNIT,
            "kernels": kernels,
            "rank_totals": {int(r): t for r, t in sorted(self.rank_totals.items())},
            "dropped": {"rows": self.dropped_rows, "us": self.dropped_us},
            "stragglers": self.stragglers(straggler_threshold),
            "breakdown": self.breakdown(),
            "streams": {
                int(r): [msgspec.structs.asdict(row) for row in rows]
                for r, rows in sorted(self.streams.items())
            },
            "memory": self.memory(top_k),
            "per_rank": self.per_rank([k["name"] for k in kernels]) if per_rank else None,
            "trainer_id": None,
            "role": None,
            "by": by,
            "ops": ops,
            "launch": self.gpu.launches(),
            "unattributed_us": dict(sorted(self.gpu.unattributed.items())),
            "device_steps": self.gpu.device_steps(),
            "rank_steps": self.step_strip() if per_rank else None,
        }
        return self.gpu.with_rows(reply)

    def step_strip(self) -> dict[int, list[list[float]]]:
        """Each rank's recorded steps, ``[step, ms]``: the times its stragglers are judged by
        (a CUDA rank's device span per step, else its CPU step)."""
        return {int(r): [[s, ms] for s, ms in self.rank_steps[r]] for r in sorted(self.rank_steps)}


def _partial_steps(agg: WindowAggregate, p: NodePartial) -> Steps[list[int] | None]:
    """Fold in a node partial; None (and nothing changes) when the window is another or a rank
    of it is already in; else the kernel row ids of its rows. In steps of bounded work (a
    relay's partial can hold thousands of ranks): the caller may let its event loop go at
    each one. The rows go in first and the ranks last: once a view lists a rank, its rows are
    in (between two steps, a view may count rows of ranks it does not list yet)."""
    folding = agg._folding
    if p.window != agg.window or any(agg._taken(part.rank) for part in p.ranks):
        agg.duplicates += 1
        return None
    folding.update(part.rank for part in p.ranks)  # (a repeat meanwhile is refused)
    ids: list[int] = []
    for i in range(0, len(p.kernels), STEP_ROWS):
        ids += agg._kernels.merge(p.kernels[i : i + STEP_ROWS])
        yield
    agg._memory.merge(p.memory)
    agg.gpu.merge_ops(p)
    if agg._detail is not None:
        for n, block in enumerate(p.detail):
            names = [agg._kernels.id_of(name) for name in block.names]
            agg._detail.append(_block(block.ranks, names, array("f", block.values)))
            if n % STEP_BLOCKS == STEP_BLOCKS - 1:
                yield
    for n, part in enumerate(p.ranks):
        agg._add_rank(part)
        folding.discard(part.rank)
        if n % STEP_RANKS == STEP_RANKS - 1:
            yield
    return ids


def step_ms(agg: WindowAggregate) -> dict[int, float]:
    """Each recorded step's mean time over the ranks that timed it, in ms."""
    sums, counts = agg.step_sums()
    return {s: round(sums[s] / counts[s], 3) for s in sorted(sums)}


def busy_ms_per_step(agg: WindowAggregate) -> tuple[float, float] | None:
    """The self time per recorded step of every op and kernel, in ms: mean and max over the
    ranks (None before any summary)."""
    if not agg.rank_totals or agg.steps is None:
        return None
    n = max(1, agg.steps[1] - agg.steps[0] + 1)
    per = [us / n / 1e3 for us in agg.rank_totals.values()]
    return round(statistics.fmean(per), 3), round(max(per), 3)


def empty_summary() -> KernelSummaryReply:
    """The ``kernel_summary`` answer before any window has closed."""
    return {
        "run": "",
        "window": None,
        "steps": [],
        "partial": False,
        "closed": False,
        "ranks": [],
        "summaries_pending": [],
        "bad_ranks": {},
        "device": None,
        "unit": UNIT,
        "kernels": [],
        "rank_totals": {},
        "dropped": {"rows": 0, "us": 0.0},
        "stragglers": {
            "threshold": None,
            "median_step_ms": 0.0,
            "median_compute_ms": 0.0,
            "ranks": {},
            "flagged": [],
            "launch_bound": [],
            "last_arriver": None,
        },
        "breakdown": {"ranks": {}, "mean": {}},
        "streams": {},
        "memory": None,
        "per_rank": None,
        "trainer_id": None,
        "role": None,
        "by": "kernel",
        "ops": None,
        "launch": {},
        "unattributed_us": {},
        "device_steps": {},
        "rank_steps": None,
    }


def find_stragglers(agg: WindowAggregate, threshold: float) -> Stragglers:
    """See ``WindowAggregate.stragglers``."""
    step_ms = agg.rank_step_ms
    compute_ms = {r: _compute_us(agg, r) / 1e3 for r in agg.rank_totals}
    med_step = statistics.median(step_ms.values()) if step_ms else 0.0
    med_compute = statistics.median(compute_ms.values()) if compute_ms else 0.0
    ranks: dict[int, RankStraggler] = {}
    for r in sorted(compute_ms):
        s = step_ms.get(r)
        s_ratio = s / med_step if s is not None and med_step > 0 else None
        c_ratio = compute_ms[r] / med_compute if med_compute > 0 else None
        b = _breakdown(agg, r)
        ranks[r] = {
            "step_ms": s,
            "step_ratio": s_ratio,
            "compute_ms": compute_ms[r],
            "compute_ratio": c_ratio,
            "comm_ms": b.comm_us / 1e3 if b is not None else None,
            "comm_share": b.share("comm") if b is not None else None,
            "flagged": any(x is not None and x > threshold for x in (s_ratio, c_ratio)),
            "launch_bound": list(agg.gpu.launch_bound.get(r, ())),
        }
    return {
        "threshold": threshold,
        "median_step_ms": med_step,
        "median_compute_ms": med_compute,
        "ranks": ranks,
        "flagged": [r for r, v in ranks.items() if v["flagged"]],
        "launch_bound": [r for r, v in ranks.items() if v["launch_bound"]],
        "last_arriver": judged_arriver(arriver_now(agg), ranks, threshold),
    }


def arriver_now(agg: WindowAggregate) -> LastArriver | None:
    """The rank the others waited for in collectives (``find_arriver``), matched again only
    when ranks' collectives came in since it was: here when ``agg.cheap``, else as last found
    off the event loop (``service/straggler_refresh.py``), None before."""
    if arriver_known(agg):
        return agg._arriver[1] if agg._arriver is not None else None
    if agg.cheap:
        agg._arriver = (len(agg.collectives), find_arriver(agg))
        return agg._arriver[1]
    return agg._arriver[1] if agg._arriver is not None else None


def arriver_known(agg: WindowAggregate) -> bool:
    """Whether the last arriver of the ranks' collectives in so far has been found."""
    return agg._arriver is not None and agg._arriver[0] == len(agg.collectives)


def keep_arriver(agg: WindowAggregate, snap: WindowAggregate, found: LastArriver | None) -> None:
    """Keep what ``find_arriver(snap)`` found (``snap`` a snapshot of ``agg``), also in the
    stragglers kept."""
    agg._arriver = (len(snap.collectives), found)
    if agg._stragglers is not None:
        s = agg._stragglers[1]
        s["last_arriver"] = judged_arriver(found, s["ranks"], s["threshold"] or 0.0)


def find_arriver(agg: WindowAggregate) -> LastArriver | None:
    """The rank the others waited for in the window's collectives (``collectives.
    last_arriver``, over every matched collective): O(ranks x collectives), about 1 s of CPU at
    1,024 ranks with 200 each."""
    if not agg.collectives:
        return None
    blocks = {r: agg.collectives.get(r) for r in agg.rank_totals}
    step = statistics.median(agg.rank_step_ms.values()) if agg.rank_step_ms else None
    return window_collectives(blocks, None, shown=0, step_ms=step)["last_arriver"]


def judged_arriver(
    arriver: LastArriver | None, ranks: dict[int, RankStraggler], threshold: float
) -> LastArriver | None:
    """``arriver`` set against the compute stragglers: whether they flag it too, and when
    not, why the two can differ (a copy)."""
    if arriver is None:
        return None
    found = LastArriver(**arriver)
    mine = ranks.get(found["rank"])
    found["agrees"] = bool(mine and mine["flagged"])
    if not found["agrees"]:
        flagged = [r for r, v in ranks.items() if v["flagged"]]
        found["note"] = (
            f"the compute times flag rank(s) {', '.join(map(str, flagged))}: a rank can be slow "
            "in ops before one collective and on time for the next"
            if flagged
            else f"no rank's compute time is over {threshold}x the median: rank "
            f"{found['rank']} is late for time outside its recorded ops (a sleep, data loading, "
            "the host, another process)"
        )
    return found


def _breakdown(agg: WindowAggregate, rank: int) -> Breakdown | None:
    fields = agg.breakdowns.get(rank)
    return Breakdown(*fields) if fields is not None else None


def _compute_us(agg: WindowAggregate, rank: int) -> float:
    b = _breakdown(agg, rank)
    if b is not None and b.window_us > 0:
        return b.compute_us
    return agg.rank_totals[rank]  # no breakdown: every op's self time


def _keys(rows: dict[int, dict[str, float]]) -> list[str]:
    """The keys of ``rows``, in their first row's order, then the host keys where any has them
    (a rank without them counts 0 in the mean)."""
    keys = list(next(iter(rows.values())))
    return keys + [k for k in HOST_KEYS if k not in keys and any(k in r for r in rows.values())]


HOST_KEYS = (
    *("dataloader_us_per_step", "zero_grad_us_per_step", "optimizer_us_per_step"),
    *("optimizer_loop_ops_per_step", "optimizer_foreach_ops_per_step", "cpu_wait_us_per_step"),
)
"""The breakdown row's keys of a rank's host time (``HostRow``), where its summary has it."""


def _breakdown_row(b: Breakdown, host: HostRow | None = None) -> dict[str, float]:
    row = {f"{k}_us": getattr(b, f"{k}_us") for k in BREAKDOWN_KEYS}
    row["window_us"] = b.window_us
    row.update({f"{k}_share": b.share(k) for k in BREAKDOWN_KEYS})
    # CUDA: communication with compute running beside it, and its share of communication
    # (HTA's comp_comm_overlap_pctg / 100).
    row["overlap_us"] = b.overlap_us
    row["comm_overlap"] = b.overlap_us / b.comm_us if b.comm_us > 0 else 0.0
    if host is not None:  # (the findings' dataloader and zero_grad rules read them)
        row["dataloader_us_per_step"] = host.dataloader_us
        row["zero_grad_us_per_step"] = host.zero_grad_us
        if host.optimizer_us:  # (optimizer_foreach reads them)
            row["optimizer_us_per_step"] = host.optimizer_us
            row["optimizer_loop_ops_per_step"] = host.optimizer_loop_ops
            row["optimizer_foreach_ops_per_step"] = host.optimizer_foreach_ops
        if host.cpu_wait_us is not None:  # (host_contention reads it; None: not measured)
            row["cpu_wait_us_per_step"] = host.cpu_wait_us
    return row


def saved_aggregate(agg: WindowAggregate, detail: bool = True) -> AggregateFile:
    """``agg``'s figures as saved (``detail``: the per-rank values too, while kept; they are
    the bulk of a window at scale, and only the rank x kernel views need them). A partial
    being folded is saved as far as it got: its rows are in, so its ranks are saved as torn
    (bad, and refused from then on: a summary of theirs sent again would count twice)."""
    step_ms_sum, step_ranks = agg.step_sums()
    folding = set(agg._folding)
    return AggregateFile(
        window=agg.window, steps=agg.steps, partial=agg.partial, devices=set(agg.devices),
        rank_totals=dict(agg.rank_totals), rank_step_ms=dict(agg.rank_step_ms),
        rank_steps=dict(agg.rank_steps), step_ms_sum=dict(step_ms_sum),
        step_ranks=dict(step_ranks), rank_dropped=dict(agg.rank_dropped),
        bad_ranks={**agg.bad_ranks, **dict.fromkeys(folding, TORN)}, duplicates=agg.duplicates,
        breakdowns=dict(agg.breakdowns), streams=dict(agg.streams),
        peak_bytes=dict(agg.peak_bytes), kernels=agg._kernels.saved(),
        memory=agg._memory.saved(), gpu=agg.gpu.saved(),
        detail=list(agg._detail) if detail and agg._detail is not None else None,
        torn=agg._torn | folding, memory_flow=dict(agg.memory_flow),
        collectives=dict(agg.collectives), host=dict(agg.host),
    )  # fmt: skip


def restored_aggregate(f: AggregateFile) -> WindowAggregate:
    """The aggregate ``saved_aggregate`` made (``SavedError`` for a table that does not add
    up)."""
    agg = WindowAggregate(f.window)
    agg.steps, agg.partial, agg.devices = f.steps, f.partial, set(f.devices)
    agg.rank_totals, agg.rank_step_ms = dict(f.rank_totals), dict(f.rank_step_ms)
    agg.rank_steps, agg.rank_dropped = dict(f.rank_steps), dict(f.rank_dropped)
    agg.step_ms_sum, agg.step_ranks = dict(f.step_ms_sum), dict(f.step_ranks)
    agg.bad_ranks, agg.duplicates = dict(f.bad_ranks), f.duplicates
    agg.breakdowns, agg.streams = dict(f.breakdowns), dict(f.streams)
    agg.peak_bytes, agg.memory_flow = dict(f.peak_bytes), dict(f.memory_flow)
    agg._kernels, agg._memory = RowTable.from_saved(f.kernels), RowTable.from_saved(f.memory)
    agg.gpu = DeviceFigures.from_saved(f.gpu)
    agg._detail = list(f.detail) if f.detail is not None else None
    agg._torn = set(f.torn)
    agg.collectives = dict(f.collectives)
    agg.host = dict(f.host)
    return agg
