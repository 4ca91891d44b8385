"""The run's step time over its global steps, downsampled for a chart. Pure: no Ray, no I/O.

It reads what a ``PhaseLog`` keeps of the stepping trainer (the last 10,000 steps exactly, a
bucket per 100 steps before them) and cuts the run's steps into at most ``points`` equal spans:
each point is a span's mean step time and each region's mean, with its slowest step, so a spike
stays visible however long the run. A log of a million steps holds about 20,000 entries; one
pass over them makes the series.

>>> from coordinator.core.phases import PhaseLog
>>> log = PhaseLog()
>>> _ = log.add([[k, 0.1 if k != 5 else 0.4, {"train": 0.05}] for k in range(10)])
>>> s = step_series(log, points=2)
>>> [(p["first"], p["last"], p["mean_ms"], p["max_ms"], p["max_step"]) for p in s["points"]]
[(0, 4, 100.0, 100.0, 0), (5, 9, 160.0, 400.0, 5)]
>>> s["points"][0]["regions"]
{'train': 50.0}
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from coordinator.core.phases import PhaseLog
from coordinator.protocol.replies import StepPoint, StepSeriesReply

MAX_POINTS = 5_000
DEFAULT_POINTS = 1_000


@dataclass
class _Span:
    first: int
    last: int
    steps: int = 0
    wall_s: float = 0.0
    slowest: tuple[float, int] = (-1.0, -1)
    regions: dict[str, float] = field(default_factory=dict)


Entry = tuple[int, int, int, float, tuple[float, int], dict[str, float]]


def _entries(log: PhaseLog) -> list[Entry]:
    """``(first, last, steps, wall_s, (slowest_s, its step), regions' seconds)`` of every bucket
    and every exact step, in step order."""
    out = [(b.first, b.last, b.steps, b.wall_s, b.slowest, b.regions) for b in log.buckets]
    out += [(s, s, 1, w, (w, s), r) for s, w, r in log.exact]
    return out


def step_series(
    log: PhaseLog, points: int = DEFAULT_POINTS, run: str = "", trainer_id: str | None = None
) -> StepSeriesReply:
    """At most ``points`` spans of equal width over the steps ``log`` holds (see the module
    docstring); the width is a whole number of steps."""
    entries = _entries(log)
    if not entries:
        return _reply([], 0, log, run, trainer_id)
    start, end = entries[0][0], entries[-1][1]
    width = max(1, math.ceil((end - start + 1) / max(1, points)))
    spans: dict[int, _Span] = {}
    for first, last, steps, wall, slowest, regions in entries:
        span = spans.get(key := (first - start) // width)
        if span is None:
            span = spans[key] = _Span(first, last)
        span.last, span.steps, span.wall_s = last, span.steps + steps, span.wall_s + wall
        if slowest[0] > span.slowest[0]:  # the first of equally slow steps
            span.slowest = slowest
        for name, value in regions.items():
            span.regions[name] = span.regions.get(name, 0.0) + value
    return _reply([_point(s) for _, s in sorted(spans.items())], width, log, run, trainer_id)


def _point(s: _Span) -> StepPoint:
    def per_step_ms(seconds: float) -> float:
        return round(seconds / max(1, s.steps) * 1e3, 3)

    slowest_s, slowest_step = s.slowest
    return StepPoint(
        first=s.first,
        last=s.last,
        steps=s.steps,
        mean_ms=per_step_ms(s.wall_s),
        max_ms=round(slowest_s * 1e3, 3),
        max_step=slowest_step,
        regions={name: per_step_ms(v) for name, v in s.regions.items()},
    )


def _reply(
    pts: list[StepPoint], width: int, log: PhaseLog, run: str, trainer_id: str | None
) -> StepSeriesReply:
    return {
        "run": run,
        "trainer_id": trainer_id,
        "steps_seen": log.steps_seen,
        "width": width,
        "regions": sorted(log.names),
        "points": pts,
    }
