"""The node agent's collectives reader on hostile or odd traces (issue 56): a trace's arguments
never cost the rank its summary, its process groups never take the summary past its cap, and
sizes come from the op's own tensors where the trace records them."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from coordinator.protocol.collective_replies import CollectiveBlock, RankCollective
from coordinator.protocol.summary_codec import MAX_PAYLOAD_BYTES, decode_summary
from tests.conftest import ROOT
from worker_ext.agent import collective_reader as cr
from worker_ext.agent.trace_jobs import TraceJob, summarise_job

NCCL = os.path.join(ROOT, "tests", "data", "gpu-traces", "one-rank-nccl", "nccl_rank0_of_2.json.gz")
TWO = os.path.join(ROOT, "tests", "data", "gpu-traces", "two-ranks", "sampled_rank-0.json.gz")


def rewritten(tmp_path, src: str, change) -> str:
    """``src`` with ``change(doc)`` applied, written to ``tmp_path``."""
    with gzip.open(src, "rt") as f:
        doc = json.load(f)
    change(doc)
    out = str(tmp_path / "rank0.json.gz")
    with gzip.open(out, "wt") as f:
        json.dump(doc, f)
    return out


def block_of(path: str, **job: object) -> CollectiveBlock:
    res, blob, _ = summarise_job(
        TraceJob(0, 0, (0, 10**6), False, "cuda", 20, False, "none", path, None, **job)
    )
    assert blob is not None, res.errors  # the rank's summary is never lost for its collectives
    block = decode_summary(blob).collectives
    assert block is not None
    return block


@pytest.mark.parametrize("odd", ["--1", "\u00b2", "9" * 5000, "1e3", " 7 ", [], {"a": 1}, 2**70])
def test_odd_numbers_in_a_collective_s_arguments_are_read_as_none_never_raised(odd):
    assert cr._int(odd) == (7 if odd == " 7 " else None)


def test_garbage_arguments_cost_their_fields_not_the_rank_s_summary(tmp_path):
    def garble(doc):
        for n, e in enumerate(
            e for e in doc["traceEvents"] if e.get("name") == "record_param_comms"
        ):
            e["args"]["Seq"] = ["--1", "\u00b2", "9" * 5000][n % 3]
            e["args"]["In msg nelems"] = "x" * 100
            e["args"]["Process Group Ranks"] = "[0, 1, zz]"

    block = block_of(rewritten(tmp_path, NCCL, garble))
    assert len(block.calls) == 21 and all(c.seq is None for c in block.calls)


def test_a_process_group_of_a_million_ranks_keeps_the_summary_under_its_cap(tmp_path):
    def huge(doc):
        doc["distributedInfo"]["pg_config"].append(
            {"pg_name": "big", "ranks": list(range(1_000_000)), "pg_size": 1_000_000}
        )

    path = rewritten(tmp_path, NCCL, huge)
    _, blob, _ = summarise_job(
        TraceJob(0, 0, (0, 10**6), False, "cuda", 20, False, "none", path, None)
    )
    assert blob is not None and len(blob) < MAX_PAYLOAD_BYTES
    block = decode_summary(blob).collectives
    assert block is not None and dict(block.groups)["big"] == ()
    assert any("group big lists 1,000,000 ranks" in n for n in block.notes), block.notes


def test_a_summary_its_collectives_would_take_past_the_cap_goes_without_them():
    from worker_ext.agent.trace_jobs import _encoded
    from worker_ext.agent.trace_summary import summarise_trace

    summary, _ = summarise_trace(
        NCCL, rank=0, window=0, steps=(4, 6), partial=False, device="cuda", top_k=20
    )
    many = RankCollective("0" * 256, None, "all_reduce", 1, "x" * 32, 1, 1.0, 1.0, 2.0)
    ranks = (("g", tuple(range(65_536, 365_536))),)  # (1.5 MB; the calls 3.3 MB)
    summary.collectives = CollectiveBlock((many,) * 10_000, (), 0, ranks, ())
    back = decode_summary(_encoded(summary))
    assert back.collectives is not None and back.collectives.calls == ()
    assert back.collectives.cut == 10_000 and "would not fit" in back.collectives.notes[0]


def test_sizes_come_from_the_op_s_own_tensors_its_output_where_recorded():
    # ``c10d::_allgather_base_(output, input)`` of a 64-rank group: its output, 1 GiB; a trace
    # with no pg_config and world_size 128: the default group of 128 ranks
    from worker_ext.agent.trace_reader import read_trace

    d = read_trace(TWO)
    block = cr.collectives_of(d)
    assert block is not None and dict(block.groups) == {"0": tuple(range(128))}
    gathers = [c for c in block.calls if c.name == "all_gather"]
    assert gathers and {c.nbytes for c in gathers} == {1 << 30}


def test_a_reader_that_fails_costs_the_collectives_never_the_summary(monkeypatch):
    from worker_ext.agent import trace_summary

    def broken(d, cap, in_steps):  # (fault injection: a bug in the collectives reader)
        raise KeyError("injected")

    monkeypatch.setattr(trace_summary, "collectives_of", broken)
    summary, _ = trace_summary.summarise_trace(
        NCCL, rank=0, window=0, steps=(4, 6), partial=False, device="cuda", top_k=20
    )
    assert summary.kernels and summary.collectives is not None
    assert summary.collectives.calls == () and "injected" in summary.collectives.notes[0]


def test_a_clipped_window_keeps_only_the_collectives_of_its_steps(tmp_path):
    """libkineto's trace spans more than its window (``clip``): its collectives outside the
    recorded steps are left out, as its other events are, and said."""
    from worker_ext.agent.trace_summary import summarise_trace

    def no_step_4(doc):  # (step 4's marker gone: its 7 collectives fall outside every step)
        doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("name") != "ProfilerStep#4"]

    path = rewritten(tmp_path, NCCL, no_step_4)
    whole, _ = summarise_trace(
        path, rank=0, window=0, steps=(5, 6), partial=False, device="cuda", top_k=20
    )
    clipped, _ = summarise_trace(
        path, rank=0, window=0, steps=(5, 6), partial=False, device="cuda", top_k=20, clip=True
    )
    assert whole.collectives is not None and clipped.collectives is not None
    assert len(whole.collectives.calls) == 21 and len(clipped.collectives.calls) == 14
    assert {c.step for c in clipped.collectives.calls} == {5, 6}
    assert "7 collective(s) outside the window's steps were left out" in clipped.collectives.notes


def test_a_list_form_gather_whose_output_is_not_recorded_is_its_input_times_the_group():
    from worker_ext.agent.trace_reader import CommArgs

    listed = CommArgs(
        input_dims=[[], [[1000]], [], []], input_type=["", "TensorList", "", "Scalar"]
    )
    assert cr._op_size(listed, "all_gather", 4) == (4000, "")  # gloo's c10d::allgather_
    assert cr._op_size(listed, "broadcast", 4) == (1000, "")  # (not a gather: its own size)
    based = CommArgs(input_dims=[[4096], [1024], []], input_type=["float", "float", ""])
    assert cr._op_size(based, "all_gather", 4) == (4096, "float")  # the output is recorded
