"""Cross-rank kernel aggregation for one window: pure, incremental, bounded.

Each rank's summary is folded into running per-kernel sums when it arrives, so a top-k query
costs O(kernels), not O(ranks x kernels). Per-rank values (for rank x kernel views) are kept as
one float32 array per rank until ``drop_detail``; the coordinator keeps them for recent windows.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import statistics
from array import array
from typing import Any, cast

from coordinator.protocol.replies import (
    BreakdownTable,
    KernelStats,
    KernelSummaryReply,
    MemoryStats,
    MemoryTable,
    RankStraggler,
    Stragglers,
)
from coordinator.protocol.summary_codec import (
    BREAKDOWN_KEYS,
    UNIT,
    Breakdown,
    RankSummary,
    StreamRow,
)


class _Table:
    """Running per-name statistics over ranks: one row per op, kernel or allocating op."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.names: list[str] = []
        self.total: list[float] = []
        self.sumsq: list[float] = []
        self.max: list[float] = []
        self.max_rank: list[int] = []
        self.min_present: list[float] = []
        self.present: list[int] = []
        self.count: list[int] = []

    def add(self, rank: int, rows: list[tuple[str, float, int]]) -> array[float]:
        """Fold one rank's ``(name, value, count)`` rows in; returns its values by row id."""
        ids, names = self.ids, self.names
        row = array("f")
        for name, v, count in rows:
            i = ids.get(name)
            if i is None:
                i = ids[name] = len(names)
                names.append(name)
                self.total.append(0.0)
                self.sumsq.append(0.0)
                self.max.append(-1.0)
                self.max_rank.append(rank)
                self.min_present.append(math.inf)
                self.present.append(0)
                self.count.append(0)
            self.total[i] += v
            self.sumsq[i] += v * v
            if v > self.max[i]:
                self.max[i], self.max_rank[i] = v, rank
            if v < self.min_present[i]:
                self.min_present[i] = v
            self.present[i] += 1
            self.count[i] += count
            if len(row) <= i:
                row.extend([0.0] * (i + 1 - len(row)))
            row[i] += v
        return row

    def top(self, k: int, n: int, grand: float, unit: str) -> list[dict[str, Any]]:
        """The ``k`` rows with the largest total over the ``n`` reporting ranks."""
        if n == 0 or k <= 0:
            return []
        order = heapq.nlargest(k, range(len(self.names)), key=self.total.__getitem__)
        rows = []
        for i in order:
            total = self.total[i]
            mean = total / n
            var = max(0.0, self.sumsq[i] / n - mean * mean)  # absent ranks count as 0
            rows.append(
                {
                    "name": self.names[i],
                    f"total_{unit}": total,
                    f"mean_{unit}": mean,
                    f"min_{unit}": self.min_present[i] if self.present[i] == n else 0.0,
                    f"max_{unit}": self.max[i],
                    f"std_{unit}": math.sqrt(var),
                    "max_rank": self.max_rank[i],
                    "count": self.count[i],
                    "ranks_present": self.present[i],
                    "share": total / (grand or 1.0),
                }
            )
        return rows


class WindowAggregate:
    """Per-kernel statistics over the ranks that reported one window."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.steps: tuple[int, int] | None = None
        self.partial = False
        self.devices: set[str] = set()
        self.rank_totals: dict[int, float] = {}
        self.rank_step_us: dict[int, list[tuple[int, float]]] = {}
        self.bad_ranks: dict[int, str] = {}
        self.dropped_rows = 0
        self.dropped_us = 0.0
        self.duplicates = 0
        self.breakdowns: dict[int, Breakdown] = {}
        self.streams: dict[int, list[StreamRow]] = {}
        self.peak_bytes: dict[int, int] = {}
        self._kernels = _Table()
        self._memory = _Table()
        self._detail: dict[int, array[float]] | None = {}  # rank -> self time by kernel id

    @property
    def ranks(self) -> list[int]:
        return sorted(self.rank_totals)

    def add(self, summary: RankSummary) -> bool:
        """Fold in one rank's summary; False (and nothing changes) for a repeat."""
        rank = summary.rank
        if rank in self.rank_totals or summary.window != self.window:
            self.duplicates += 1
            return False
        self.bad_ranks.pop(rank, None)
        if self.steps is None:
            self.steps = summary.steps
        self.partial = self.partial or summary.partial
        self.devices.add(summary.device)
        self.rank_totals[rank] = summary.total_us
        self.rank_step_us[rank] = list(summary.step_us)
        self.dropped_rows += summary.dropped_rows
        self.dropped_us += summary.dropped_us
        self.breakdowns[rank] = summary.breakdown
        if summary.streams:
            self.streams[rank] = list(summary.streams)
        if summary.peak_bytes is not None:
            self.peak_bytes[rank] = summary.peak_bytes
            self._memory.add(rank, [(m.name, float(m.bytes), m.count) for m in summary.memory])
        row = self._kernels.add(rank, [(k.name, k.self_us, k.count) for k in summary.kernels])
        if self._detail is not None:
            self._detail[rank] = row
        return True

    def drop_detail(self) -> None:
        """Forget per-rank values (the running statistics stay)."""
        self._detail = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (the coordinator's checkpoint) without the per-rank values: they are the
        bulk of a window at scale, and only the rank x kernel views need them."""
        state = dict(self.__dict__)
        state["_detail"] = None
        return state

    def per_rank(self, names: list[str]) -> dict[str, dict[int, float]] | None:
        """Self time of each named kernel on each reporting rank, or None once dropped."""
        if self._detail is None:
            return None
        out = {}
        for name in names:
            i = self._kernels.ids.get(name)
            out[name] = {
                r: (float(row[i]) if i is not None and i < len(row) else 0.0)
                for r, row in sorted(self._detail.items())
            }
        return out

    def stragglers(self, threshold: float) -> Stragglers:
        """Each rank's mean step time and compute time relative to the median over ranks.

        In a collective the fast ranks wait for the slow one, so communication time marks the
        victims: the culprit is the rank whose compute time is high. A rank is flagged when its
        step or compute ratio exceeds ``threshold``; ``comm_ms`` shows the waiting beside it.
        """
        step_ms = {
            r: statistics.fmean(us for _, us in steps) / 1e3
            for r, steps in self.rank_step_us.items()
            if steps
        }
        compute_ms = {r: self._compute_us(r) / 1e3 for r in self.rank_totals}
        med_step = statistics.median(step_ms.values()) if step_ms else 0.0
        med_compute = statistics.median(compute_ms.values()) if compute_ms else 0.0
        ranks: dict[int, RankStraggler] = {}
        for r in sorted(compute_ms):
            s = step_ms.get(r)
            s_ratio = s / med_step if s is not None and med_step > 0 else None
            c_ratio = compute_ms[r] / med_compute if med_compute > 0 else None
            b = self.breakdowns.get(r)
            ranks[r] = {
                "step_ms": s,
                "step_ratio": s_ratio,
                "compute_ms": compute_ms[r],
                "compute_ratio": c_ratio,
                "comm_ms": b.comm_us / 1e3 if b is not None else None,
                "comm_share": b.share("comm") if b is not None else None,
                "flagged": any(x is not None and x > threshold for x in (s_ratio, c_ratio)),
            }
        return {
            "threshold": threshold,
            "median_step_ms": med_step,
            "median_compute_ms": med_compute,
            "ranks": ranks,
            "flagged": [r for r, v in ranks.items() if v["flagged"]],
        }

    def _compute_us(self, rank: int) -> float:
        b = self.breakdowns.get(rank)
        if b is not None and b.window_us > 0:
            return b.compute_us
        return self.rank_totals[rank]  # no breakdown: every op's self time

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
        return self._kernels.top(k, len(self.rank_totals), sum(self.rank_totals.values()), "us")

    def breakdown(self) -> BreakdownTable:
        """Per rank and on average: compute, comm, memcpy and other time, and shares."""
        ranks = {r: _breakdown_row(b) for r, b in sorted(self.breakdowns.items())}
        n = len(ranks)
        mean = (
            {key: sum(row[key] for row in ranks.values()) / n for key in next(iter(ranks.values()))}
            if n
            else {}
        )
        return {"ranks": ranks, "mean": mean}

    def memory(self, k: int) -> MemoryTable | None:
        """Peak allocated bytes per rank and the top allocating ops across ranks."""
        if not self.peak_bytes:
            return None
        n = len(self.peak_bytes)
        grand = sum(self._memory.total)
        return {
            "peak_bytes": dict(sorted(self.peak_bytes.items())),
            "max_peak_bytes": max(self.peak_bytes.values()),
            "max_peak_rank": max(self.peak_bytes, key=self.peak_bytes.__getitem__),
            "ops": cast(list[MemoryStats], self._memory.top(k, n, grand, "bytes")),
        }

    def to_dict(
        self, top_k: int, straggler_threshold: float = 1.25, per_rank: bool = False
    ) -> KernelSummaryReply:
        """The ``kernel_summary`` answer for this window (the caller fills in ``run``,
        ``closed``, ``summaries_pending`` and ``trainer_id``)."""
        kernels = cast(list[KernelStats], self.top(top_k))
        return {
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
                int(r): [dataclasses.asdict(row) for row in rows]
                for r, rows in sorted(self.streams.items())
            },
            "memory": self.memory(top_k),
            "per_rank": self.per_rank([k["name"] for k in kernels]) if per_rank else None,
            "trainer_id": None,
        }


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
        },
        "breakdown": {"ranks": {}, "mean": {}},
        "streams": {},
        "memory": None,
        "per_rank": None,
        "trainer_id": None,
    }


def _breakdown_row(b: Breakdown) -> dict[str, float]:
    row = {f"{k}_us": getattr(b, f"{k}_us") for k in BREAKDOWN_KEYS}
    row["window_us"] = b.window_us
    row.update({f"{k}_share": b.share(k) for k in BREAKDOWN_KEYS})
    return row
