"""Node partials: a table built from them equals the one built from per-rank summaries, and
their decoder is as strict as the summaries'."""

import contextlib
import math
import random

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.aggregate import WindowAggregate
from coordinator.core.partial import fold_summaries, merge_partials
from coordinator.protocol.partial_codec import (
    MAX_PARTIAL_TOP,
    decode_partial,
    encode_partial,
)
from coordinator.protocol.summary_codec import (
    Breakdown,
    KernelRow,
    LaunchRow,
    MemoryRow,
    OpRow,
    RankSummary,
    StreamRow,
    SummaryDecodeError,
    decode_summary,
    encode_summary,
)

times = st.floats(min_value=0, max_value=1e7, allow_nan=False, allow_infinity=False)
names = st.sampled_from([f"k{i}" for i in range(12)] + ["aten::mm", "nccl:all_reduce"])


@st.composite
def window_summaries(draw):
    """Summaries of one window from 1-24 ranks, with repeated values (ties) likely; a CUDA
    window's ranks carry ops, device step times and launches too."""
    n = draw(st.integers(1, 24))
    steps = (10, 10 + draw(st.integers(0, 5)))
    pool = draw(st.lists(times, min_size=1, max_size=6))
    value = st.sampled_from(pool) | times
    device = draw(st.sampled_from(["cpu", "cuda"]))
    out = []
    for rank in draw(st.permutations(range(n * 2)))[:n]:
        peak = draw(st.none() | st.integers(0, 2**40))
        cuda = device == "cuda"
        ops = (
            [
                OpRow(
                    op,
                    draw(value),
                    draw(times),
                    draw(st.integers(0, 50)),
                    [(k, draw(value)) for k in draw(st.lists(names, unique=True, max_size=5))],
                )
                for op in draw(st.lists(names, unique=True, max_size=6))
            ]
            if cuda
            else []
        )
        out.append(
            RankSummary(
                rank=rank,
                window=3,
                steps=steps,
                partial=draw(st.booleans()),
                device=device,
                unattributed_us=draw(times) if cuda else 0.0,
                step_device=[(s, draw(times), draw(times)) for s in range(steps[0], steps[1] + 1)]
                if cuda
                else [],
                launch=LaunchRow(draw(st.integers(0, 99)), draw(times), draw(times), 0.5)
                if cuda and draw(st.booleans())
                else None,
                launch_bound=[steps[0]] if cuda and draw(st.booleans()) else [],
                ops=ops,
                kernels=[
                    KernelRow(name, draw(value), draw(st.integers(0, 50)), 0)
                    for name in draw(st.lists(names, unique=True, max_size=10))
                ],
                dropped_rows=draw(st.integers(0, 5)),
                dropped_us=draw(times),
                step_us=[(s, draw(times)) for s in range(steps[0], steps[1] + 1)],
                breakdown=Breakdown(*(draw(times) for _ in range(6))),
                streams=[StreamRow(0, 7, draw(times), draw(times))] if draw(st.booleans()) else [],
                peak_bytes=peak,
                memory=[MemoryRow("aten::empty", draw(st.integers(0, 2**30)), 2)]
                if peak is not None
                else [],
                memory_flow=(draw(st.integers(-1, 9)), draw(st.integers(0, 2**40)), 7)
                if peak is not None
                else None,
            )
        )
    return out


def table(agg: WindowAggregate) -> dict:
    return agg.to_dict(top_k=100, per_rank=True)


def without_std_and_detail(t: dict) -> dict:
    t = dict(t, per_rank=None)
    t["kernels"] = [{k: v for k, v in row.items() if k != "std_us"} for row in t["kernels"]]
    return t


def chunks(items, size):
    return [items[i : i + size] for i in range(0, len(items), size)]


@settings(max_examples=150, deadline=None)
@given(
    window_summaries(),
    st.integers(1, 8),
    st.integers(1, 4),
    st.randoms(use_true_random=False),
)
def test_a_table_from_node_and_group_partials_equals_the_one_from_rank_summaries(
    summaries, per_node, per_group, rnd
):
    by_rank = WindowAggregate(3)
    for s in summaries:
        assert by_rank.add(decode_summary(encode_summary(s)))
    shuffled = list(summaries)
    rnd.shuffle(shuffled)
    nodes = [fold_summaries(f"node-{i}", g) for i, g in enumerate(chunks(shuffled, per_node))]
    rnd.shuffle(nodes)
    # Relays merge their group's node partials (a group of one passes its node's on).
    groups = [merge_partials(f"relay-{i}", g) for i, g in enumerate(chunks(nodes, per_group))]
    by_group = WindowAggregate(3)
    for p in groups:
        assert by_group.add_partial(decode_partial(encode_partial(p))) is not None
    a, b = table(by_rank), table(by_group)
    # Sums, counts, extremes with their ranks, shares, stragglers, breakdowns: exactly.
    assert without_std_and_detail(a) == without_std_and_detail(b)
    # The op table and the CUDA figures (launches, device steps, unattributed time) too.
    ops_a, ops_b = (t.to_dict(top_k=100, by="op") for t in (by_rank, by_group))
    assert without_std_and_detail(ops_a) == without_std_and_detail(ops_b)
    for ra, rb in zip(a["kernels"], b["kernels"], strict=True):
        assert math.isclose(ra["std_us"], rb["std_us"], rel_tol=1e-9, abs_tol=1e-9)
    # Per-rank values: every one a partial carries is the rank's own; one it leaves out is a
    # kernel the rank's node never ran (fewer than 64 kernels here), so the rank's is 0.0.
    for name, mine in a["per_rank"].items():
        theirs = b["per_rank"][name]
        assert all(mine[r] == v for r, v in theirs.items())
        assert all(mine[r] == 0.0 for r in set(mine) - set(theirs))


def test_a_rank_already_in_refuses_the_whole_partial():
    s = [summary(r, [("k", 10.0 * (r + 1))]) for r in range(3)]
    agg = WindowAggregate(0)
    agg.add(s[1])
    assert agg.add_partial(fold_summaries("n", s)) is None
    assert agg.ranks == [1] and agg.duplicates == 1
    assert agg.add_partial(fold_summaries("n", [s[0], s[2]])) is not None
    assert agg.ranks == [0, 1, 2]
    assert agg.top(1)[0]["total_us"] == 60.0


def test_partial_ranks_have_values_for_the_node_top_kernels_only():
    many = [(f"k{i:03d}", float(1000 - i)) for i in range(MAX_PARTIAL_TOP + 5)]
    agg = WindowAggregate(0)
    agg.add_partial(fold_summaries("n", [summary(0, many), summary(1, many[:3])]))
    agg.add(summary(2, many[:1]))
    last = many[-1][0]
    got = agg.per_rank(["k000", "k004", last])
    assert got["k000"] == {0: 1000.0, 1: 1000.0, 2: 1000.0}
    assert got["k004"] == {0: 996.0, 1: 0.0, 2: 0.0}  # rank 2 sent all of its kernels
    assert got[last] == {2: 0.0}  # outside the node's top kernels: not known for ranks 0, 1


def test_merging_partials_that_share_a_rank_or_a_window_is_refused():
    a = fold_summaries("a", [summary(0, [("k", 1.0)])])
    with pytest.raises(ValueError, match="share a rank"):
        merge_partials("r", [a, fold_summaries("b", [summary(0, [("k", 2.0)])])])
    with pytest.raises(ValueError, match="one window"):
        merge_partials("r", [a, fold_summaries("b", [summary(1, [], window=1)])])
    with pytest.raises(ValueError, match="at least one"):
        merge_partials("r", [])


def test_fold_refuses_mixed_windows_and_nothing():
    with pytest.raises(ValueError, match="one window"):
        fold_summaries("n", [summary(0, [], window=1), summary(1, [], window=2)])
    with pytest.raises(ValueError, match="at least one"):
        fold_summaries("n", [])


def summary(rank, kernels, window=0):
    return RankSummary(
        rank=rank,
        window=window,
        steps=(0, 1),
        partial=False,
        device="cpu",
        kernels=[KernelRow(n, us, 1, 0) for n, us in kernels],
    )


def good_partial() -> dict:
    return msgpack.unpackb(encode_partial(fold_summaries("n", [summary(0, [("k", 1.0)])])))


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda o: o.update(v=9), "version 9 is not supported"),
        (lambda o: o.update(extra=1), "unknown field `extra`"),
        (lambda o: o.update(ranks=[]), r"length >= 1 - at `\$.ranks`"),
        (lambda o: o["ranks"].append(o["ranks"][0]), "rank 0 appears twice"),
        (lambda o: o["kernels"][0].__setitem__(1, -1), r"`\$.kernels\[0\]\[1\]`"),
        (lambda o: o["kernels"][0].__setitem__(5, float("nan")), r"`\$.kernels\[0\]\[5\]`"),
        (lambda o: o["kernels"][0].__setitem__(7, 5), "its ranks are not the partial's"),
        (lambda o: o["kernels"][0].__setitem__(4, 2), "its ranks are not the partial's"),
        (lambda o: o["ranks"][0].__setitem__(1, [5, 2]), "first is after last"),
        (lambda o: o["detail"][0].__setitem__(2, []), "values do not match its names x ranks"),
        (lambda o: o["detail"][0].__setitem__(1, [9]), "its ranks are not the partial's"),
        (
            lambda o: o["detail"][0].__setitem__(0, [""]),
            r"`\$.detail\[0\]\[0\]\[0\]`",
        ),
    ],
)
def test_partial_decoder_errors_say_what_is_wrong(mutate, pattern):
    obj = good_partial()
    mutate(obj)
    with pytest.raises(SummaryDecodeError, match=pattern):
        decode_partial(msgpack.packb(obj))


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=512))
def test_partial_decoder_raises_only_decode_errors_on_garbage(data):
    with contextlib.suppress(SummaryDecodeError):
        decode_partial(data)


def test_partial_oversized_or_not_bytes_is_refused():
    with pytest.raises(SummaryDecodeError, match="over the"):
        decode_partial(b"\x00" * (33 * 1024 * 1024))
    with pytest.raises(SummaryDecodeError, match="must be bytes"):
        decode_partial({"v": 1})
    with pytest.raises(SummaryDecodeError, match="not valid msgpack"):
        decode_partial(b"\xc1")


def test_a_real_sized_partial_decodes_fast_enough_to_matter():
    """Not a timing test: the decode of 8 ranks x 2,000 kernels works and keeps every row."""
    rnd = random.Random(0)
    s = [summary(r, [(f"k{i}", rnd.random() * 100) for i in range(2000)]) for r in range(8)]
    p = decode_partial(encode_partial(fold_summaries("n", s)))
    assert len(p.kernels) == 2000 and len(p.ranks) == 8
    assert len(p.detail[0].names) == MAX_PARTIAL_TOP and len(p.detail[0].values) == 8 * 64


def test_decoded_rows_are_not_tracked_by_the_garbage_collector():
    """A relay decodes thousands of rows per node partial: none of them is a container the
    collector walks (two thirds of a cold decode were collections before)."""
    import gc

    s = [summary(r, [(f"k{i}", 1.0 + i) for i in range(50)]) for r in range(4)]
    p = decode_partial(encode_partial(fold_summaries("n", s)))
    assert not any(gc.is_tracked(row) for row in p.kernels)
    assert not any(gc.is_tracked(part) for part in p.ranks)
    assert not any(gc.is_tracked(k) for k in decode_summary(encode_summary(s[0])).kernels)


def test_what_a_window_keeps_per_rank_leaves_the_garbage_collectors_lists():
    """At 10,000 ranks a window keeps a few objects per rank; as lists and objects, every full
    pass of the collector walked them (tens of ms on the coordinator's loop)."""
    import gc

    from coordinator.protocol.summary_codec import StreamRow

    s = [summary(r, [(f"k{i}", 1.0 + i) for i in range(20)]) for r in range(16)]
    for x in s:
        x.step_us, x.streams = [(0, 5.0), (1, 6.0)], [StreamRow(0, 7, 1.0, 2.0)]
    agg = WindowAggregate(0)
    for node in chunks(s, 8):
        agg.add_partial(decode_partial(encode_partial(fold_summaries("n", node))))
    agg.add(summary(99, [("k1", 3.0)]))
    gc.collect()  # (a tuple leaves at the first pass that finds its items untracked: a
    gc.collect()  # block's inner tuples at one, the block at the next)
    kept = [*agg._detail, *agg.streams.values(), *agg.breakdowns.values()]
    kept += agg.rank_dropped.values()
    assert len(kept) == 1 + 2 + 16 + 17 + 17
    assert [x for x in kept if gc.is_tracked(x)] == []
    assert agg.per_rank(["k1"]) == {"k1": {**{r: 2.0 for r in range(16)}, 99: 3.0}}
    part = decode_partial(encode_partial(fold_summaries("n", s[:8]))).ranks[0]
    assert part.step_us == ((0, 5.0), (1, 6.0)) and len(part.streams) == 1


def big_partial(ranks: int, kernels: int = 30):
    rnd = random.Random(ranks)
    s = [summary(r, [(f"k{i}", rnd.random() * 100) for i in range(kernels)]) for r in range(ranks)]
    nodes = [fold_summaries(f"n{i}", g) for i, g in enumerate(chunks(s, 8))]
    return merge_partials("relay", nodes)


def test_a_large_partial_folds_in_bounded_steps_to_the_same_table():
    from coordinator.core.aggregate import STEP_RANKS

    p = big_partial(2000)
    at_once = WindowAggregate(0)
    at_once.add_partial(p)
    stepwise = WindowAggregate(0)
    steps = stepwise.add_partial_steps(p)
    rows = kernel_totals(at_once)
    yields, some_listed = 0, False
    with contextlib.suppress(StopIteration):
        while True:
            next(steps)
            yields += 1
            listed = stepwise.ranks
            if listed:
                # Between two steps a view never lists a rank whose rows are not in: the
                # partial's rows all go in before its first rank.
                assert kernel_totals(stepwise) == rows
                assert all(r in stepwise.breakdowns for r in listed)
                some_listed = some_listed or len(listed) < 2000
    assert some_listed  # a view did fall between two steps of the ranks
    assert yields >= 2000 // STEP_RANKS
    assert table(stepwise) == table(at_once)


def kernel_totals(agg: WindowAggregate) -> dict[str, float]:
    return {k["name"]: k["total_us"] for k in agg.to_dict(top_k=100)["kernels"]}


def test_a_rank_being_folded_is_refused_and_a_torn_fold_is_never_counted_twice():
    import msgspec

    from coordinator.core.aggregate import restored_aggregate, saved_aggregate
    from coordinator.core.saved import AggregateFile

    p = big_partial(1200)
    agg = WindowAggregate(0)
    steps = agg.add_partial_steps(p)
    next(steps)  # the rows are in, no rank yet
    late = summary(5, [("k0", 1.0)])
    assert agg.add(late) is False  # rank 5 is being folded: its summary is a repeat
    # A checkpoint taken now, restored after a restart: the ranks not yet in are marked bad
    # and refused, so a summary sent again cannot count their rows a second time.
    blob = msgspec.msgpack.encode(saved_aggregate(agg))
    restored = restored_aggregate(msgspec.msgpack.decode(blob, type=AggregateFile))
    assert 5 in restored.bad_ranks and "restarted while folding" in restored.bad_ranks[5]
    assert restored.add(late) is False
    assert restored.add_partial(fold_summaries("n", [late])) is None
    with contextlib.suppress(StopIteration):  # the fold in progress completes as usual
        while True:
            next(steps)
    assert agg.ranks == list(range(1200)) and not agg.bad_ranks


def test_a_snapshot_taken_mid_fold_marks_nothing_bad():
    """A view's snapshot between two steps of a fold is not a restore: no rank is torn."""
    agg = WindowAggregate(0)
    steps = agg.add_partial_steps(big_partial(600))
    next(steps)
    snap = agg.snapshot()
    assert not snap.bad_ranks and not agg.bad_ranks
    with contextlib.suppress(StopIteration):
        while True:
            next(steps)
    assert agg.ranks == list(range(600)) and not agg.bad_ranks
