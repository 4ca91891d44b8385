"""Regression marks judged against the run's own spread (coordinator/core/marks.py): pure, on
simulated runs whose noise is known."""

from __future__ import annotations

import random

import pytest

from coordinator.core.marks import (
    KEPT_KERNELS,
    MIN_REFERENCE,
    REFERENCE_WINDOWS,
    WindowProfile,
    _profile,
    confirm,
    judge,
    pick_reference,
    profile,
)
from coordinator.core.window_diff import _summary
from coordinator.ops.tables import regression_text
from coordinator.protocol.replies import RegressionEntry

# A step of 10 ms: one large op, a few middling ones, an optimizer that does not scale with the
# batch, and microsecond ops that a preemption makes 5x longer.
OPS = {"mm": 3000.0, "conv": 2000.0, "gelu": 1200.0, "adamw": 900.0, "copy": 400.0}
TINY = {f"tiny{i}": 8.0 for i in range(6)}


def window(i: int, rng: random.Random, slow: dict[str, float] | None = None) -> WindowProfile:
    """Window ``i`` of a steady run: the batch (every op but the optimizer) +-20%, each op
    +-5% of its own, the tiny ops anywhere from 0.3x to 5x; ``slow``: ops made slower."""
    batch = rng.uniform(0.8, 1.2)
    us = {}
    for name, base in OPS.items():
        scale = 1.0 if name == "adamw" else batch
        us[name] = base * scale * rng.uniform(0.95, 1.05) * (slow or {}).get(name, 1.0)
    us |= {n: t * rng.uniform(0.3, 5.0) for n, t in TINY.items()}
    step_ms = sum(us.values()) / 1000.0 * rng.uniform(1.0, 1.1)  # plus some idle
    return _profile(i, us, step_ms)


def run(
    n: int, seed: int, slow_from: int | None = None, slow: dict[str, float] | None = None
) -> list[RegressionEntry | None]:
    """``n`` windows judged as the coordinator judges them (window 0 the baseline)."""
    rng = random.Random(seed)
    late = [slow_from is not None and i >= slow_from for i in range(n)]
    return judged([window(i, rng, slow if late[i] else None) for i in range(n)])


def judged(profiles: list[WindowProfile]) -> list[RegressionEntry | None]:
    """Each window judged in turn, as the coordinator does (the first is the baseline)."""
    earlier: list[tuple[int, WindowProfile, RegressionEntry | None]] = []
    marks: list[RegressionEntry | None] = []
    for i, p in enumerate(profiles):
        m = None
        if i > 0:
            ref = pick_reference(i, 0, earlier)
            prev = marks[-1] if marks[-1] and marks[-1]["judged"] else None
            m = judge(p, ref, threshold=1.25, baseline=0, run="r", trainer_id="t", previous=prev)
            confirm(prev, m)
        earlier.append((i, p, m))
        marks.append(m)
    return marks


def marked(m: RegressionEntry | None) -> list[str]:
    if m is None:
        return []
    return [k["name"] for k in m["kernels"]] + (["step"] if m["step_regressed"] else [])


def suspected(m: RegressionEntry) -> list[str]:
    return [k["name"] for k in m["suspects"]] + (["step"] if m["step_suspect"] else [])


SEEDS = range(200)


def test_a_steady_run_with_twenty_percent_jitter_is_marked_at_most_once_in_8000_windows():
    runs = [run(40, seed) for seed in SEEDS]
    false = [
        (seed, i)
        for seed, ms in zip(SEEDS, runs, strict=True)
        for i, m in enumerate(ms)
        if marked(m)
    ]
    assert len(false) <= 1, false  # (0 or 1 of 6,400 judged windows, by the seeds chosen)
    assert all(m["judged"] for ms in runs for m in ms[MIN_REFERENCE + 1 :])
    assert [marked(m) for m in run(40, 1)] == [[]] * 40


def test_one_op_made_one_and_a_half_times_slower_is_marked_from_that_window_on():
    runs = [run(30, 10_000 + seed, slow_from=10, slow={"conv": 1.5}) for seed in SEEDS]
    names = [[[k["name"] for k in m["kernels"]] if m else [] for m in ms] for ms in runs]
    assert all(ns[:10] == [[]] * 10 for ns in names)  # nothing before
    assert {n for ns in names for w in ns for n in w} == {"conv"}  # that op only
    # Marked at window 10 and after: in 99% of the windows (the misses are windows whose batch
    # was 20% smaller, so that the op, 1.5x slower, took only 1.2x its usual time).
    hits = [w == ["conv"] for ns in names for w in ns[10:]]
    assert sum(hits) >= 0.99 * len(hits), f"{len(hits) - sum(hits)} of {len(hits)} missed"
    assert sum(ns[10] == ["conv"] for ns in names) >= 0.98 * len(runs)
    # (The step, 13% slower with it, is marked when its rise passes the step's own spread: it
    # did get slower. Nothing is asserted of it here.)
    marks = runs[0]
    k = marks[10]["kernels"][0]
    assert k["ratio"] == pytest.approx(1.5, rel=0.12) and k["ratio"] > k["bar"]
    # A lasting regression is not learned as the norm: the reference stays on windows 0-9.
    assert marks[29]["reference"] == list(range(10))
    assert regression_text(marks[10]).startswith("SLOWER than windows 0-9 (10): conv x1.")


def test_nothing_is_marked_before_the_run_has_shown_its_spread():
    ref = [_profile(i, {"mm": 300.0, "add": 700.0}, 1.0) for i in range(MIN_REFERENCE - 1)]
    huge = _profile(9, {"mm": 4800.0, "add": 700.0}, 16.0)
    e = judge(huge, ref, threshold=1.25, baseline=0, run="r", trainer_id="t")
    assert not e["judged"] and e["suspects"] == [] and not e["step_suspect"]
    assert e["step_ratio"] == 16.0 and e["step_bar"] is None and regression_text(e) == ""
    e = judge(huge, [*ref, ref[0]], threshold=1.25, baseline=0, run="r", trainer_id="t")
    assert e["judged"] and suspected(e) == ["mm", "step"] and marked(e) == []


def test_a_rise_must_pass_the_spread_the_threshold_and_matter_to_the_step():
    steady = {"mm": 3000.0, "add": 6000.0, "tiny": 20.0}
    ref = [_profile(i, steady, 10.0) for i in range(MIN_REFERENCE)]  # identical: 5% floor

    def kernels(us: dict[str, float], threshold: float = 1.25) -> list[str]:
        e = judge(_profile(5, us, 10.0), ref, threshold=threshold, baseline=0, run="r",
                  trainer_id="t")  # fmt: skip
        return [k["name"] for k in e["suspects"]]

    assert kernels({**steady, "mm": 3000.0 * 1.19}) == []  # within the bar (1.2)
    assert kernels({**steady, "mm": 3000.0 * 1.22}) == []  # past the bar, under the threshold
    assert kernels({**steady, "mm": 3000.0 * 1.22}, threshold=1.21) == ["mm"]
    assert kernels({**steady, "tiny": 200.0}) == []  # 10x, but 2% of the step
    assert kernels({**steady, "tiny": 400.0}) == ["tiny"]  # 20x: 4% of the step
    assert kernels({**steady, "new": 5000.0}) == []  # new: the diff lists it, no mark


def test_a_noisy_kernel_needs_a_rise_beyond_its_own_spread():
    rng = random.Random(7)
    ref = [
        _profile(i, {"mm": 3000.0, "allreduce": 3000.0 * rng.uniform(0.5, 2.0)}, 10.0)
        for i in range(12)
    ]
    e = judge(_profile(12, {"mm": 3000.0, "allreduce": 6000.0}, 10.0), ref, threshold=1.25,
              baseline=0, run="r", trainer_id="t")  # fmt: skip
    assert e["suspects"] == []  # 2x a kernel that waits on its peers: within its spread
    bar = e["suspects"] or judge(
        _profile(12, {"mm": 3000.0, "allreduce": 60000.0}, 66.0), ref, threshold=1.25,
        baseline=0, run="r", trainer_id="t")["suspects"]  # fmt: skip
    assert [k["name"] for k in bar] == ["allreduce"]


def test_the_step_time_is_judged_against_its_spread_too():
    rng = random.Random(3)
    ref = [_profile(i, {"mm": 5.0}, 10.0 * rng.uniform(0.8, 1.2)) for i in range(10)]
    calm = judge(_profile(10, {"mm": 5.0}, 12.4), ref, threshold=1.25, baseline=0, run="r",
                 trainer_id="t")  # fmt: skip
    assert not calm["step_suspect"] and calm["step_bar"] > 1.25
    slow = judge(_profile(10, {"mm": 5.0}, 20.0), ref, threshold=1.25, baseline=0, run="r",
                 trainer_id="t")  # fmt: skip
    assert slow["step_suspect"] and slow["step_ratio"] == pytest.approx(2.0, rel=0.2)


def test_the_reference_is_the_recent_unmarked_windows_from_the_baseline_on():
    p = {i: _profile(i, {"mm": 1.0}, 1.0) for i in range(100)}
    slow: RegressionEntry = judge(p[0], [p[1]] * 3, threshold=1.0001, baseline=0, run="r",
                                  trainer_id="t")  # fmt: skip
    slow["step_suspect"] = True  # beyond its bar, marked or not: out of the reference
    earlier = [(i, p[i], slow if i in (6, 7) else None) for i in range(100)]
    assert [q["window"] for q in pick_reference(10, 3, earlier)] == [3, 4, 5, 8, 9]
    ref = pick_reference(99, 0, earlier)
    assert len(ref) == REFERENCE_WINDOWS and ref[-1]["window"] == 98


def test_a_profile_is_the_least_rank_per_step_and_bounded():
    totals = {f"k{i}": 1000.0 + i for i in range(KEPT_KERNELS + 50)} | {"speck": 0.001}
    s = _summary(4, [10, 13], 2, totals, step_ms=9.0)  # 2 ranks x 4 steps
    for k in s["kernels"]:  # rank 1 was preempted inside every kernel: 3x rank 0's time
        k["min_us"] = k["total_us"] / 4
    p = profile(s)
    assert p["window"] == 4 and p["step_ms"] == 9.0
    assert p["busy_us"] == pytest.approx(sum(totals.values()) / 16, abs=0.01)
    assert len(p["us"]) == KEPT_KERNELS and "speck" not in p["us"]
    assert p["us"][f"k{KEPT_KERNELS + 49}"] == pytest.approx(
        (1000 + KEPT_KERNELS + 49) / 16, abs=1e-3
    )
    with pytest.raises(ValueError, match="one window"):
        profile({**s, "window": None})


def test_one_window_beyond_its_bar_is_a_suspect_and_two_in_a_row_are_marked():
    ref = [_profile(i, {"mm": 3000.0, "add": 7000.0}, 10.0) for i in range(MIN_REFERENCE)]

    def entry(i: int, mm: float, step_ms: float) -> RegressionEntry:
        p = _profile(i, {"mm": mm, "add": 7000.0}, step_ms)
        return judge(p, ref, threshold=1.25, baseline=0, run="r", trainer_id="t")

    calm, spike, calm2 = entry(8, 3000.0, 10.0), entry(9, 6000.0, 13.0), entry(10, 3000.0, 10.0)
    assert not confirm(calm, spike) and not confirm(spike, calm2)
    assert suspected(spike) == ["mm", "step"] and marked(spike) == [] == marked(calm2)
    assert regression_text(spike) == ""  # a suspect alone is not shown as slower
    a, b, c = entry(11, 4500.0, 15.0), entry(12, 4600.0, 15.0), entry(13, 4400.0, 15.0)
    assert confirm(None, a) is False and marked(a) == []
    assert confirm(a, b) is True and marked(a) == ["mm", "step"] == marked(b)
    assert confirm(b, c) is False and marked(c) == ["mm", "step"]  # (b was marked already)
    assert regression_text(b).startswith("SLOWER than windows 0-7 (8): step x1.50, mm x1.")


def test_the_status_text_names_the_role_whose_window_was_marked():
    from coordinator.ops.tables import marks_lines
    from tests.test_web import two_role_window_marked_on_rollout

    w = two_role_window_marked_on_rollout()
    lines = marks_lines(w)
    assert len(lines) == 1 and lines[0].startswith("rollout: SLOWER than windows 0-7 (8): aten::mm")
    w["roles"].pop("t")  # one role: not named
    assert marks_lines(w)[0].startswith("SLOWER than windows 0-7 (8): aten::mm x1.5")


def test_a_marked_kernel_stays_marked_while_it_stays_past_the_threshold():
    spread = [2400.0, 2700.0, 3000.0, 3300.0, 3600.0, 2550.0, 3150.0, 3450.0]
    ref = [_profile(i, {"mm": mm, "add": 7000.0}, 10.0) for i, mm in enumerate(spread)]

    def entry(mm: float, previous: RegressionEntry | None = None) -> RegressionEntry:
        p = _profile(9, {"mm": mm, "add": 7000.0}, 10.0)
        return judge(p, ref, threshold=1.25, baseline=0, run="r", trainer_id="t",
                     previous=previous)  # fmt: skip

    a, b = entry(6000.0), entry(6000.0)
    assert confirm(a, b) and marked(b) == ["mm"]
    dip = entry(3900.0, previous=b)  # 1.3x: under its bar, past the threshold
    (row,) = [k for k in dip["kernels"] if k["name"] == "mm"]
    assert row["ratio"] >= 1.25 and row["ratio"] < row["bar"]
    assert suspected(dip) == [] and marked(dip) == ["mm"]
    back = entry(3000.0, previous=dip)
    assert marked(back) == [] and marked(entry(3900.0, previous=back)) == []


def test_one_kernel_waiting_on_its_peers_does_not_hide_another_ones_rise():
    steady = {"mm": 3000.0, "add": 3000.0, "allreduce": 1000.0}
    ref = [_profile(i, steady, 7.5) for i in range(MIN_REFERENCE)]
    p = _profile(9, {"mm": 4500.0, "add": 3000.0, "allreduce": 28000.0}, 36.0)
    e = judge(p, ref, threshold=1.25, baseline=0, run="r", trainer_id="t")
    assert sorted(suspected(e)) == ["allreduce", "mm", "step"]
    mm = next(k for k in e["suspects"] if k["name"] == "mm")
    assert mm["ratio"] > 1.4  # against the rest without the wait (with it: 0.19)


def test_a_slower_mode_of_other_ops_neither_marks_nor_hides_an_op():
    # As the real reference trainer's windows can be (tests/test_marks_real_run.py, 2 ranks
    # sharing 2 cores): one op 45% of the time and steady within 3%, while in about 1 window of 4
    # the matmuls take 2.2x and two elementwise ops 3x (a third of the other ops' time). Compared
    # by its share of the window, as marks were first, the op's spread took that mode in and
    # hid its 1.5x rise in 48 of these 50 runs; scaled by the window's median ratio, it does not.
    def windows(seed: int, slow_from: int | None) -> list[WindowProfile]:
        rng, out = random.Random(seed), []
        for i in range(24):
            mode = rng.random() < 0.25
            us = {
                "i0": 7000.0 * rng.uniform(0.97, 1.03),
                "mm": 1900.0 * (2.2 if mode else 1.0) * rng.uniform(0.95, 1.05),
                "relu_bwd": 300.0 * (3.0 if mode else 1.0),
                "softmax_bwd": 300.0 * (3.0 if mode else 1.0),
                "adamw": 700.0 * rng.uniform(0.95, 1.05),
                "copy": 700.0 * rng.uniform(0.95, 1.05),
                "addmm": 600.0 * rng.uniform(0.95, 1.05),
                "attn_bwd": 550.0 * rng.uniform(0.95, 1.05),
                "gelu": 500.0 * rng.uniform(0.95, 1.05),
                "layer_norm": 400.0 * rng.uniform(0.95, 1.05),
                "embedding_bwd": 400.0 * rng.uniform(0.95, 1.05),
                "fill": 300.0 * rng.uniform(0.95, 1.05),
            }
            if slow_from is not None and i >= slow_from:
                us["i0"] *= 1.5
            out.append(_profile(i, us, sum(us.values()) / 1000.0 * 2.5))
        return out

    def i0(marks: list[RegressionEntry | None]) -> list[bool]:
        return [bool(m) and "i0" in marked(m) for m in marks]

    # (The mode itself, in two windows in a row, can mark mm: it took 2.2x. Not asserted here.)
    for seed in range(50):
        assert not any(i0(judged(windows(seed, None)))), seed
        assert i0(judged(windows(seed, 10))) == [False] * 10 + [True] * 14, seed


def test_an_op_of_most_of_the_window_made_slower_is_still_marked():
    # Left out of its own window's scale, an op of 70% of the time does not scale itself away.
    rng = random.Random(11)
    profiles = []
    for i in range(20):
        us = {n: t * rng.uniform(0.97, 1.03) for n, t in {"big": 7000.0, "a": 1000.0,
              "b": 1000.0, "c": 1000.0}.items()}  # fmt: skip
        us["big"] *= 1.5 if i >= 10 else 1.0
        profiles.append(_profile(i, us, sum(us.values()) / 1000.0))
    marks = judged(profiles)
    assert [[k["name"] for k in m["kernels"]] if m else [] for m in marks] == [[]] * 10 + [
        ["big"]
    ] * 10  # (and the step, 1.35x)
    assert marks[10] and marks[10]["kernels"][0]["ratio"] == pytest.approx(1.5, rel=0.05)
