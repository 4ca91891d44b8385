"""Cross-rank kernel aggregation for one window: pure, incremental, bounded.

Each rank's summary is folded into running per-kernel sums when it arrives, so a top-k query
costs O(kernels), not O(ranks x kernels). Per-rank values (for rank x kernel views) are kept as
one float32 array per rank until ``drop_detail``; the coordinator keeps them for recent windows.
"""

from __future__ import annotations

import heapq
import math
import statistics
from array import array
from typing import Any

from coordinator.summary_codec import UNIT, RankSummary


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
        self._ids: dict[str, int] = {}
        self._names: list[str] = []
        self._total: list[float] = []
        self._sumsq: list[float] = []
        self._max: list[float] = []
        self._max_rank: list[int] = []
        self._min_present: list[float] = []
        self._present: list[int] = []
        self._count: list[int] = []
        self._detail: dict[int, array] | None = {}  # rank -> self time by kernel id

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
        ids, names = self._ids, self._names
        row = array("f")
        for k in summary.kernels:
            i = ids.get(k.name)
            if i is None:
                i = ids[k.name] = len(names)
                names.append(k.name)
                self._total.append(0.0)
                self._sumsq.append(0.0)
                self._max.append(-1.0)
                self._max_rank.append(rank)
                self._min_present.append(math.inf)
                self._present.append(0)
                self._count.append(0)
            v = k.self_us
            self._total[i] += v
            self._sumsq[i] += v * v
            if v > self._max[i]:
                self._max[i], self._max_rank[i] = v, rank
            if v < self._min_present[i]:
                self._min_present[i] = v
            self._present[i] += 1
            self._count[i] += k.count
            if len(row) <= i:
                row.extend([0.0] * (i + 1 - len(row)))
            row[i] += v
        if self._detail is not None:
            self._detail[rank] = row
        return True

    def drop_detail(self) -> None:
        """Forget per-rank values (the running statistics stay)."""
        self._detail = None

    def per_rank(self, names: list[str]) -> dict[str, dict[int, float]] | None:
        """Self time of each named kernel on each reporting rank, or None once dropped."""
        if self._detail is None:
            return None
        out = {}
        for name in names:
            i = self._ids.get(name)
            out[name] = {
                r: (float(row[i]) if i is not None and i < len(row) else 0.0)
                for r, row in sorted(self._detail.items())
            }
        return out

    def stragglers(self, threshold: float) -> dict[str, Any]:
        """Each rank's mean step time and kernel-time total relative to the median over ranks.

        A rank is flagged when either ratio exceeds ``threshold``.
        """
        step_ms = {
            r: statistics.fmean(us for _, us in steps) / 1e3
            for r, steps in self.rank_step_us.items()
            if steps
        }
        kernel_ms = {r: t / 1e3 for r, t in self.rank_totals.items()}
        med_step = statistics.median(step_ms.values()) if step_ms else 0.0
        med_kernel = statistics.median(kernel_ms.values()) if kernel_ms else 0.0
        ranks = {}
        for r in sorted(kernel_ms):
            s = step_ms.get(r)
            s_ratio = s / med_step if s is not None and med_step > 0 else None
            k_ratio = kernel_ms[r] / med_kernel if med_kernel > 0 else None
            flagged = any(x is not None and x > threshold for x in (s_ratio, k_ratio))
            ranks[r] = {
                "step_ms": s,
                "step_ratio": s_ratio,
                "kernel_ms": kernel_ms[r],
                "kernel_ratio": k_ratio,
                "flagged": flagged,
            }
        return {
            "threshold": threshold,
            "median_step_ms": med_step,
            "median_kernel_ms": med_kernel,
            "ranks": ranks,
            "flagged": [r for r, v in ranks.items() if v["flagged"]],
        }

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
        n = len(self.rank_totals)
        if n == 0 or k <= 0:
            return []
        grand = sum(self.rank_totals.values()) or 1.0
        order = heapq.nlargest(k, range(len(self._names)), key=self._total.__getitem__)
        rows = []
        for i in order:
            total = self._total[i]
            mean = total / n
            var = max(0.0, self._sumsq[i] / n - mean * mean)  # absent ranks count as 0
            rows.append(
                {
                    "name": self._names[i],
                    "total_us": total,
                    "mean_us": mean,
                    "min_us": self._min_present[i] if self._present[i] == n else 0.0,
                    "max_us": self._max[i],
                    "std_us": math.sqrt(var),
                    "max_rank": self._max_rank[i],
                    "count": self._count[i],
                    "ranks_present": self._present[i],
                    "share": total / grand,
                }
            )
        return rows

    def to_dict(
        self, top_k: int, straggler_threshold: float = 1.25, per_rank: bool = False
    ) -> dict[str, Any]:
        """The ``kernel_summary`` answer for this window."""
        kernels = self.top(top_k)
        out = {
            "window": self.window,
            "steps": list(self.steps) if self.steps else [],
            "partial": self.partial,
            "ranks": self.ranks,
            "bad_ranks": {int(r): why for r, why in sorted(self.bad_ranks.items())},
            "device": self.device,
            "unit": UNIT,
            "kernels": kernels,
            "rank_totals": {int(r): t for r, t in sorted(self.rank_totals.items())},
            "dropped": {"rows": self.dropped_rows, "us": self.dropped_us},
            "stragglers": self.stragglers(straggler_threshold),
        }
        if per_rank:
            out["per_rank"] = self.per_rank([k["name"] for k in kernels])
        return out


def empty_summary() -> dict[str, Any]:
    """The ``kernel_summary`` answer before any window has closed."""
    return {
        "window": None,
        "steps": [],
        "partial": False,
        "ranks": [],
        "bad_ranks": {},
        "device": None,
        "unit": UNIT,
        "kernels": [],
        "rank_totals": {},
        "dropped": {"rows": 0, "us": 0.0},
        "stragglers": {"threshold": None, "ranks": {}, "flagged": []},
    }
