"""The slowdown detector on its own: step times estimated from report times, a rolling median
baseline, no false alarms on jitter, cooldown and a per-run maximum. Pure, milliseconds."""

import random

import pytest

from coordinator.core.config import ProfilerConfig
from coordinator.core.slowdown import AutoCapture, SlowdownDetector


def reports(step_s, report_every_s=0.1):
    """(step, time) as a StepClient sends them: at most one report per ``report_every_s``."""
    t, last_sent, out = 0.0, -1.0, []
    for k, dt in enumerate(step_s):
        t += dt
        if t - last_sent >= report_every_s:
            out.append((k, t))
            last_sent = t
    return out


def run(detector, step_s, windows=(), accept=True):
    """Feed ``detector`` the reports of these step times; ``windows``: (first, last) steps
    profiled (reports inside them say so). Returns the triggers, each accepted."""
    found = []
    for k, t in reports(step_s):
        in_window = any(first <= k <= last for first, last in windows)
        trig = detector.observe(k, t, in_window)
        if trig is not None:
            found.append(trig)
            if accept:
                detector.accepted(trig)
    return found


def jittery(n, base=0.02, jitter=0.3, seed=0):
    rng = random.Random(seed)
    return [base * rng.uniform(1 - jitter, 1 + jitter) for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_a_steady_run_with_30_percent_jitter_makes_no_capture_in_2000_steps(seed):
    det = SlowdownDetector(AutoCapture(enable=True))
    assert run(det, jittery(2000, seed=seed)) == []
    assert det.baseline_s() == pytest.approx(0.02, rel=0.1)


def test_jitter_reported_on_every_step_makes_no_capture_either():
    det = SlowdownDetector(AutoCapture(enable=True))
    steps = jittery(2000, seed=7)
    t = 0.0
    for k, dt in enumerate(steps):
        t += dt
        assert det.observe(k, t, False) is None


def test_a_slowdown_triggers_within_a_few_steps_and_says_how_much():
    det = SlowdownDetector(AutoCapture(enable=True, after_steps=10))
    (trig,) = run(det, jittery(300) + [0.06] * 100)
    assert 300 <= trig["slow_steps"][0] <= 305 and trig["step"] <= 300 + 20
    assert trig["ratio"] == pytest.approx(3.0, rel=0.2)
    assert trig["baseline_ms"] == pytest.approx(20, rel=0.1)
    assert trig["recent_ms"] == pytest.approx(60, rel=0.1)


def test_fewer_slow_steps_than_after_steps_make_no_capture():
    det = SlowdownDetector(AutoCapture(enable=True, after_steps=30))
    steps = jittery(300) + [0.06] * 20 + jittery(200, seed=1)
    assert run(det, steps) == []


def test_warm_up_steps_at_the_start_of_a_run_are_ignored():
    det = SlowdownDetector(AutoCapture(enable=True, ignore_first=100))
    steps = [0.02] * 60 + [0.2] * 30 + [0.02] * 300  # slow, compiling, then steady
    assert run(det, steps) == []


def test_profiled_windows_and_the_step_after_them_are_not_measured():
    det = SlowdownDetector(AutoCapture(enable=True, after_steps=5))
    steps = [0.02] * 300 + [0.08] * 10 + [0.02] * 300
    assert run(det, steps, windows=[(300, 309)]) == []
    assert max(det.baseline) < 0.03  # the window's steps never entered the baseline


def test_cooldown_and_the_per_run_maximum_hold():
    cfg = AutoCapture(enable=True, after_steps=5, cooldown_steps=100, max_per_run=2)
    cfg.baseline_steps = 2000  # a baseline that keeps the steady steps' median
    det = SlowdownDetector(cfg)
    trigs = run(det, [0.02] * 300 + [0.06] * 600)
    assert len(trigs) == 2 and trigs[1]["step"] - trigs[0]["step"] >= 100
    assert det.captures == 2


def test_a_refused_capture_is_asked_again_later_not_counted():
    det = SlowdownDetector(AutoCapture(enable=True, after_steps=5, cooldown_steps=1000))
    trigs = run(det, [0.02] * 300 + [0.06] * 100, accept=False)
    assert len(trigs) > 1 and det.captures == 0  # asked again while nothing was planned
    det.refused(trigs[-1]["step"])
    k, t = det.last
    assert det.observe(k + 2, t + 0.12, False) is None  # backing off after a refusal


def test_a_long_slowdown_becomes_the_new_baseline():
    cfg = AutoCapture(enable=True, after_steps=5, cooldown_steps=50, baseline_steps=100)
    det = SlowdownDetector(cfg)
    trigs = run(det, [0.02] * 300 + [0.06] * 600)
    assert len(trigs) == 1  # profiled once, then it is how this run steps now


def test_the_clock_of_an_earlier_process_is_never_compared():
    det = SlowdownDetector(AutoCapture(enable=True, after_steps=1))
    run(det, [0.02] * 300)
    k, t = det.last
    det.forget_clock()
    # Measured against the old clock, one step in 10 s would be 500x the baseline, and one slow
    # step is enough (after_steps=1): only a forgotten clock lets this report through quietly.
    assert det.observe(k + 1, t + 10.0, False) is None
    assert det.last == (k + 1, t + 10.0)  # the new clock: the next interval is measured from it
    assert det.observe(k + 2, t + 10.02, False) is None


@pytest.mark.parametrize(
    "field,value,pattern",
    [
        ("slowdown_ratio", 1.0, "'auto_capture.slowdown_ratio' must be a finite number > 1"),
        ("slowdown_ratio", None, "'auto_capture.slowdown_ratio' must be a finite number > 1"),
        ("after_steps", 0, "'auto_capture.after_steps' must be an int >= 1"),
        ("cooldown_steps", None, "'auto_capture.cooldown_steps' must be an int >= 0"),
        ("enable", "yes", "'auto_capture.enable' must be true or false"),
        ("baseline_steps", 5, "'auto_capture.baseline_steps' must be an int >= 20"),
    ],
)
def test_bad_auto_capture_values_name_the_field(field, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        ProfilerConfig.from_dict({"auto_capture": {field: value}})


def test_auto_capture_must_be_a_mapping_of_known_keys():
    with pytest.raises(ValueError, match="'auto_capture' must be a mapping"):
        ProfilerConfig.from_dict({"auto_capture": None})
    with pytest.raises(ValueError, match="unknown key 'auto_capture.ratio'"):
        ProfilerConfig.from_dict({"auto_capture": {"ratio": 2}})


def test_auto_capture_round_trips_through_the_config_dict_and_is_off_by_default():
    cfg = ProfilerConfig.from_dict({"auto_capture": {"enable": True, "after_steps": 4}})
    again = ProfilerConfig.from_dict(cfg.to_dict())
    assert again.auto_capture == cfg.auto_capture and again.auto_capture.after_steps == 4
    assert ProfilerConfig().auto_capture.enable is False


def test_the_notebook_shows_why_an_auto_window_was_taken():
    from coordinator.ops import notebook as nb

    trigger = {
        "step": 312,
        "ratio": 2.3,
        "baseline_ms": 23.3,
        "recent_ms": 53.4,
        "slow_steps": [297, 306],
        "region": None,
    }
    window = {"steps": [101, 102], "partial": False, "ranks": [0, 1], "trace_dir": "/t/w0"}
    status = {
        "windows": [
            {**window, "index": 0, "kind": "scheduled", "trigger": None},
            {**window, "index": 1, "kind": "auto", "trigger": trigger, "steps": [309, 310]},
        ]
    }
    frame = nb.windows_frame(status)
    assert list(frame["kind"]) == ["scheduled", "auto"]
    assert frame.loc[1, "ratio"] == 2.3 and frame.loc[1, "trigger_step"] == 312
    assert frame.loc[0, "ratio"] is None or frame["ratio"].isna()[0]
