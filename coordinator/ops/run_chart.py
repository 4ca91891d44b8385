"""The run at a glance: the step time over the run's global steps, with its windows as bands and
its stalls and regression marks as marks. Pure: it assembles two replies the operator already
reads (``step_series()`` and ``status()``) into one ``RunChart`` for the web view's run page
(``/api/chart``), and draws it as text for ``ray-profiler watch``.

>>> series = {"run": "r", "trainer_id": "t", "steps_seen": 4, "width": 1, "regions": [],
...           "points": [{"first": k, "last": k, "steps": 1, "mean_ms": 10.0 * (k + 1),
...                       "max_ms": 10.0 * (k + 1), "max_step": k, "regions": {}}
...                      for k in range(4)]}
>>> status = {"windows": [{"index": 0, "kind": "scheduled", "steps": [1, 2], "partial": False,
...           "stragglers": [], "roles": {}, "regression": None}], "stalls": []}
>>> print("\\n".join(render_chart(run_chart(series, status), width=4, height=2)))
step time, steps 0-3 (1 step a column): mean 25.0 ms, slowest 40.0 ms (step 3)
  40.0 ms   ▄█
   0.0 ms ▄███
  windows  ss
"""

from __future__ import annotations

from typing import Any, TypedDict

from coordinator.ops.tables import marks_lines
from coordinator.protocol.replies import StepPoint, StepSeriesReply

BLOCKS = " ▁▂▃▄▅▆▇█"
KIND_LETTER = {"scheduled": "s", "capture": "c", "auto": "a"}


class ChartWindow(TypedDict):
    """A closed window as a band over its recorded steps."""

    index: int
    kind: str
    first: int
    last: int
    partial: bool
    stragglers: list[int]
    marks: list[str]  # each marked role's regression line ("" none: the list is empty)


class ChartStall(TypedDict):
    """A stall, marked after the last step before it."""

    index: int
    trainer_id: str
    step: int | None
    resumed_step: int | None
    seconds: float | None  # from its detection to the next step (None: still stalled)


class ChartRole(TypedDict):
    """One role's recorded step times (the mean over its ranks), from its windows' summaries."""

    role: str
    trainer_id: str
    steps: list[list[float]]  # [step, ms]


class RunChart(TypedDict):
    """``/api/chart``: everything the run page's chart draws."""

    series: StepSeriesReply
    windows: list[ChartWindow]
    stalls: list[ChartStall]
    roles: list[ChartRole]


def run_chart(series: StepSeriesReply, status: Any) -> RunChart:
    """The chart of ``series`` (``step_series()``) with the windows and stalls of ``status``
    (``status()``, of the same run)."""
    windows: list[ChartWindow] = []
    roles: dict[str, ChartRole] = {}
    for w in status["windows"]:
        if not w["steps"]:
            continue  # a window that recorded nothing draws no band
        windows.append(
            {
                "index": w["index"],
                "kind": w["kind"],
                "first": w["steps"][0],
                "last": w["steps"][1],
                "partial": bool(w["partial"]),
                "stragglers": list(w["stragglers"]),
                "marks": marks_lines(w),
            }
        )
        for tid, part in (w.get("roles") or {}).items():
            role = roles.setdefault(tid, {"role": part["role"], "trainer_id": tid, "steps": []})
            role["steps"] += [[int(k), ms] for k, ms in sorted(part["step_ms"].items())]
    stalls: list[ChartStall] = [
        {
            "index": s["index"],
            "trainer_id": s["trainer_id"],
            "step": s["last_step"],
            "resumed_step": s["resumed_step"],
            "seconds": None if s["resumed_at"] is None else s["resumed_at"] - s["detected_at"],
        }
        for s in status["stalls"]
    ]
    return {"series": series, "windows": windows, "stalls": stalls, "roles": list(roles.values())}


def _column(step: int, first: int, last: int, width: int) -> int:
    """The column of ``step`` when steps ``first..last`` are ``width`` columns wide."""
    return max(0, min(width - 1, (step - first) * width // max(1, last - first + 1)))


def _columns(points: list[StepPoint], first: int, last: int, width: int) -> list[float | None]:
    """Each column's mean step time (ms; None where no step was reported)."""
    sums, counts = [0.0] * width, [0] * width
    for p in points:
        col = _column(p["first"], first, last, width)
        sums[col] += p["mean_ms"] * p["steps"]
        counts[col] += p["steps"]
    return [s / n if n else None for s, n in zip(sums, counts, strict=True)]


def render_chart(chart: RunChart, width: int = 72, height: int = 6) -> list[str]:
    """The chart as text lines: step time as bars ``height`` rows high (from a floor under
    the fastest column, each end labelled), then a row of the
    windows (``s`` scheduled, ``c`` capture, ``a`` auto; upper case when marked slower), and
    a row of stalls (``!``) when there are any."""
    pts = chart["series"]["points"]
    if not pts:
        return ["step time: no step reported yet (the hooks send it with each step)"]
    first, last = pts[0]["first"], pts[-1]["last"]
    width = max(1, min(width, last - first + 1))
    cols = _columns(pts, first, last, width)
    top = max(c for c in cols if c is not None) or 1.0
    low = min(c for c in cols if c is not None)
    floor = max(0.0, low - (top - low) / height)  # the fastest column about a row high
    slow = max(pts, key=lambda p: p["max_ms"])
    steps = sum(p["steps"] for p in pts)
    mean = sum(p["mean_ms"] * p["steps"] for p in pts) / max(1, steps)
    per = -(-(last - first + 1) // width)
    lines = [
        f"step time, steps {first}-{last} ({per} step{'s' if per > 1 else ''} a column): "
        f"mean {mean:.1f} ms, slowest {slow['max_ms']:.1f} ms (step {slow['max_step']})"
    ]
    for row in range(height, 0, -1):
        cells = []
        for c in cols:
            full = (c - floor) / (top - floor) if c is not None and top > floor else 0.0
            cells.append(BLOCKS[max(0, min(8, round(full * height * 8) - (row - 1) * 8))])
        label = f"{top:6.1f} ms " if row == height else " " * 10
        label = f"{floor:6.1f} ms " if row == 1 and height > 1 else label
        lines.append(label + "".join(cells))
    band, marks = [" "] * width, [" "] * width
    for w in chart["windows"]:
        letter = KIND_LETTER.get(w["kind"], "w")
        lo, hi = _column(w["first"], first, last, width), _column(w["last"], first, last, width)
        for c in range(lo, hi + 1):
            band[c] = letter.upper() if w["marks"] else letter
    lines.append("  windows " + "".join(band).rstrip())
    for s in chart["stalls"]:
        if s["step"] is not None:
            marks[_column(s["step"], first, last, width)] = "!"
    if chart["stalls"]:
        lines.append("   stalls " + "".join(marks).rstrip())
    return lines
