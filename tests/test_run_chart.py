"""The run at a glance (coordinator/core/step_series.py, coordinator/ops/run_chart.py): the step
time over a whole run downsampled, its windows and stalls, and the text ``watch`` prints."""

from __future__ import annotations

import pytest

from coordinator.core.phases import BUCKET_STEPS, EXACT_STEPS, PhaseLog
from coordinator.core.step_series import step_series
from coordinator.ops.run_chart import render_chart, run_chart

STEPS = 100_000
SPIKE = 73_123


def long_run() -> PhaseLog:
    """100,000 steps of 100 ms (60 in ``train``), one of 900 ms at ``SPIKE``."""
    log = PhaseLog()
    log.add([[k, 0.9 if k == SPIKE else 0.1, {"train": 0.06}] for k in range(STEPS)])
    return log


def window(index, first, last, kind="scheduled", marked=False):
    part = {"role": "policy", "step_ms": {str(first): 120.0, str(last): 130.0}, "regression": None}
    if marked:
        part["regression"] = {
            "step_regressed": False, "step_ratio": 1.0, "reference": [0, 1],
            "kernels": [{"name": "aten::mm", "ratio": 1.5}], "baseline": 0,
        }  # fmt: skip
    return {"index": index, "kind": kind, "steps": [first, last], "partial": False,
            "stragglers": [3], "roles": {"t": part}, "regression": part["regression"]}  # fmt: skip


def status(windows, stalls=()):
    return {"windows": list(windows), "stalls": list(stalls)}


def test_a_100k_step_run_is_at_most_the_asked_points_and_keeps_its_spike():
    log = long_run()
    assert len(log.exact) == EXACT_STEPS and len(log.buckets) == (STEPS - EXACT_STEPS) // 100
    s = step_series(log, points=1_000)
    assert s["width"] == 100 and len(s["points"]) == 1_000 and s["steps_seen"] == STEPS
    assert sum(p["steps"] for p in s["points"]) == STEPS  # every step, once
    assert [p["first"] for p in s["points"]] == list(range(0, STEPS, 100))
    spiked = [p for p in s["points"] if p["first"] <= SPIKE <= p["last"]]
    assert len(spiked) == 1 and spiked[0]["max_step"] == SPIKE and spiked[0]["max_ms"] == 900.0
    assert spiked[0]["mean_ms"] == pytest.approx(100 + 800 / 100)
    others = [p for p in s["points"] if p is not spiked[0]]
    assert {p["mean_ms"] for p in others} == {100.0} and {p["max_ms"] for p in others} == {100.0}
    assert {p["regions"]["train"] for p in s["points"]} == {60.0}
    # fewer points: wider spans, the same steps; as many points as steps: every step its own
    assert sum(p["steps"] for p in step_series(log, points=7)["points"]) == STEPS
    exact = step_series(log, points=STEPS)
    assert exact["width"] == 1 and len(exact["points"]) == EXACT_STEPS + len(log.buckets)


def test_a_gap_in_the_reports_leaves_spans_with_fewer_steps_and_none_is_invented():
    log = PhaseLog()
    log.add([[k, 0.1, {}] for k in range(0, 10)] + [[k, 0.2, {}] for k in range(90, 100)])
    s = step_series(log, points=10)
    assert [(p["first"], p["last"], p["steps"]) for p in s["points"]] == [(0, 9, 10), (90, 99, 10)]
    assert step_series(PhaseLog(), points=10)["points"] == []


def test_buckets_older_than_the_exact_steps_are_spans_of_their_own_steps():
    log = PhaseLog()
    log.add([[k, 0.1, {}] for k in range(EXACT_STEPS + 2 * BUCKET_STEPS)])
    s = step_series(log, points=EXACT_STEPS + 2 * BUCKET_STEPS)
    assert [(p["first"], p["last"], p["steps"]) for p in s["points"][:2]] == [
        (0, 99, 100), (100, 199, 100)]  # fmt: skip
    assert s["points"][2]["first"] == s["points"][2]["last"] == 200


def test_the_chart_holds_the_closed_windows_each_role_s_steps_and_the_stalls():
    s = step_series(long_run(), points=500)
    stall = {"index": 1, "trainer_id": "t", "last_step": 500, "resumed_step": 501,
             "detected_at": 10.0, "resumed_at": 42.5}  # fmt: skip
    still = dict(stall, index=2, last_step=900, resumed_step=None, resumed_at=None)
    unrecorded = dict(window(9, 0, 0), steps=None)
    chart = run_chart(s, status([window(0, 10, 12), unrecorded, window(1, 60, 62, "auto", True)],
                                [stall, still]))  # fmt: skip
    assert [(w["index"], w["kind"], w["first"], w["last"]) for w in chart["windows"]] == [
        (0, "scheduled", 10, 12), (1, "auto", 60, 62)]  # fmt: skip
    assert chart["windows"][0]["marks"] == []
    assert chart["windows"][1]["marks"] == ["SLOWER than windows 0-1 (2): aten::mm x1.50"]
    steps = [[10, 120.0], [12, 130.0], [60, 120.0], [62, 130.0]]
    assert chart["roles"] == [{"role": "policy", "trainer_id": "t", "steps": steps}]
    assert [(x["index"], x["step"], x["seconds"]) for x in chart["stalls"]] == [
        (1, 500, 32.5), (2, 900, None)]  # fmt: skip
    assert chart["series"] is s


def test_watch_draws_the_step_time_the_windows_and_the_stalls_as_text():
    log = PhaseLog()
    log.add([[k, 0.4 if 40 <= k < 50 else 0.1, {}] for k in range(100)])
    stall = {"index": 1, "trainer_id": "t", "last_step": 75, "resumed_step": None,
             "detected_at": 1.0, "resumed_at": None}  # fmt: skip
    chart = run_chart(
        step_series(log), status([window(0, 10, 19), window(1, 60, 69, "capture", True)], [stall])
    )
    lines = render_chart(chart, width=20, height=4)
    assert lines[0] == (
        "step time, steps 0-99 (5 steps a column): mean 130.0 ms, slowest 400.0 ms (step 40)"
    )
    bars = [line[10:] for line in lines[1:5]]
    assert all(len(b) == 20 for b in bars)
    # columns 8-9 (steps 40-49) are 4x the rest: full height there; the rest stand on a
    # floor a row under them (100 - 300 / 4 = 25 ms), 6/8 of a row high
    assert [b[8] for b in bars] == ["█"] * 4 and [b[0] for b in bars] == [" ", " ", " ", "▆"]
    assert lines[1].startswith(" 400.0 ms ") and lines[4].startswith("  25.0 ms ")
    assert lines[5] == "  windows   ss        CC"  # steps 10-19; 60-69 marked slower
    assert lines[6] == "   stalls " + " " * 15 + "!"  # after step 75
    assert render_chart(run_chart(step_series(PhaseLog()), status([])))[0].startswith(
        "step time: no step reported yet"
    )
