"""Per-step phase times: each step's wall time and its named regions, for every step of a run,
bounded. Pure: no Ray, no I/O.

The hooks time named regions of the trainer's step (``with hooks.region("generate")``) and the
step's wall time (from the end of the previous report to this one: the trainer's own work); the
records ride on the step reports the client already sends. A ``PhaseLog`` keeps every step of the
last ``EXACT_STEPS`` and, before them, one bucket per ``BUCKET_STEPS`` steps (sums and the
slowest step), so a run of a million steps holds about 20,000 entries.

>>> log = PhaseLog()
>>> log.add([[0, 0.10, {"generate": 0.06, "train": 0.03}], [1, 0.12, {"generate": 0.08}]])
2
>>> r = log.reply(last=10)
>>> [(s["step"], s["wall_ms"], s["other_ms"]) for s in r["steps"]]
[(0, 100.0, 10.0), (1, 120.0, 40.0)]
>>> [(g["region"], g["mean_ms"]) for g in r["regions"]]
[('generate', 70.0), ('train', 15.0)]
"""

from __future__ import annotations

import array
import collections
import math
from dataclasses import dataclass, field
from typing import Any

from coordinator.protocol.replies import PhaseBucket, PhaseRegion, PhaseStep, PhaseTimesReply

EXACT_STEPS = 10_000
BUCKET_STEPS = 100
MAX_BUCKETS = 10_000
MAX_REGIONS = 32
MAX_NAME = 64
MAX_RECORDS = 20_000  # per report
SLOWEST = 5
NO_REGIONS: dict[str, float] = {}  # (a step timed with no region in it: read, never changed)


def check_records(records: Any) -> str | None:
    """Why ``records`` (``[[step, wall_s, {region: seconds}], ...]``) cannot be taken; None
    when they can."""
    if not isinstance(records, list) or len(records) > MAX_RECORDS:
        return f"phases must be a list of at most {MAX_RECORDS} [step, wall_s, regions] records"
    for rec in records:
        if not isinstance(rec, (list, tuple)) or len(rec) != 3:
            return f"a phase record must be [step, wall_s, regions], got {rec!r:.80}"
        step, wall, regions = rec
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63:
            return f"a phase record's step must be an int >= 0, got {step!r:.80}"
        if not _seconds(wall):
            return f"a phase record's wall_s must be a number >= 0, got {wall!r:.80}"
        if not isinstance(regions, dict) or len(regions) > MAX_REGIONS:
            return f"a phase record's regions must be a dict of at most {MAX_REGIONS}"
        for name, value in regions.items():
            if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or not _seconds(value):
                return f"a region must be a name (1..{MAX_NAME} chars) -> seconds >= 0"
    return None


def check_walls(walls: Any) -> str | None:
    """Why ``walls`` (``(first_step, seconds)``: the wall times of steps ``first_step``,
    ``first_step + 1``, ... with no region in them, a compact run of records) cannot be taken;
    None when they can."""
    if not isinstance(walls, (list, tuple)) or len(walls) != 2:
        return f"walls must be (first_step, [wall_s, ...]), got {walls!r:.80}"
    first, seconds = walls
    if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first < 2**62:
        return f"walls' first step must be an int >= 0, got {first!r:.80}"
    if not isinstance(seconds, (list, tuple, array.array)) or len(seconds) > MAX_RECORDS:
        return f"walls' seconds must be a list of at most {MAX_RECORDS} numbers"
    if not all(_seconds(x) for x in seconds):
        return "walls' seconds must each be a number >= 0"
    return None


def walls_records(walls: tuple[int, Any]) -> list[list[Any]]:
    """Checked ``walls`` (``check_walls``) as phase records, one a step."""
    first, seconds = walls
    return [[first + i, wall, NO_REGIONS] for i, wall in enumerate(seconds)]


def _seconds(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


@dataclass
class StepSpan:
    """Steps ``first..last`` summed: a bucket of older steps here, a point of
    ``step_series``."""

    first: int
    last: int
    steps: int = 0
    wall_s: float = 0.0
    regions: dict[str, float] = field(default_factory=dict)
    slowest: tuple[float, int] = (0.0, -1)


@dataclass
class PhaseLog:
    """One run's phase times (see the module docstring)."""

    exact: collections.deque[tuple[int, float, dict[str, float]]] = field(
        default_factory=lambda: collections.deque(maxlen=EXACT_STEPS)
    )
    buckets: collections.deque[StepSpan] = field(
        default_factory=lambda: collections.deque(maxlen=MAX_BUCKETS)
    )
    names: set[str] = field(default_factory=set)
    steps_seen: int = 0
    ignored: int = 0  # records of a step already kept, or of a region beyond MAX_REGIONS

    def add(self, records: list[Any]) -> int:
        """Keep checked ``records`` (``check_records``) in step order; how many were new."""
        added = 0
        for step, wall, regions in records:
            if self.exact and step <= self.exact[-1][0]:
                self.ignored += 1
                continue
            kept = {}
            for name, value in regions.items():
                if name in self.names or len(self.names) < MAX_REGIONS:
                    self.names.add(name)
                    kept[name] = float(value)
                else:
                    self.ignored += 1
            if len(self.exact) == self.exact.maxlen:
                self._fold(self.exact[0])
            self.exact.append((step, float(wall), kept))
            self.steps_seen += 1
            added += 1
        return added

    def _fold(self, rec: tuple[int, float, dict[str, float]]) -> None:
        step, wall, regions = rec
        first = step - step % BUCKET_STEPS
        if not self.buckets or self.buckets[-1].first != first:
            self.buckets.append(StepSpan(first, step))
        b = self.buckets[-1]
        b.last, b.steps, b.wall_s = step, b.steps + 1, b.wall_s + wall
        for name, value in regions.items():
            b.regions[name] = b.regions.get(name, 0.0) + value
        b.slowest = max(b.slowest, (wall, step))

    def grown_region(self, first: int, last: int, before: int = 100) -> str | None:
        """The region whose mean time grew most from the ``before`` steps preceding ``first``
        to the steps ``first..last`` (an auto capture's slow steps); None when none grew, or
        the time in no region grew more.

        >>> log = PhaseLog()
        >>> _ = log.add([[k, 0.1, {"gen": 0.05, "train": 0.04}] for k in range(10)])
        >>> _ = log.add([[k, 0.2, {"gen": 0.06, "train": 0.13}] for k in range(10, 13)])
        >>> log.grown_region(10, 12)
        'train'
        """
        slow = [r for r in self.exact if first <= r[0] <= last]
        base = [r for r in self.exact if r[0] < first][-before:]
        if not slow or not base:
            return None
        growth = {n: _mean(slow, n) - _mean(base, n) for n in self.names}
        other = _mean_other(slow) - _mean_other(base)
        name, grew = max(growth.items(), key=lambda kv: kv[1], default=(None, 0.0))
        return name if name is not None and grew > 0 and grew >= other else None

    def last_step(self) -> dict[str, float] | None:
        """The last step's region times in ms (for the metrics), or None."""
        if not self.exact:
            return None
        _, wall, regions = self.exact[-1]
        return {"step": wall * 1e3, **{k: v * 1e3 for k, v in regions.items()}}

    def reply(
        self, last: int = 100, buckets: int = 100, run: str = "", trainer_id: str | None = None
    ) -> PhaseTimesReply:
        """The last ``last`` steps, each region's share of them, the slowest of them, and the
        last ``buckets`` coarse buckets before the exact steps."""
        recent = list(self.exact)[-last:] if last > 0 else []
        wall = sum(w for _, w, _ in recent)
        return {
            "run": run,
            "trainer_id": trainer_id,
            "steps": [_step_entry(r) for r in recent],
            "regions": _regions(recent, wall),
            "slowest": [_step_entry(r) for r in sorted(recent, key=lambda r: -r[1])[:SLOWEST]],
            "buckets": [_bucket_entry(b) for b in list(self.buckets)[-buckets:] if buckets > 0],
            "steps_seen": self.steps_seen,
            "exact_steps": len(self.exact),
            "ignored": self.ignored,
        }


def _step_entry(rec: tuple[int, float, dict[str, float]]) -> PhaseStep:
    step, wall, regions = rec
    return {
        "step": step,
        "wall_ms": round(wall * 1e3, 3),
        "regions": {k: round(v * 1e3, 3) for k, v in regions.items()},
        "other_ms": round(max(0.0, wall - sum(regions.values())) * 1e3, 3),
    }


def _regions(recent: list[tuple[int, float, dict[str, float]]], wall: float) -> list[PhaseRegion]:
    totals: dict[str, list[float]] = {}
    for _, _, regions in recent:
        for name, value in regions.items():
            totals.setdefault(name, []).append(value)
    out: list[PhaseRegion] = []
    for name, values in sorted(totals.items(), key=lambda kv: -sum(kv[1])):
        total = sum(values)
        out.append(
            {
                "region": name,
                "steps": len(values),
                "total_ms": round(total * 1e3, 3),
                "mean_ms": round(total / len(recent) * 1e3, 3),
                "max_ms": round(max(values) * 1e3, 3),
                "share": round(total / wall, 4) if wall > 0 else 0.0,
            }
        )
    return out


def _bucket_entry(b: StepSpan) -> PhaseBucket:
    n = max(1, b.steps)
    return {
        "first": b.first,
        "last": b.last,
        "steps": b.steps,
        "mean_wall_ms": round(b.wall_s / n * 1e3, 3),
        "mean_ms": {k: round(v / n * 1e3, 3) for k, v in b.regions.items()},
        "slowest_step": b.slowest[1],
        "slowest_ms": round(b.slowest[0] * 1e3, 3),
    }


def _mean(recs: list[tuple[int, float, dict[str, float]]], name: str) -> float:
    return sum(r[2].get(name, 0.0) for r in recs) / len(recs)


def _mean_other(recs: list[tuple[int, float, dict[str, float]]]) -> float:
    return sum(max(0.0, w - sum(reg.values())) for _, w, reg in recs) / len(recs)
