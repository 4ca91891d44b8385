"""A window's collectives matched across ranks (``coordinator/core/collectives.py``, pure): who
arrived last and who waited, transfer apart from waiting, nccl-tests' bus bandwidth, clocks set
against one rank's, and what cannot be matched said, never dropped in silence."""

from __future__ import annotations

import json
import random

import pytest
from msgspec.structs import replace

from coordinator.core.collectives import (
    busbw_factor,
    kind_of,
    match_window,
)
from coordinator.protocol.collective_replies import RankCollective

MS = 1_000.0  # microseconds


def gloo_window(
    ranks=(0, 1, 2, 3),
    n=12,
    late=None,
    clock=None,
    transfer=200.0,
    group="0",
    jitter=0.0,
    kinds=("all_reduce",),
    seq=False,
    seed=0,
):
    """``n`` blocking collectives of one group, two a step, as each rank's trace has them (a
    gloo op: its work is from its arrival to its end): every rank arrives at ``t``, rank ``r``
    ``late[r]`` later; all leave together at the last arrival plus ``transfer``; rank ``r``'s
    clock reads ``clock[r]`` more than the reference's; ``jitter`` us of noise on each time;
    ``seq``: the trace gives each its ``Seq``."""
    rng, late, clock = random.Random(seed), late or {}, clock or {}
    out = {r: [] for r in ranks}
    for k in range(n):
        t = 1e12 + k * 50 * MS
        arrive = {r: t + late.get(r, 0.0) + rng.uniform(0, jitter) for r in ranks}
        end = max(arrive.values()) + transfer
        for r in ranks:
            e = end + rng.uniform(0, jitter) + clock.get(r, 0.0)
            a = arrive[r] + clock.get(r, 0.0)
            kind = kinds[k % len(kinds)]
            out[r].append(
                RankCollective(group, k if seq else None, kind, 4 << 20, "float32", k // 2, a,
                               e - a, e)
            )  # fmt: skip
    return out


def by_rank(reply):
    return {p["rank"]: p for p in reply["ranks"]}


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("c10d::allreduce_", "all_reduce"),
        ("gloo:all_reduce", "all_reduce"),
        ("allreduce", "all_reduce"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "all_reduce"),
        ("_allgather_base", "all_gather"),
        ("c10d::_reduce_scatter_base_", "reduce_scatter"),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "reduce_scatter"),
        ("c10d::alltoall_", "all_to_all"),
        ("c10d::broadcast_", "broadcast"),
        ("c10d::barrier", "barrier"),
        ("nccl:send", "send"),
        ("nccl:all_reduce", "all_reduce"),
        ("nccl:send 0->1", "send"),
        ("ncclDevKernel_SendRecv", "send"),
        ("aten::mm", None),
        ("Optimizer.step#SGD.step", None),
        ("aten::gather", None),
        ("aten::scatter_add_", None),
        ("aten::scatter_reduce", None),
        ("aten::index_reduce", None),
        ("aten::broadcast_tensors", None),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", None),
        ("cub::DeviceReduceKernel", None),
    ],
)
def test_kinds_are_read_from_torch_s_op_kernel_and_nccl_names(name, kind):
    assert kind_of(name) == kind


def test_bus_bandwidth_uses_nccl_tests_factors():
    assert busbw_factor("all_reduce", 4) == pytest.approx(1.5)
    assert busbw_factor("all_gather", 4) == pytest.approx(0.75)
    assert busbw_factor("reduce_scatter", 8) == pytest.approx(7 / 8)
    assert busbw_factor("broadcast", 8) == 1.0 and busbw_factor("send", 2) == 1.0
    reply = match_window(gloo_window(transfer=1_000.0))  # 4 MiB in 1 ms
    c = reply["collectives"][0]
    assert c["transfer_us"] == pytest.approx(1_000.0)
    assert c["algbw_gbps"] == pytest.approx((4 << 20) / 1e9 / 1e-3)
    assert c["busbw_gbps"] == pytest.approx(c["algbw_gbps"] * 1.5)


def test_the_rank_slowed_before_its_collectives_arrives_last_and_the_others_wait_its_delay():
    reply = match_window(gloo_window(late={2: 30 * MS}, jitter=50.0))
    assert reply["matched"] == 12 and reply["problems"] == []
    for c in reply["collectives"]:
        assert c["last_rank"] == 2 and c["ranks"] == [0, 1, 2, 3]
        assert c["skew_us"] == pytest.approx(30 * MS, rel=0.01)
        assert c["wait_us"]["0"] == pytest.approx(30 * MS, rel=0.01) and c["wait_us"]["2"] == 0
        assert c["transfer_us"] == pytest.approx(200.0, abs=60)  # the waiting is not transfer
    parts = by_rank(reply)
    assert parts[2]["arrived_last"] == 12 and parts[0]["arrived_last"] == 0
    assert parts[1]["wait_us"] == pytest.approx(12 * 30 * MS, rel=0.01)
    assert parts[1]["wait_us_per_step"]["0"] == pytest.approx(2 * 30 * MS, rel=0.01)
    json.dumps(reply)  # (JSON as it is)


def test_below_the_skew_floor_no_rank_is_counted_last():
    parts = by_rank(match_window(gloo_window(jitter=5.0)))
    assert all(p["arrived_last"] == 0 for p in parts.values())


def test_a_rank_whose_clock_is_seconds_off_is_set_by_its_offset_and_the_answers_do_not_change():
    plain = match_window(gloo_window(late={1: 8 * MS}, jitter=40.0))
    shifted = match_window(gloo_window(late={1: 8 * MS}, jitter=40.0, clock={3: 4.2e6}))
    assert shifted["problems"] == []
    assert by_rank(shifted)[3]["clock_offset_us"] == pytest.approx(4.2e6, abs=3 * MS)
    for a, b in zip(plain["collectives"], shifted["collectives"], strict=True):
        assert a["last_rank"] == b["last_rank"] == 1
        for r in "0123":
            assert b["wait_us"][r] == pytest.approx(a["wait_us"][r], abs=100)


def test_within_one_node_a_small_offset_is_jitter_and_across_nodes_it_is_corrected():
    window = gloo_window(clock={1: 400.0}, jitter=30.0)
    same = by_rank(match_window(window, nodes={0: "a", 1: "a", 2: "a", 3: "a"}))[1]
    assert same["clock_offset_us"] == pytest.approx(400.0, abs=40)  # reported, not applied
    assert not same["clock_corrected"] and same["clock_reference"] == 0
    other = match_window(window, nodes={0: "a", 1: "b", 2: "a", 3: "a"})
    assert by_rank(other)[1]["clock_corrected"]
    assert all(c["skew_us"] < 60 for c in other["collectives"])  # (not 400: its clock, set)


def test_subset_groups_are_matched_within_their_group_and_clocks_chain_through_them():
    window = {r: [] for r in range(4)}
    named = {"tp0": (0, 1), "tp1": (2, 3), "dp0": (0, 2), "dp1": (1, 3)}
    for group, late in (("tp0", {1: 5 * MS}), ("tp1", {2: 7 * MS}), ("dp0", {}), ("dp1", {})):
        ranks = named[group]
        part = gloo_window(ranks, n=4, late=late, group=group, clock={3: 2e6} if 3 in ranks else {})
        for r, cs in part.items():
            window[r] += cs
    reply = match_window(window, groups=named)
    assert reply["problems"] == [] and reply["matched"] == 16
    last = {(c["group"], c["last_rank"]) for c in reply["collectives"]}
    assert ("tp0", 1) in last and ("tp1", 2) in last
    assert all(len(c["ranks"]) == 2 for c in reply["collectives"])
    assert by_rank(reply)[3]["clock_offset_us"] == pytest.approx(2e6, abs=MS)
    assert by_rank(reply)[3]["clock_reference"] == 0


def test_groups_no_collective_links_keep_their_own_clock_reference_and_say_so():
    window = {**gloo_window((0, 1), n=4, group="a"), **gloo_window((2, 3), n=4, group="b")}
    reply = match_window(window)
    assert [p["clock_reference"] for p in reply["ranks"]] == [0, 0, 2, 2]
    assert reply["problems"] == [
        "ranks 2: no blocking collective links their clocks to rank 0's; each is set against "
        "its own reference (clock_reference)"
    ]


@pytest.mark.parametrize("seq", [False, True])
def test_a_window_cut_short_is_matched_as_far_as_the_ranks_agree_and_the_rest_said(seq):
    window = gloo_window(late={3: 3 * MS}, seq=seq)
    window[1] = window[1][:8]  # rank 1's window ended two steps early
    window[2] = window[2][2:]  # rank 2's began a step late
    reply = match_window(window)
    assert reply["matched"] == 12
    assert all(c["last_rank"] == 3 for c in reply["collectives"])
    assert [c["missing"] for c in reply["collectives"]][:2] == [[2], [2]]
    assert reply["collectives"][-1]["ranks"] == [0, 2, 3]
    assert all(not p["clock_corrected"] for p in reply["ranks"])  # (no false offset)
    assert reply["problems"] == [
        "group 0: rank 1 lacks 4 of its 12 collectives; the others matched without it",
        "group 0: rank 2 lacks 2 of its 12 collectives; the others matched without it",
    ]


def test_a_rank_missing_one_collective_inside_a_step_leaves_only_that_step_unmatched():
    """Matched by order within a step, a rank that lacks one never shifts the rest: the step is
    said, the other steps match, and no clock offset is made of the shift."""
    window = gloo_window(late={0: 4 * MS})
    window[3] = window[3][1:]  # its first collective, in step 0, missing
    reply = match_window(window)
    assert reply["matched"] == 10 and all(c["step"] != 0 for c in reply["collectives"])
    assert all(c["last_rank"] == 0 for c in reply["collectives"])
    assert not by_rank(reply)[3]["clock_corrected"]
    assert by_rank(reply)[3]["clock_offset_us"] == pytest.approx(0.0, abs=1)
    assert reply["problems"] == [
        "group 0: in step 0 the ranks ran different numbers of its collectives (rank 0: 2, "
        "rank 1: 2, rank 2: 2, rank 3: 1); that step is not matched"
    ]


def test_bad_input_is_said_line_by_line_and_the_rest_still_answers():
    window = gloo_window(ranks=(0, 1, 2), late={0: 2 * MS})
    bad = window[2][0]
    window[2][0] = replace(bad, work_us=10.0, end_us=bad.arrive_us - 5)
    window[4] = []  # a rank whose trace has no collective
    window[6] = gloo_window(ranks=(6,), group="lonely")[6]  # one rank of a group
    kinds = gloo_window(ranks=(0, 1), group="odd", kinds=("all_reduce", "broadcast"), seq=True)
    one, two = kinds[1][:2]  # rank 1 ran them in the other order: its Seq differ
    window[0] += kinds[0]
    window[1] += [replace(two, seq=0), replace(one, seq=1)] + kinds[1][2:]
    window[1].append(replace(kinds[1][0], name="send", seq=None))
    reply = match_window(window, groups={"0": (0, 1, 2, 5)})
    said = "\n".join(reply["problems"])
    assert "rank 2: 1 collective(s) with times that cannot be a collective's" in said
    assert "group 0: ranks 5 of the group were not recorded in this window" in said
    assert "ranks 4: no collective in their traces" in said
    assert "group lonely: only rank 6 recorded it; nothing to match" in said
    assert "group odd: the ranks disagree on the kind of 2 collective(s) (Seq 0, Seq 1)" in said
    assert "rank 1: 1 point-to-point op(s) (send, recv) not matched" in said
    assert "group 0: in step 0 the ranks ran different numbers" in said
    group0 = [c for c in reply["collectives"] if c["group"] == "0"]
    assert len(group0) == 10 and group0[0]["ranks"] == [0, 1, 2] and group0[0]["last_rank"] == 0
    assert len([c for c in reply["collectives"] if c["group"] == "odd"]) == 10
    assert group0[0]["busbw_gbps"] == pytest.approx(group0[0]["algbw_gbps"] * 2 * 3 / 4)


def test_a_window_with_no_collectives_answers_empty():
    reply = match_window({0: [], 1: []})
    assert reply["collectives"] == [] and reply["matched"] == 0 and reply["problems"] == []
    assert [p["wait_us"] for p in reply["ranks"]] == [0.0, 0.0]


def test_the_list_is_bounded_to_the_largest_skews_and_every_one_is_counted():
    window = gloo_window(n=40, late={1: 1 * MS})
    for k in (7, 21):  # two collectives where rank 1 is 20 ms late
        c = window[1][k]
        window[1][k] = replace(c, arrive_us=c.arrive_us + 19 * MS, end_us=c.end_us + 19 * MS)
    reply = match_window(window, shown=2)
    assert reply["matched"] == 40 and reply["shown"] == 2
    assert [(c["step"], c["seq"]) for c in reply["collectives"]] == [(3, 1), (10, 1)]
    assert by_rank(reply)[1]["arrived_last"] == 40


def test_a_note_every_rank_made_is_one_line_and_the_lines_are_bounded():
    from coordinator.core.collectives import MAX_PROBLEMS, window_collectives
    from coordinator.protocol.collective_replies import CollectiveBlock

    per = gloo_window(ranks=tuple(range(300)), n=4)
    blocks = {
        r: CollectiveBlock(tuple(cs), (), 0, (), ("2 all_reduce collective(s) with no size",))
        for r, cs in per.items()
    }
    reply = window_collectives(blocks)
    said = [p for p in reply["problems"] if "with no size" in p]
    assert said == ["ranks 0-299: 2 all_reduce collective(s) with no size"], said
    odd = {r: CollectiveBlock(tuple(per[r]), (), 0, (), (f"note {r}",)) for r in per}
    lines = window_collectives(odd)["problems"]
    assert len(lines) == MAX_PROBLEMS and lines[-1] == "... and 237 more problem lines", lines[-1]


def test_a_list_of_ranks_in_a_line_is_bounded():
    from coordinator.core.collectives import _ranges

    assert _ranges([0, 1, 2, 5]) == "0-2, 5"
    text = _ranges(list(range(0, 200_000, 2)))
    assert len(text) < 200 and text.endswith(", ... (100000 in all)"), text


def test_a_rank_of_another_node_is_set_only_when_its_offset_is_over_the_estimate_s_spread():
    nodes = {0: "a", 1: "b"}
    noisy = match_window(gloo_window(ranks=(0, 1), clock={1: 300.0}, jitter=2_000.0), None, nodes)
    part = by_rank(noisy)[1]
    assert part["clock_spread_us"] > abs(part["clock_offset_us"]) and not part["clock_corrected"]
    clear = match_window(gloo_window(ranks=(0, 1), clock={1: 300.0}, jitter=10.0), None, nodes)
    part = by_rank(clear)[1]
    assert part["clock_corrected"] and part["clock_offset_us"] == pytest.approx(300.0, abs=20.0)
