"""Window diffs: pure on kernel_summary() replies, then on a real run whose second window does
sixteen times the work (regression marks, judged against a run's spread, are tests/test_marks*)."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as hs

from coordinator import get_or_create_coordinator
from coordinator.core.window_diff import _summary, kernel_diff, per_step_us
from coordinator.ops import notebook as nb
from coordinator.ops.cli import main as cli_main
from coordinator.ops.tables import render_diff
from tests.configs import profiler_config
from tests.fault_cases import wait_for_windows

TOTALS = hs.dictionaries(hs.sampled_from([f"k{i}" for i in range(12)]), hs.floats(1, 1e6))


@given(TOTALS, TOTALS, hs.integers(1, 8), hs.integers(1, 8))
def test_a_diff_lists_every_kernel_once_ordered_by_absolute_change(ta, tb, ranks, steps):
    a = _summary(0, [0, steps - 1], ranks, ta, step_ms=1.0)
    b = _summary(1, [10, 10 + steps], ranks + 1, tb, step_ms=2.0)
    d = kernel_diff(a, b, top_k=100)
    assert sorted(k["name"] for k in d["kernels"]) == sorted(ta.keys() | tb.keys())
    changes = [abs(k["change_us"]) for k in d["kernels"]]
    assert changes == sorted(changes, reverse=True)
    assert set(d["new"]) == tb.keys() - ta.keys() and set(d["vanished"]) == ta.keys() - tb.keys()
    pa, pb = per_step_us(a), per_step_us(b)
    for k in d["kernels"]:
        assert k["a_us"] == pytest.approx(pa.get(k["name"], 0.0), abs=1e-3)
        assert k["b_us"] == pytest.approx(pb.get(k["name"], 0.0), abs=1e-3)
    assert d["step_ratio"] == 2.0


def test_per_step_times_compare_windows_of_different_lengths_and_rank_counts():
    a = _summary(0, [1, 2], 2, {"mm": 400.0}, step_ms=10.0)  # 2 ranks x 2 steps
    b = _summary(1, [5, 8], 4, {"mm": 1600.0}, step_ms=10.0)  # 4 ranks x 4 steps: same rate
    assert kernel_diff(a, b)["kernels"][0]["ratio"] == 1.0


def test_a_window_doing_sixteen_times_the_work_shows_in_the_diff_and_is_not_marked_early(
    ray_session, ray_actors, toy_workers, tmp_path, capsys
):
    ray = ray_session
    cfg = profiler_config(tmp_path, wait=1, warmup=1, active=2, repeat=3, regression_threshold=1.5)
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    coord = get_or_create_coordinator(cfg, name=name, namespace="profiler-tests")
    ray_actors.append(coord)
    workers = toy_workers(2)
    ray.get([w.train_step.remote(4) for w in workers])  # warm, so window 0 is a fair baseline
    ray.get(coord.register.remote("t", workers))
    ray.get(coord.start.remote("t", 0))
    # windows: record 2-3 | 6-7 (16x the work) | 10-11.
    for k in range(12):
        repeat = 16 if 4 <= k < 8 else 1
        ray.get([w.train_step.remote(repeat) for w in workers])
        ray.get(coord.step.remote("t", k))
    ray.get(coord.stop.remote("t"))
    st = wait_for_windows(ray, coord)
    marks = {w["index"]: w["regression"] for w in st["windows"]}
    assert marks[0] is None  # the baseline: the run's first complete scheduled window
    # Two windows cannot show the run's spread: judged on nothing, so nothing is marked.
    assert [marks[i]["reference"] for i in (1, 2)] == [[0], [0, 1]]
    assert not any(marks[i]["judged"] or marks[i]["kernels"] for i in (1, 2))
    assert not marks[1]["step_regressed"]
    assert st["windows"][1]["roles"]["t"]["regression"] == marks[1]
    # The diff says where the time went: self time per rank and step, kernel by kernel.
    rate = {
        w: per_rank_step_us(ray.get(coord.kernel_summary.remote(window=w, top_k=10_000)))
        for w in (0, 1)
    }
    d = ray.get(coord.kernel_diff.remote(0, 1, top_k=10_000))
    for k in d["kernels"]:
        if k["status"] == "changed":
            want = rate[1][k["name"]] / rate[0][k["name"]]
            assert k["ratio"] == pytest.approx(want, rel=0.01)
    # The work per step, every kernel summed, tells the windows apart.
    totals = {w: ray.get(coord.kernel_diff.remote(0, w, top_k=0))["total_us"] for w in (1, 2)}
    grew = {w: b / a for w, (a, b) in totals.items()}
    assert grew[1] >= 2.0 and grew[1] > 2.0 * grew[2], totals
    assert st["metrics"]["values"]["profiler_regressions"] == 0

    d = ray.get(coord.kernel_diff.remote(0, 1, top_k=10))
    assert d["a"]["window"] == 0 and d["b"]["window"] == 1 and len(d["kernels"]) == 10
    frame = nb.diff_frame(d)
    assert frame.iloc[0]["change_us"] == d["kernels"][0]["change_us"]
    where = ["--name", name, "--namespace", "profiler-tests"]
    assert cli_main(["diff", "0", "1", *where]) == 0
    out = capsys.readouterr().out
    assert "against window 0" in out and "aten::addmm" in out
    assert render_diff(d).splitlines()[0] == out.splitlines()[0]
    assert cli_main(["status", *where]) == 0
    assert "SLOWER" not in capsys.readouterr().out
    with pytest.raises(ray.exceptions.RayTaskError, match="no window 9"):
        ray.get(coord.kernel_diff.remote(0, 9))

    # The operator pins window 1: the reference starts there, window 0 is before it.
    pinned = ray.get(coord.pin_baseline.remote(1))
    assert pinned == {"run": st["run"]["name"], "baseline": 1, "pinned": True}
    st = ray.get(coord.status.remote())
    marks = {w["index"]: w["regression"] for w in st["windows"]}
    assert marks[0] is None and marks[1] is None and marks[2]["reference"] == [1]
    assert ray.get(coord.pin_baseline.remote(None))["baseline"] == 0
    st = ray.get(coord.status.remote())
    assert {w["index"]: w["regression"] for w in st["windows"]}[2]["reference"] == [0, 1]
    assert st["counters"].get("regressions", 0) == 0


def per_rank_step_us(ks: dict) -> dict[str, float]:
    """Each kernel's self time per rank and per recorded step, from a raw table."""
    n = len(ks["ranks"]) * (ks["steps"][1] - ks["steps"][0] + 1)
    return {k["name"]: k["total_us"] / n for k in ks["kernels"]}
