"""Every rank's memory over the run, and the leaks named. Pure: no Ray, no torch, no I/O.

The node agents sample each rank process (``worker_ext.agent.memory_sampler``); the coordinator
folds the samples here. A ``RankMemory`` keeps the last ``EXACT`` samples exact and, before
them, one bucket per ``bucket_s`` seconds (mean and peak); past ``MAX_BUCKETS`` two neighbours
merge and the width doubles, so a rank's series is bounded (about 26 KB at most) however long
the run. The fold and the marks run on the coordinator's reads thread, not its event loop.

A leak is steady growth: over the last ``leak_span_s`` seconds the resident memory's
least-squares slope is at least the configured rate, it grew in each of the span's four
quarters (each quarter's median above the last by at least a third of what the slope says),
and no single step (one level, then another) fits the span better than that line. A one-off
rise lies in one quarter, or is one step, so it is not a leak; a flat run has no slope. A
leak with a big jump in it may go unmarked while the jump is in the span.

A steep leak is looked for the same way over a short span too (``memory.leak_fast_span_s``,
at a higher floor, its rate the slope of the span's last half: the rate now), so that it is
named within about 70 s of its start instead of the long span; a slow one needs the long
span. A marked rank says the time left before its node's available memory (the node agent's
last reading) is gone at the rates of the node's marked ranks together.

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

from coordinator.protocol.memory_replies import Growth, NodeMemory

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
    if _step_fits_better(pts, slope):
        return None  # one rise, noisy enough to pass the quarters: not steady growth
    return slope * 60.0, pts[0][0]


def _step_fits_better(pts: Sequence[tuple[float, float]], slope: float) -> bool:
    """Whether one step (a level, then another from some sample on) leaves less squared error
    than the line of ``slope``: a one-off rise does, steady growth does not. O(n)."""
    n = len(pts)
    mt = sum(t for t, _ in pts) / n
    mv = sum(v for _, v in pts) / n
    vs = [v - mv for _, v in pts]  # (centred: the squares stay exact in floats)
    line = sum((v - slope * (t - mt)) ** 2 for (t, _), v in zip(pts, vs, strict=True))
    total, total2 = sum(vs), sum(v * v for v in vs)
    s = s2 = 0.0
    for k in range(1, n):
        s, s2 = s + vs[k - 1], s2 + vs[k - 1] ** 2
        rs, rs2 = total - s, total2 - s2
        if s2 - s * s / k + rs2 - rs * rs / (n - k) < line:
            return True
    return False


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
    node: str | None = None  # the node its samples came from

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
        return thin([(round(t, 3), int(v)) for t, v in self.points()], limit)


def thin(pts: list[tuple[float, int]], limit: int) -> list[tuple[float, int]]:
    """At most ``limit`` of ``pts`` (oldest first): the highest of each run of neighbours, so
    the peaks stay."""
    if len(pts) <= limit:
        return pts
    step = len(pts) / limit
    return [max(pts[int(i * step) : int((i + 1) * step)], key=lambda p: p[1]) for i in range(limit)]


@dataclass
class MemoryBook:
    """Every rank's ``RankMemory`` of one run, and their leak marks."""

    ranks: dict[Key, RankMemory] = field(default_factory=dict)
    nodes: dict[str, NodeMemory] = field(default_factory=dict)  # each node's last reading

    def add(
        self,
        key: Key,
        pid: int,
        samples: Sequence[Sample],
        error: str | None,
        node: str | None = None,
    ) -> None:
        rm = self.ranks.setdefault(key, RankMemory())
        rm.add(pid, samples)
        rm.error = error
        rm.node = node or rm.node

    def lose(self, key: Key, why: str) -> None:
        """``key``'s process is gone: its samples end (its peak and series stay)."""
        rm = self.ranks.setdefault(key, RankMemory())
        rm.lost, rm.growth = why, None

    def evaluate(
        self,
        now: float,
        span_s: float,
        min_bytes_per_s: float,
        fast: tuple[float, float] | None = None,
        whole: bool = True,
    ) -> None:
        """Mark the ranks that grow steadily now, over the short span ``fast`` (span, floor)
        first, then ``span_s`` (for every rank when ``whole``, else only for those marked:
        the long span needs looking at less often); a mark keeps its ``since`` while it
        lasts, and says the time left on its node."""
        for rm in self.ranks.values():
            if rm.lost is not None or rm.last is None:
                continue
            found = _growing(rm, now, *fast, recent=True) if fast else None
            if found is None and (whole or rm.growth is not None):
                found = _growing(rm, now, span_s, min_bytes_per_s)
            if found is None:
                rm.growth = None
                continue
            since = rm.growth["since"] if rm.growth is not None else found[1]
            rm.growth = {
                "bytes_per_min": round(found[0], 1), "since": round(since, 3),
                "span_s": found[2], "time_left_s": None,
            }  # fmt: skip
        self._time_left()

    def _time_left(self) -> None:
        """Each mark's time left: its node's available memory over the rates of the node's
        marked ranks together (bytes a second)."""
        rates: dict[str, float] = {}
        for rm in self.ranks.values():
            if rm.growth is not None and rm.node is not None:
                rates[rm.node] = rates.get(rm.node, 0.0) + rm.growth["bytes_per_min"] / 60.0
        for rm in self.ranks.values():
            if rm.growth is None or rm.node is None:
                continue
            nm, rate = self.nodes.get(rm.node), rates.get(rm.node)
            if nm is not None and rate:
                rm.growth["time_left_s"] = round(max(0, nm["available_bytes"]) / rate, 1)

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


def _growing(
    rm: RankMemory, now: float, span_s: float, min_bytes_per_s: float, recent: bool = False
) -> tuple[float, float, float] | None:
    """``(bytes per minute, since, span_s)`` when ``rm`` grew steadily over ``span_s``; with
    ``recent``, the rate is the slope of the span's last half (a steep leak's rate now: the
    span may still hold the flat run before it started)."""
    assert rm.last is not None
    start = rm.value_at(now - span_s)
    if start is None or rm.last[1] - start < 0.5 * min_bytes_per_s * span_s:
        return None  # (most ranks: flat, told apart in O(log n))
    pts = rm.points(now - span_s)
    found = leak_growth(pts, rm.last[0], span_s, min_bytes_per_s)
    if found is None:
        return None
    half = [p for p in pts if p[0] >= rm.last[0] - span_s / 2]
    return (_slope(half) * 60.0 if recent else found[0]), found[1], span_s
