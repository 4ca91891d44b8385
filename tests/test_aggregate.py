import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.aggregate import WindowAggregate, empty_summary
from coordinator.protocol.summary_codec import KernelRow, RankSummary


def summary(rank, rows, steps_us=(), window=0, dropped_us=0.0):
    return RankSummary(
        rank,
        window,
        (4, 5),
        False,
        "cuda",
        [KernelRow(n, us, c, 0) for n, us, c in rows],
        dropped_rows=1 if dropped_us else 0,
        dropped_us=dropped_us,
        step_us=[(4 + i, us) for i, us in enumerate(steps_us)],
    )


def test_statistics_count_absent_ranks_as_zero():
    agg = WindowAggregate(0)
    agg.add(summary(0, [("gemm", 30.0, 2), ("copy", 10.0, 1)]))
    agg.add(summary(1, [("gemm", 50.0, 3)], dropped_us=20.0))
    agg.add(summary(2, [("gemm", 10.0, 1), ("copy", 5.0, 4)]))
    gemm, copy = agg.top(5)
    assert gemm["name"] == "gemm" and gemm["total_us"] == 90.0 and gemm["count"] == 6
    assert gemm["mean_us"] == 30.0 and gemm["min_us"] == 10.0 and gemm["max_us"] == 50.0
    assert gemm["max_rank"] == 1 and gemm["ranks_present"] == 3
    assert gemm["std_us"] == pytest.approx(statistics.pstdev([30.0, 50.0, 10.0]))
    assert copy["min_us"] == 0.0 and copy["mean_us"] == 5.0  # rank 1 never ran it
    assert copy["std_us"] == pytest.approx(statistics.pstdev([10.0, 0.0, 5.0]))
    total = 40.0 + 70.0 + 15.0  # rank totals include rank 1's dropped rows
    assert gemm["share"] == pytest.approx(90.0 / total)
    d = agg.to_dict(1)
    assert d["rank_totals"] == {0: 40.0, 1: 70.0, 2: 15.0} and len(d["kernels"]) == 1
    assert d["dropped"] == {"rows": 1, "us": 20.0}


def test_a_repeated_summary_changes_nothing():
    agg = WindowAggregate(0)
    assert agg.add(summary(0, [("a", 1.0, 1)]))
    assert not agg.add(summary(0, [("a", 5.0, 1)]))
    assert agg.top(1)[0]["total_us"] == 1.0 and agg.duplicates == 1


def test_empty_summary_shape_matches_a_real_one():
    agg = WindowAggregate(3)
    agg.add(summary(0, [("a", 1.0, 1)]))
    assert set(empty_summary()) == set(agg.to_dict(5))


def test_per_rank_values_and_dropping_them():
    agg = WindowAggregate(0)
    agg.add(summary(0, [("a", 1.0, 1)]))
    agg.add(summary(1, [("b", 2.0, 1), ("a", 3.0, 1)]))
    assert agg.per_rank(["a", "b"]) == {"a": {0: 1.0, 1: 3.0}, "b": {0: 0.0, 1: 2.0}}
    agg.drop_detail()
    assert agg.per_rank(["a"]) is None
    assert agg.to_dict(5, per_rank=True)["per_rank"] is None


def saved_and_back(agg: WindowAggregate) -> WindowAggregate:
    """``agg`` through the store's codec, as a restarted coordinator reads it."""
    import msgspec

    from coordinator.core.aggregate import restored_aggregate, saved_aggregate
    from coordinator.core.saved import AggregateFile

    blob = msgspec.msgpack.encode(saved_aggregate(agg))
    return restored_aggregate(msgspec.msgpack.decode(blob, type=AggregateFile))


def test_each_rank_s_steps_are_kept_for_the_step_strip_and_survive_a_checkpoint():
    agg = WindowAggregate(0)
    agg.add(summary(0, [("a", 1.0, 1)], steps_us=(1000.0, 1500.0)))
    agg.add(summary(1, [("a", 1.0, 1)], steps_us=(1200.0, 4000.0)))
    strip = {0: [[4, 1.0], [5, 1.5]], 1: [[4, 1.2], [5, 4.0]]}
    assert agg.to_dict(5, per_rank=True)["rank_steps"] == strip
    assert agg.to_dict(5)["rank_steps"] is None  # only with the per-rank views
    restored = saved_and_back(agg)
    assert restored.step_strip() == strip
    assert restored.to_dict(5, per_rank=True) == agg.to_dict(5, per_rank=True)
    agg.drop_detail()  # the per-rank kernel values go; the step times are small and stay
    assert agg.to_dict(5, per_rank=True)["rank_steps"] == strip
    restored.add(summary(2, [("a", 1.0, 1)], steps_us=(900.0,)))  # it goes on folding
    assert restored.step_strip()[2] == [[4, 0.9]]


def test_stragglers_are_flagged_against_the_median():
    agg = WindowAggregate(0)
    for rank, kernel_us, step_us in ((0, 100.0, 1000.0), (1, 110.0, 1000.0), (2, 300.0, 1500.0)):
        agg.add(summary(rank, [("k", kernel_us, 1)], steps_us=(step_us, step_us)))
    s = agg.stragglers(1.25)
    assert s["flagged"] == [2]
    assert s["ranks"][2]["compute_ratio"] == pytest.approx(300 / 110)
    assert s["ranks"][2]["step_ratio"] == pytest.approx(1.5)
    assert s["ranks"][0]["flagged"] is False


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.dictionaries(st.sampled_from("abcdef"), st.floats(0, 1e6), max_size=6),
        min_size=1,
        max_size=8,
    )
)
def test_running_sums_equal_a_direct_computation(per_rank):
    """Sums are kept in whole nanoseconds: each value counts to within 0.5 ns."""
    agg = WindowAggregate(0)
    for r, rows in enumerate(per_rank):
        agg.add(summary(r, [(n, us, 1) for n, us in rows.items()]))
    n = len(per_rank)
    ns = 0.5e-3 * n
    for row in agg.top(10):
        values = [rows.get(row["name"], 0.0) for rows in per_rank]
        assert row["total_us"] == pytest.approx(sum(values), abs=ns)
        assert row["min_us"] == min(values)
        assert row["max_us"] == max(values)
        assert row["std_us"] == pytest.approx(
            statistics.pstdev(values), abs=1e-6 * max(values) + 1e-3
        )
        assert math.isclose(row["mean_us"], sum(values) / n, rel_tol=1e-9, abs_tol=ns / n)


def test_cuda_ranks_are_judged_by_each_step_s_device_time_not_the_cpu_s():
    """The CPUs of both ranks step alike (the launches return at once); rank 1's device takes
    twice as long for each step, and is the straggler; rank 0's steps are launch-bound."""
    from coordinator.protocol.summary_codec import Breakdown, LaunchRow

    agg = WindowAggregate(0)
    for rank, span in ((0, 10_000.0), (1, 20_000.0), (2, 10_500.0)):
        s = summary(rank, [("gemm", span, 2)], steps_us=(30_000.0, 30_000.0))
        s.step_device = [(4, span * 0.9, span), (5, span * 0.9, span)]
        s.breakdown = Breakdown(compute_us=1.8 * span, window_us=2 * span)
        if rank == 0:
            s.launch, s.launch_bound = LaunchRow(40, 3.0, 9.0, 0.8), [5]
        agg.add(s)
    st = agg.stragglers(1.25)
    assert st["median_step_ms"] == 10.5  # device spans, not the CPU's 30 ms steps
    assert st["ranks"][1]["step_ms"] == 20.0 and st["flagged"] == [1]
    assert st["launch_bound"] == [0] and st["ranks"][0]["launch_bound"] == [5]
    d = agg.to_dict(5)
    assert d["device_steps"][1] == [[4.0, 18_000.0, 20_000.0], [5.0, 18_000.0, 20_000.0]]
    assert d["launch"][0]["launch_bound"] == [5] and d["launch"][0]["short_share"] == 0.8
    assert list(d["launch"]) == [0]  # only rank 0 sent launch statistics
