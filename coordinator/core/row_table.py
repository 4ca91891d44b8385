"""Running per-name statistics over ranks: one row per op, kernel or allocating op. Pure."""

from __future__ import annotations

import heapq
import math
from array import array
from typing import Any

from coordinator.core.partial import Rows, unique_rows
from coordinator.core.saved import RowTableFile, digits, ints
from coordinator.protocol.partial_codec import TableRow


class RowTable:
    """Running per-name statistics over ranks: one row per op, kernel or allocating op.

    Sums are integers (nanoseconds for times, bytes for memory), so the table is the same
    whatever order its ranks and node partials arrive in.
    """

    def __init__(self, scale: int) -> None:
        self.scale = scale
        self.ids: dict[str, int] = {}
        self.names: list[str] = []
        self.total: list[int] = []
        self.sumsq: list[int] = []
        self.max: list[float] = []
        self.max_rank: list[int] = []
        self.min_present: list[float] = []
        self.present: list[int] = []
        self.count: list[int] = []

    def saved(self) -> RowTableFile:
        """The table as saved (its sums past 64 bits as digits)."""
        return RowTableFile(
            scale=self.scale, names=list(self.names), total=digits(self.total),
            sumsq=digits(self.sumsq), max=list(self.max), max_rank=list(self.max_rank),
            min_present=list(self.min_present), present=list(self.present),
            count=list(self.count),
        )  # fmt: skip

    @classmethod
    def from_saved(cls, f: RowTableFile) -> RowTable:
        """The table ``saved`` made (``SavedError`` for a sum that is not an int's digits)."""
        table = cls(f.scale)
        table.names, table.total, table.sumsq = list(f.names), ints(f.total), ints(f.sumsq)
        table.max, table.max_rank = list(f.max), list(f.max_rank)
        table.min_present, table.present = list(f.min_present), list(f.present)
        table.count = list(f.count)
        table.ids = {name: i for i, name in enumerate(f.names)}
        return table

    def copy(self) -> RowTable:
        out = RowTable(self.scale)
        out.ids = dict(self.ids)
        for name in (
            "names",
            "total",
            "sumsq",
            "max",
            "max_rank",
            "min_present",
            "present",
            "count",
        ):
            setattr(out, name, list(getattr(self, name)))
        return out

    def id_of(self, name: str) -> int:
        i = self.ids.get(name)
        if i is None:
            i = self.ids[name] = len(self.names)
            self.names.append(name)
            self.total.append(0)
            self.sumsq.append(0)
            self.max.append(-1.0)
            self.max_rank.append(-1)
            self.min_present.append(math.inf)
            self.present.append(0)
            self.count.append(0)
        return i

    def add_rank(self, rank: int, rows: Rows) -> array[float]:
        """Fold in one rank's rows (the fold of ``RowFold`` and ``merge`` in one pass); returns
        the rank's values by row id."""
        scale, mine = self.scale, unique_rows(rows)
        ids = [self.id_of(name) for name in mine]
        values = array("f", [0.0]) * (max(ids) + 1 if ids else 0)
        total, sumsq, count, present = self.total, self.sumsq, self.count, self.present
        lo, hi, hi_rank = self.min_present, self.max, self.max_rank
        for i, (v, calls) in zip(ids, mine.values(), strict=True):
            q = round(v * scale)
            total[i] += q
            sumsq[i] += q * q
            count[i] += calls
            present[i] += 1
            if v < lo[i]:
                lo[i] = v
            if v > hi[i] or (v == hi[i] and rank < hi_rank[i]):
                hi[i], hi_rank[i] = v, rank
            values[i] = v
        return values

    def merge(self, rows: list[TableRow]) -> list[int]:
        """Fold in a partial's rows; returns their row ids, in order."""
        ids = []
        for r in rows:
            i = self.id_of(r.name)
            ids.append(i)
            self.total[i] += r.total
            self.sumsq[i] += r.square_sum
            self.count[i] += r.count
            self.present[i] += r.present
            self.min_present[i] = min(self.min_present[i], r.min)
            if r.max > self.max[i] or (r.max == self.max[i] and r.max_rank < self.max_rank[i]):
                self.max[i], self.max_rank[i] = r.max, r.max_rank
        return ids

    def top(self, k: int, n: int, grand: float, unit: str) -> list[dict[str, Any]]:
        """The ``k`` rows with the largest total over the ``n`` reporting ranks."""
        if n == 0 or k <= 0:
            return []
        totals, names = self.total, self.names  # ties by name: the same order however folded
        order = heapq.nsmallest(k, range(len(names)), key=lambda i: (-totals[i], names[i]))
        rows = []
        for i in order:
            total = self.total[i] / self.scale
            mean = total / n
            q_mean = self.total[i] / n  # absent ranks count as 0
            var = max(0.0, self.sumsq[i] / n - q_mean * q_mean) / (self.scale * self.scale)
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
