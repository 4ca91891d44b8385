"""Each window's allocations across ranks: the peak's step, bytes allocated and freed, kept
through the node partials and the saved aggregate, shown by ``top`` and ``stragglers``."""

from __future__ import annotations

from coordinator.core.aggregate import WindowAggregate, restored_aggregate, saved_aggregate
from coordinator.core.partial import fold_summaries
from coordinator.ops.tables import render_stragglers, render_top
from coordinator.protocol.summary_codec import (
    Breakdown,
    KernelRow,
    MemoryRow,
    RankSummary,
    decode_summary,
    encode_summary,
)

MiB = 1 << 20


def summary(rank, peak, flow, step_ms):
    return RankSummary(
        rank=rank, window=2, steps=(10, 11), partial=False, device="cpu",
        kernels=[KernelRow("aten::mm", 1000.0 * step_ms, 4, 0)],
        step_us=[(10, 1000.0 * step_ms), (11, 1000.0 * step_ms)],
        breakdown=Breakdown(1000.0 * step_ms, 0, 0, 0, 2000.0 * step_ms, 0),
        peak_bytes=peak, memory=[MemoryRow("aten::empty", peak, 3)], memory_flow=flow,
    )  # fmt: skip


SUMMARIES = [
    summary(0, 100 * MiB, (10, 300 * MiB, 280 * MiB), 10.0),
    summary(1, 900 * MiB, (11, 2000 * MiB, 1100 * MiB), 30.0),  # slow and the most memory
    summary(2, 120 * MiB, (-1, 310 * MiB, 300 * MiB), 10.0),
]


def test_the_flow_crosses_the_codec_and_a_summary_without_memory_sends_none():
    s = decode_summary(encode_summary(SUMMARIES[1]))
    assert s.memory_flow == (11, 2000 * MiB, 1100 * MiB)
    bare = summary(3, None, (1, 2, 3), 1.0)
    bare.memory = []
    assert decode_summary(encode_summary(bare)).memory_flow is None


def test_the_table_names_the_rank_with_the_highest_peak_and_its_step_by_any_path():
    direct, folded = WindowAggregate(2), WindowAggregate(2)
    for s in SUMMARIES:
        direct.add(s)
    assert folded.add_partial(fold_summaries("node-a", SUMMARIES[:2]))
    assert folded.add_partial(fold_summaries("node-b", SUMMARIES[2:]))
    for agg in (direct, folded, restored_aggregate(saved_aggregate(direct))):
        mem = agg.to_dict(top_k=5)["memory"]
        assert mem["max_peak_rank"] == 1 and mem["max_peak_bytes"] == 900 * MiB
        assert mem["peak_step"] == {0: 10, 1: 11, 2: None}  # rank 2 peaked outside the steps
        assert mem["allocated_bytes"][1] == 2000 * MiB and mem["freed_bytes"][1] == 1100 * MiB


def test_top_and_stragglers_say_where_the_peak_was_and_who_holds_it():
    agg = WindowAggregate(2)
    for s in SUMMARIES:
        agg.add(s)
    ks = agg.to_dict(top_k=5)
    ks.update(window=2, steps=[10, 11], role="policy", trainer_id="t", run="r")
    top = render_top(ks)
    assert "memory: peak 900.0 MB on rank 1" in top
    assert "rank 1 peaked in step 11; the window allocated" in top
    strag = render_stragglers(ks)
    assert ks["stragglers"]["flagged"] == [1]
    assert "rank 1, a straggler, is also the rank with the highest memory peak" in strag


def test_no_memory_line_when_the_straggler_is_not_the_peak_rank():
    agg = WindowAggregate(2)
    for s in [SUMMARIES[0], summary(1, 10 * MiB, (10, 1, 1), 30.0), SUMMARIES[2]]:
        agg.add(s)
    ks = agg.to_dict(top_k=5)
    ks.update(window=2, steps=[10, 11])
    assert "highest memory peak" not in render_stragglers(ks)
