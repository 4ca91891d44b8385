"""The run's step time over its global steps, downsampled for a chart. Pure: no Ray, no I/O.

It reads what a ``PhaseLog`` keeps of the stepping trainer (the last 10,000 steps exactly, a
bucket per 100 steps before them) and cuts the run's steps into at most ``points`` equal spans:
each point is a span's mean step time and each region's mean, with its slowest step, so a spike
stays visible however long the run. A log of a million steps holds about 20,000 entries; one
pass over them makes the series.

>>> from coordinator.core.phases import PhaseLog, StepSpan
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

from coordinator.core.phases import PhaseLog, StepSpan
from coordinator.protocol.replies import StepPoint, StepSeriesReply

MAX_POINTS = 5_000
DEFAULT_POINTS = 1_000


def _entries(log: PhaseLog) -> list[StepSpan]:
    """Every bucket and every exact step of ``log``, in step order."""
    return [*log.buckets, *(StepSpan(k, k, 1, w, r, (w, k)) for k, w, r in log.exact)]


def step_series(
    log: PhaseLog, points: int = DEFAULT_POINTS, run: str = "", trainer_id: str | None = None
) -> StepSeriesReply:
    """At most ``points`` spans of equal width over the steps ``log`` holds (see the module
    docstring); the width is a whole number of steps."""
    entries = _entries(log)
    if not entries:
        return _reply([], 0, log, run, trainer_id)
    start, end = entries[0].first, entries[-1].last
    width = max(1, math.ceil((end - start + 1) / max(1, points)))
    spans: dict[int, StepSpan] = {}
    for e in entries:
        span = spans.get(key := (e.first - start) // width)
        if span is None:
            span = spans[key] = StepSpan(e.first, e.last, slowest=e.slowest)
        span.last, span.steps, span.wall_s = e.last, span.steps + e.steps, span.wall_s + e.wall_s
        if e.slowest[0] > span.slowest[0]:  # (the first of equally slow steps stays)
            span.slowest = e.slowest
        for name, value in e.regions.items():
            span.regions[name] = span.regions.get(name, 0.0) + value
    return _reply([_point(s) for _, s in sorted(spans.items())], width, log, run, trainer_id)


def _point(s: StepSpan) -> StepPoint:
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
