"""The GPU figures of a window against Holistic Trace Analysis, on real GPU traces (issue 29).

The traces are HTA's own test data (``tests/data/gpu-traces``, MIT License beside them): two
ranks of a 128-rank job with NCCL send/recv, and one rank of an all-reduce job with nanosecond
timestamps. HTA reads an oracle copy of each (``tests/hta_oracle.py``: every step included, the
launches outside the steps taken out) and every figure must equal ours within 0.5%.
"""

from __future__ import annotations

import os

import pytest

from tests.configs import ROOT
from tests.hta_oracle import figures, op_device_us, oracle_copy
from worker_ext.agent.trace_reader import read_trace
from worker_ext.agent.trace_summary import summarise_trace

pytestmark = pytest.mark.subprocess  # HTA parses ranks in a pool of processes
TRACES = os.path.join(ROOT, "tests", "data", "gpu-traces")
JOBS = ["two-ranks", "one-rank-nccl"]
REL = 0.005


def ours(path: str):
    d = read_trace(path)
    steps = sorted(s for s, _, _ in d.steps)
    s, _ = summarise_trace(
        path,
        rank=d.rank,
        window=0,
        steps=(steps[0], steps[-1]),
        partial=False,
        device="cuda",
        top_k=100_000,
    )
    return s


@pytest.fixture(scope="module", params=JOBS)
def job(request, tmp_path_factory):
    """Each job's traces: ours by rank, HTA's figures by rank, HTA's copies' directory."""
    src = os.path.join(TRACES, request.param)
    out = str(tmp_path_factory.mktemp(request.param))
    paths = sorted(os.path.join(src, f) for f in os.listdir(src))
    for p in paths:
        oracle_copy(p, out)
    summaries = {s.rank: s for s in map(ours, paths)}
    return summaries, figures(out), out


def test_the_breakdown_over_the_device_span_equals_hta_s(job):
    summaries, hta, _ = job
    assert sorted(summaries) == sorted(hta)
    for rank, s in summaries.items():
        b, h = s.breakdown, hta[rank]
        assert b.window_us == pytest.approx(h["window_us"], rel=REL)  # HTA's kernel_time
        assert b.other_us == pytest.approx(h["idle_us"], rel=REL)  # idle_time
        assert b.compute_us == pytest.approx(h["compute_us"], rel=REL)  # compute_time
        assert b.comm_us == pytest.approx(h["comm_us"], rel=REL)
        assert b.memcpy_us == pytest.approx(h["memcpy_us"], rel=REL)
        assert b.overlap_us == pytest.approx(h["overlap_us"], rel=REL)
        assert 100 * b.overlap_us / b.comm_us == pytest.approx(h["overlap_pctg"], abs=0.01)
        assert s.unattributed_us == 0.0  # every launch of these traces is in a step


def test_every_kernel_s_device_time_equals_hta_s(job):
    summaries, hta, _ = job
    for rank, s in summaries.items():
        mine = {k.name: k.self_us for k in s.kernels}
        theirs = hta[rank]["kernels"]
        assert sorted(mine) == sorted(theirs)
        for name, us in theirs.items():
            assert mine[name] == pytest.approx(us, rel=REL), name


def test_launch_statistics_equal_hta_s(job):
    summaries, hta, _ = job
    for rank, s in summaries.items():
        la, h = s.launch, hta[rank]["launch"]
        assert la is not None and la.kernels == h["kernels"]
        assert la.delay_p50_us == pytest.approx(h["delay_p50_us"], rel=REL, abs=1e-3)
        assert la.delay_p95_us == pytest.approx(h["delay_p95_us"], rel=REL, abs=1e-3)
        assert la.short_share == pytest.approx(h["short_share"], rel=REL)


def test_each_op_s_device_time_equals_hta_s_call_stacks(job):
    summaries, _, out = job
    for rank, s in summaries.items():
        theirs = op_device_us(out, rank)
        mine = {o.name: o.device_us for o in s.ops if o.device_us > 0}
        assert sorted(mine) == sorted(theirs)
        for name, us in theirs.items():
            assert mine[name] == pytest.approx(us, rel=REL), name
