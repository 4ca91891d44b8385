"""Every rank's memory over the run, and the leaks named. Pure: no Ray, no torch, no I/O.

The node agents sample each rank process (``worker_ext.agent.memory_sampler``); the coordinator
folds the samples here. A ``RankMemory`` keeps the last ``EXACT`` samples exact and, before
them, one bucket per ``bucket_s`` seconds (mean and peak); past ``MAX_BUCKETS`` two neighbours
merge and the width doubles, so a rank's series is bounded (about 26 KB at most) however long
the run. The fold and the marks run on the coordinator's reads thread, not its event loop.

A leak is steady growth: over the last ``leak_span_s`` seconds the resident memory's
least-squares slope is at least the configured rate, and it grew in each of the span's four
quarters (each quarter's median above the last by at least a third of what the slope says). A
one-off rise lies in one quarter, so it is not a leak; a flat run has no slope.

>>> pts = [(float(t), 1e9 + 1e6 * t) for t in range(120)]  # 1 MB a second
>>> g = leak_growth(pts, now=119.0, span_s=100.0, min_bytes_per_s=1e5)
>>> round(g[0] / 60e6, 2), g[1]
(1.0, 19.0)
>>> step = [(float(t), 1e9 + (5e8 if t > 60 else 0)) for t in range(120)]
>>> leak_growth(step, now=119.0, span_s=100.0, min_bytes_per_s=1e5) is None
True
"""

from __future__ import annotations

import array
import bisect
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from coordinator.protocol.memory_replies import Growth

EXACT = 300
SPILL = 30  # samples past EXACT before the oldest go into buckets
W = 5  # values a bucket: first and last time, samples, sum of rss, max of rss
BUCKET_S = 30.0
MAX_BUCKETS = 512
SERIES_POINTS = 600  # the most (t, rss) points a rank's series gives the chart
QUARTERS = 4
STEADY = 1 / 3  # each quarter grows by at least this share of what the slope says
MIN_COVER = 0.75  # the samples must cover this share of the span
Key = tuple[str, int]
Sample = tuple[float, int, "int | None", "int | None"]


def leak_growth(
    points: Sequence[tuple[float, float]], now: float, span_s: float, min_bytes_per_s: float
) -> tuple[float, float] | None:
    """``(bytes per minute, since)`` when ``points`` ((t, bytes), oldest first) grew steadily
    over the last ``span_s`` seconds before ``now`` at ``min_bytes_per_s`` at least; else None."""
    start = now - span_s
    pts = [(t, v) for t, v in points if t >= start]
    if len(pts) < 2 * QUARTERS or pts[-1][0] - pts[0][0] < MIN_COVER * span_s:
        return None
    slope = _slope(pts)
    if slope < min_bytes_per_s:
        return None
    width = span_s / QUARTERS
    medians = []
    for q in range(QUARTERS):
        part = [v for t, v in pts if start + q * width <= t < start + (q + 1) * width or (
            q == QUARTERS - 1 and t >= start + q * width)]  # fmt: skip
        if not part:
            return None
        medians.append(statistics.median(part))
    if any(b - a < STEADY * slope * width for a, b in zip(medians, medians[1:], strict=False)):
        return None
    return slope * 60.0, pts[0][0]


def _slope(pts: Sequence[tuple[float, float]]) -> float:
    n = len(pts)
    mt = sum(t for t, _ in pts) / n
    mv = sum(v for _, v in pts) / n
    den = sum((t - mt) ** 2 for t, _ in pts)
    return 0.0 if den <= 0 else sum((t - mt) * (v - mv) for t, v in pts) / den


@dataclass
class RankMemory:
    """One rank's samples (see the module docstring), its peaks and its leak mark."""

    pid: int | None = None
    exact: array.array[float] = field(default_factory=lambda: array.array("d"))
    buckets: array.array[float] = field(default_factory=lambda: array.array("d"))
    """Flat, ``W`` values a bucket: first and last time, samples, sum and max of rss."""
    bucket_s: float = BUCKET_S
    last: Sample | None = None
    peak_rss: int | None = None
    peak_gpu: int | None = None
    samples: int = 0
    lost: str | None = None  # why its samples ended
    error: str | None = None  # the last sample's fault (psutil refused ...)
    growth: Growth | None = None

    def add(self, pid: int, samples: Sequence[Sample]) -> None:
        """Fold samples of process ``pid`` (a new pid: the rank restarted, its leak span too)."""
        if self.pid is not None and pid != self.pid:
            self._restart()
        self.pid, self.lost = pid, None
        for t, rss, uss, gpu in samples:
            if self.last is not None and t <= self.last[0]:
                continue  # a sample already folded, or out of order: dropped
            self.exact.extend((t, float(rss)))
            self.last = (t, rss, uss, gpu)
            self.samples += 1
            self.peak_rss = rss if self.peak_rss is None else max(self.peak_rss, rss)
            if gpu is not None:
                self.peak_gpu = gpu if self.peak_gpu is None else max(self.peak_gpu, gpu)
        if len(self.exact) > 2 * (EXACT + SPILL):  # a few at a time: no rank spills at once
            self._spill(len(self.exact) // 2 - EXACT)

    def _restart(self) -> None:
        self._spill(len(self.exact) // 2)
        self.growth = None

    def _spill(self, n: int) -> None:
        """The oldest ``n`` exact samples into buckets."""
        b = self.buckets
        for i in range(n):
            t, rss = self.exact[2 * i], self.exact[2 * i + 1]
            if not b or t >= b[-W] + self.bucket_s:
                b.extend((t, t, 1.0, rss, rss))
            else:
                b[-4], b[-3], b[-2], b[-1] = t, b[-3] + 1, b[-2] + rss, max(b[-1], rss)
        del self.exact[: 2 * n]
        while len(b) > W * MAX_BUCKETS:
            self.bucket_s *= 2
            merged = array.array("d")
            for k in range(0, len(b), 2 * W):
                one, two = b[k : k + W], b[k + W : k + 2 * W]
                merged.extend(
                    (one[0], two[1], one[2] + two[2], one[3] + two[3], max(one[4], two[4]))
                    if two
                    else one
                )
            self.buckets = b = merged

    def points(self, since: float = 0.0) -> list[tuple[float, float]]:
        """``(t, rss)`` from ``since`` on: bucket means (at their middle), then exact samples."""
        b, ex = self.buckets, self.exact
        out = [
            ((b[k] + b[k + 1]) / 2, b[k + 3] / b[k + 2])
            for k in range(0, len(b), W)
            if b[k + 1] >= since
        ]
        out += [(ex[i], ex[i + 1]) for i in range(0, len(ex), 2) if ex[i] >= since]
        return out

    def value_at(self, t: float) -> float | None:
        """The first kept value at or after ``t`` (a bucket's mean, else a sample), in
        O(log n); None when nothing is kept after ``t``."""
        b, nb = self.buckets, len(self.buckets) // W
        i = bisect.bisect_left(range(nb), t, key=lambda k: b[W * k + 1])
        if i < nb:
            return b[W * i + 3] / b[W * i + 2]
        ex = self.exact
        j = bisect.bisect_left(range(len(ex) // 2), t, key=lambda k: ex[2 * k])
        return ex[2 * j + 1] if j < len(ex) // 2 else None

    def series(self, limit: int = SERIES_POINTS) -> list[tuple[float, int]]:
        """The run's ``(t, rss)`` for a chart: at most ``limit`` points, peaks kept."""
        pts = [(round(t, 3), int(v)) for t, v in self.points()]
        if len(pts) <= limit:
            return pts
        step = len(pts) / limit
        return [
            max(pts[int(i * step) : int((i + 1) * step)], key=lambda p: p[1]) for i in range(limit)
        ]


@dataclass
class MemoryBook:
    """Every rank's ``RankMemory`` of one run, and their leak marks."""

    ranks: dict[Key, RankMemory] = field(default_factory=dict)

    def add(self, key: Key, pid: int, samples: Sequence[Sample], error: str | None) -> None:
        rm = self.ranks.setdefault(key, RankMemory())
        rm.add(pid, samples)
        rm.error = error

    def lose(self, key: Key, why: str) -> None:
        """``key``'s process is gone: its samples end (its peak and series stay)."""
        rm = self.ranks.setdefault(key, RankMemory())
        rm.lost, rm.growth = why, None

    def evaluate(self, now: float, span_s: float, min_bytes_per_s: float) -> None:
        """Mark the ranks that grow steadily now; a mark keeps its ``since`` while it lasts."""
        for rm in self.ranks.values():
            if rm.lost is not None or rm.last is None:
                continue
            start = rm.value_at(now - span_s)
            if start is None or rm.last[1] - start < 0.5 * min_bytes_per_s * span_s:
                rm.growth = None  # (most ranks: flat, told apart in O(log n))
                continue
            found = leak_growth(rm.points(now - span_s), rm.last[0], span_s, min_bytes_per_s)
            if found is None:
                rm.growth = None
                continue
            since = rm.growth["since"] if rm.growth is not None else found[1]
            rm.growth = {"bytes_per_min": round(found[0], 1), "since": round(since, 3)}

    def culprits(self, roles: dict[Key, str]) -> set[Key]:
        """Marked ranks whose role's other sampled ranks mostly stay flat."""
        marked: dict[str, list[Key]] = {}
        flat: dict[str, int] = {}
        for key, rm in self.ranks.items():
            if rm.lost is not None or rm.last is None:
                continue
            role = roles.get(key, "policy")
            if rm.growth is not None:
                marked.setdefault(role, []).append(key)
            else:
                flat[role] = flat.get(role, 0) + 1
        return {
            k for role, keys in marked.items() if 0 < len(keys) <= flat.get(role, 0) for k in keys
        }
