"""A CUDA rank's window from synthetic Kineto traces: what the real ones may not show (issue 29).

Each trace is written in Kineto's layout and read by the node agent's own reader and summary.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker_ext.agent.device_summary import union_ns
from worker_ext.agent.trace_reader import read_trace
from worker_ext.agent.trace_summary import summarise_trace

T0 = 1_700_000_000_000.0  # us


class Trace:
    """A Kineto-shaped trace: steps, ops and launches on CPU threads, device activity."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.corr = 0

    def x(self, cat: str, name: str, ts: float, dur: float, pid: int = 100, tid: int = 1, **args):
        e = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": T0 + ts, "dur": dur}
        self.events.append(e | ({"args": args} if args else {}))

    def step(self, n: int, ts: float, dur: float) -> None:
        self.x("user_annotation", f"ProfilerStep#{n}", ts, dur)

    def launch(
        self,
        at: float,
        kernel: str | None,
        start: float,
        dur: float,
        stream: int = 7,
        call: str = "cudaLaunchKernel",
        cat: str = "kernel",
        tid: int = 1,
        launch_dur: float = 5.0,
    ) -> None:
        """A launch call at ``at`` and (unless ``kernel`` is None) its device event."""
        self.corr += 1
        runtime = (
            "cuda_driver"
            if call.startswith("cu") and not call.startswith("cuda")
            else ("cuda_runtime")
        )
        self.x(runtime, call, at, launch_dur, tid=tid, correlation=self.corr)
        if kernel is not None:
            self.device(kernel, start, dur, stream, cat, correlation=self.corr)

    def device(
        self,
        name: str,
        start: float,
        dur: float,
        stream: int = 7,
        cat: str = "kernel",
        correlation: int | None = None,
    ) -> None:
        args = {"device": 0, "stream": stream} | (
            {"correlation": correlation} if correlation is not None else {}
        )
        self.x(cat, name, start, dur, pid=0, tid=stream, **args)

    def write(self, path) -> str:
        doc = {"schemaVersion": 1, "distributedInfo": {"rank": 3}, "traceEvents": self.events}
        path.write_text(json.dumps(doc, indent=1))
        return str(path)


def summary(tmp_path, t: Trace, steps=(1, 2), top_k=50):
    s, _ = summarise_trace(
        t.write(tmp_path / "t.json"),
        rank=3,
        window=0,
        steps=steps,
        partial=False,
        device="cuda",
        top_k=top_k,
    )
    return s


def test_a_kernel_belongs_to_the_step_that_launched_it_even_when_it_runs_in_the_next(tmp_path):
    t = Trace()
    t.step(1, 0, 100)
    t.step(2, 100, 100)
    t.launch(90, "late_gemm", 95, 50)  # launched in step 1, runs 95-145: into step 2's time
    t.launch(150, "gemm", 160, 20)
    s = summary(tmp_path, t)
    assert s.step_device == [(1, 50.0, 50.0), (2, 20.0, 20.0)]
    assert s.breakdown.window_us == 85.0  # 95 to 180 on the device, not the CPU's 0-200
    assert s.breakdown.other_us == 85.0 - 70.0
    assert {k.name: k.self_us for k in s.kernels} == {"late_gemm": 50.0, "gemm": 20.0}


def test_a_kernel_queued_past_the_next_step_s_start_still_belongs_to_its_launching_step(tmp_path):
    """The case that tells attribution by launch from attribution by the kernel's own start: a
    kernel launched in step 1 that the device starts only after step 2 has begun."""
    t = Trace()
    t.step(1, 0, 100)
    t.step(2, 100, 100)
    t.launch(90, "queued_gemm", 120, 30)  # launched in step 1; runs 120-150, inside step 2
    t.launch(150, "gemm", 160, 20)
    s = summary(tmp_path, t)
    assert s.step_device == [(1, 30.0, 30.0), (2, 20.0, 20.0)]


def test_a_kernel_with_no_launch_or_launched_outside_the_steps_is_counted_apart(tmp_path):
    t = Trace()
    t.launch(-50, "warmup_kernel", -40, 30)  # before the first step
    t.step(1, 0, 100)
    t.step(2, 100, 100)
    t.launch(10, None, 0, 0)  # a launch whose kernel is not in the trace: nothing to count
    t.launch(20, "gemm", 30, 40)
    t.device("orphan_kernel", 50, 25)  # no launch in the trace (no correlation)
    t.device("lost_kernel", 60, 10, correlation=999)  # a correlation nothing launched
    t.launch(250, "after", 260, 10)  # after the last step
    s = summary(tmp_path, t)
    assert [k.name for k in s.kernels] == ["gemm"]
    assert s.unattributed_us == 30.0 + 25.0 + 10.0 + 10.0
    assert s.breakdown.window_us == 40.0 and s.breakdown.compute_us == 40.0
    assert s.launch is not None and s.launch.kernels == 1


def test_three_streams_at_once_count_once(tmp_path):
    t = Trace()
    t.step(1, 0, 1000)
    t.launch(1, "a", 100, 300, stream=7)  # 100-400
    t.launch(2, "b", 200, 300, stream=13)  # 200-500
    t.launch(3, "c", 350, 100, stream=21)  # 350-450
    s = summary(tmp_path, t, steps=(1, 1))
    b = s.breakdown
    assert b.compute_us == 400.0  # the union, 100-500; the sum would be 700
    assert b.window_us == 400.0 and b.other_us == 0.0
    assert sum(k.self_us for k in s.kernels) == 700.0  # each kernel keeps its own time
    assert {r.stream: r.busy_us for r in s.streams} == {7: 300.0, 13: 300.0, 21: 100.0}


def test_driver_launches_link_their_kernels(tmp_path):
    t = Trace()
    t.step(1, 0, 500)
    t.launch(10, "triton_kernel", 20, 5, call="cuLaunchKernel")
    t.launch(30, "triton_kernel", 40, 5, call="cuLaunchKernelEx")
    s = summary(tmp_path, t, steps=(1, 1))
    assert [(k.name, k.count) for k in s.kernels] == [("triton_kernel", 2)]
    assert s.unattributed_us == 0.0
    assert s.launch is not None and s.launch.kernels == 2  # the driver's launches count too


def test_a_comm_kernel_inside_a_compute_kernel_overlaps_all_of_it(tmp_path):
    t = Trace()
    t.step(1, 0, 1000)
    t.launch(1, "big_gemm", 100, 500, stream=7)
    t.launch(2, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 200, 100, stream=13)
    t.launch(
        3,
        "Memcpy DtoH (Device -> Pinned)",
        700,
        50,
        stream=7,
        cat="gpu_memcpy",
        call="cudaMemcpyAsync",
    )
    s = summary(tmp_path, t, steps=(1, 1))
    b = s.breakdown
    assert (b.compute_us, b.comm_us, b.memcpy_us, b.overlap_us) == (500.0, 100.0, 50.0, 100.0)
    assert b.window_us == 650.0 and b.other_us == 650.0 - 550.0


def test_fractional_microseconds_keep_their_nanoseconds(tmp_path):
    t = Trace()
    t.step(1, 0.001, 100.25)  # Kineto's nanoseconds, as fractional microseconds
    t.launch(1.123, "k1", 10.004, 2.005)  # 10.004-12.009
    t.launch(2.5, "k2", 11.009, 3.333)  # 11.009-14.342, overlapping k1 by 1 us
    s = summary(tmp_path, t, steps=(1, 1))
    assert s.breakdown.compute_us == pytest.approx(4.338, abs=1e-9)  # 10.004 to 14.342
    assert {k.name: k.self_us for k in s.kernels} == pytest.approx({"k1": 2.005, "k2": 3.333})


def test_launches_on_another_thread_belong_to_the_step_their_time_falls_in(tmp_path):
    t = Trace()
    t.step(1, 0, 100)
    t.step(2, 100, 100)
    t.x("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 120, 30, tid=2)
    t.x("cpu_op", "aten::mm", 125, 20, tid=2)
    t.launch(130, "gemm_bwd", 140, 30, tid=2)  # the autograd thread, during step 2
    s = summary(tmp_path, t)
    assert s.step_device == [(2, 30.0, 30.0)]
    ops = {o.name: o for o in s.ops}
    assert ops["aten::mm"].device_us == 30.0  # the innermost op around the launch
    assert ops["aten::mm"].kernels == [("gemm_bwd", 30.0)]
    assert ops["autograd::engine::evaluate_function: MmBackward0"].device_us == 0.0


def test_a_step_of_tiny_kernels_with_the_device_mostly_idle_is_launch_bound(tmp_path):
    t = Trace()
    t.step(1, 0, 1000)
    t.step(2, 1000, 1000)
    for i in range(20):  # step 1: 2 us kernels, each launched by a 10 us call, 40 us apart
        t.launch(40 * i, "tiny", 40 * i + 12, 2, launch_dur=10)
    t.launch(1010, "big", 1020, 900, launch_dur=10)  # step 2: one long kernel
    s = summary(tmp_path, t)
    assert s.launch_bound == [1]
    assert s.launch is not None and s.launch.short_share == pytest.approx(20 / 21)
    assert s.launch.delay_p50_us == pytest.approx(2.0)  # starts 2 us after its call ends


def test_the_trace_names_its_rank(tmp_path):
    t = Trace()
    t.step(1, 0, 10)
    assert read_trace(t.write(tmp_path / "r.json")).rank == 3


def _plain_union(spans: list[tuple[int, int]], lo: int, hi: int) -> int:
    """The union's length read plainly: every covered nanosecond counted once."""
    covered: set[int] = set()
    for s, e in spans:
        covered.update(range(max(s, lo), min(e, hi)))
    return len(covered)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 60), st.integers(0, 30)), max_size=12),
    st.integers(0, 40),
    st.integers(0, 80),
)
def test_one_union_of_spans_serves_the_device_and_the_cpu_collectives(spans, lo, width):
    """``union_ns`` (the device's kinds and streams; the CPU's wall time in collectives,
    clipped to the window) against a plain count of covered nanoseconds."""
    hi = lo + width
    start = np.array([s for s, _ in spans], dtype=np.int64)
    end = np.array([s + d for s, d in spans], dtype=np.int64)
    pairs = list(zip(start.tolist(), end.tolist(), strict=True))
    assert union_ns(start, end, lo, hi) == _plain_union(pairs, lo, hi)
    assert union_ns(start, end) == _plain_union(pairs, 0, 10**6)
