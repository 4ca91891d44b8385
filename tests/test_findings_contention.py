"""The findings' ``host_contention`` rule (issue 57): on hand-built window figures (it fires with
the right ranks and cost, stays quiet under ``min_share``, and its time is not counted again by
``collective_wait``, ``straggler`` or ``gpu_idle``); the figure's way from the rank's schedstat
reading through the summary, node partials and the window's aggregate; and a real rank pinned to
one CPU beside a CPU-burning process, whose window names it at the wait it really had.

Run as a script (``python tests/test_findings_contention.py OUT CPU BURN``) it is that rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.test_findings_core import STEP_MS, _arriver, _rank, _row, rules, table
from tests.test_findings_host import _summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACTIVE = 6  # recorded steps
RULES = ("host_contention", "gpu_idle")
WORK_S = 0.02  # a step's CPU work


def _waits(t: dict[str, Any], ms: dict[int, float]) -> dict[str, Any]:
    for r, row in t["breakdown"]["ranks"].items():
        row["cpu_wait_us_per_step"] = ms.get(r, 0.5) * 1e3
    return t


def test_host_contention_names_the_rank_waiting_for_a_cpu_at_its_wait() -> None:
    t = _waits(table(), {1: 30.0})
    f = rules(t)["host_contention"]
    assert (f["ranks"], f["cost_ms_per_step"]) == ([1], 30.0)
    assert f["evidence"]["cpu_wait_ms"] == {1: 30.0}
    assert f["evidence"]["share_of_step"] == {1: 0.3}
    for api in ("num_workers", "OMP_NUM_THREADS", "torch.set_num_threads", "sched_setaffinity"):
        assert api in f["advice"]
    every = rules(_waits(table(), {r: 10.0 + r for r in range(4)}))["host_contention"]
    assert every["all_ranks"] and every["cost_ms_per_step"] == pytest.approx(11.5)


def test_host_contention_is_quiet_under_two_percent_of_the_step() -> None:
    t = _waits(table(), {1: 1.9})
    assert rules(t) == {}
    assert rules(t, settings={"host_contention": {"min_share": 0.01}})["host_contention"]
    del t["breakdown"]["ranks"][1]["cpu_wait_us_per_step"]  # not measured: quiet too
    assert rules(t) == {}


def test_host_contention_costs_at_most_the_step() -> None:
    """A wait longer than the step (a bad figure) costs the step, no more."""
    f = rules(_waits(table(), {1: 1e9}))["host_contention"]
    assert f["cost_ms_per_step"] == pytest.approx(STEP_MS), f


def test_the_cpu_wait_inside_the_dataloader_is_counted_once() -> None:
    """The wait cannot be placed in the step: each host rule takes off its time's share of it
    (the wait spread evenly over the step), so the two findings never add up past the time."""
    t = _waits(table(), {1: 30.0})
    t["breakdown"]["ranks"][1]["dataloader_us_per_step"] = 30e3  # 30% of the step
    found = rules(t)
    assert found["host_contention"]["cost_ms_per_step"] == 30.0
    f = found["dataloader"]
    assert f["cost_ms_per_step"] == pytest.approx(30.0 - 30.0 * 0.3), f
    assert f["evidence"]["host_ms"] == {1: 30.0}


def test_a_rank_late_for_a_cpu_is_not_also_a_collective_wait() -> None:
    t = _waits(table(), {1: 31.0})
    t["stragglers"]["last_arriver"] = _arriver(rank=1, wait_ms=30.0)
    for r in (0, 2, 3):
        t["breakdown"]["ranks"][r] = {**_row(comm_ms=34.0), "cpu_wait_us_per_step": 1e3}
    found = rules(t)
    assert set(found) == {"host_contention"}, found  # the others wait for its CPU wait: once
    assert found["host_contention"]["ranks"] == [1]
    t["stragglers"]["last_arriver"] = _arriver(rank=1, wait_ms=45.0)  # 15 ms more than that
    f = rules(t)["collective_wait"]
    assert f["cost_ms_per_step"] == pytest.approx(45.0 - 30.0)
    assert f["evidence"]["host_subtracted_ms"] == pytest.approx(30.0)


def test_waiting_alike_on_every_rank_takes_nothing_off_the_wait() -> None:
    t = _waits(table(), {r: 5.0 for r in range(4)})
    t["stragglers"]["last_arriver"] = _arriver(rank=1, wait_ms=30.0)
    found = rules(t)
    assert found["collective_wait"]["cost_ms_per_step"] == 30.0
    assert found["host_contention"]["all_ranks"]


def test_a_rank_slow_for_a_cpu_is_not_also_a_straggler() -> None:
    t = _waits(table(), {2: 40.5})
    t["stragglers"]["ranks"][2] = _rank(step_ms=STEP_MS + 40.0)  # no collectives: its own step
    found = rules(t)
    assert set(found) == {"host_contention"} and found["host_contention"]["ranks"] == [2]
    _waits(t, {2: 1.0})  # its CPU wait like the others': the straggler's excess is its own
    assert set(rules(t)) == {"straggler"}


def test_on_a_cuda_rank_the_wait_costs_at_most_the_idle_and_is_not_gpu_idle_again() -> None:
    t = _waits(table(device="cuda"), {1: 30.0})
    costs = {}
    for idle_ms in (10.0, 40.0, 50.0):  # the device's idle a step on rank 1
        t["breakdown"]["ranks"][1]["other_us"] = idle_ms * 4e3
        found = rules(t)
        assert found["host_contention"]["evidence"]["cpu_wait_ms"] == {1: 30.0}
        costs[idle_ms] = [found.get(r, {}).get("cost_ms_per_step") for r in RULES]
    assert costs[10.0] == [10.0, None]  # at most the idle; none left for gpu_idle
    assert costs[40.0] == [30.0, None]  # 10 ms idle left: under gpu_idle's 15%
    assert costs[50.0] == [30.0, pytest.approx(20.0)]  # 20 ms left: over it, counted once


def test_the_cpu_wait_goes_from_summaries_through_partials_into_the_findings() -> None:
    from coordinator.core.aggregate import WindowAggregate, restored_aggregate, saved_aggregate
    from coordinator.core.findings import window_findings
    from coordinator.core.partial import fold_summaries
    from coordinator.protocol.partial_codec import decode_partial, encode_partial
    from coordinator.protocol.summary_codec import HostRow, decode_summary, encode_summary

    sent = [
        _summary(0, HostRow(0.0, 0, 0.0, 0, cpu_wait_us=100.0)),
        _summary(1, HostRow(0.0, 0, 0.0, 0, cpu_wait_us=25e3)),
        _summary(2, HostRow(0.0, 0, 0.0, 0)),  # not measured
    ]
    got = [decode_summary(encode_summary(s)) for s in sent]
    assert [s.host for s in got] == [s.host for s in sent]
    agg = WindowAggregate(2)
    agg.add_partial(decode_partial(encode_partial(fold_summaries("n", got[:2]))))
    agg.add(got[2])
    rows = restored_aggregate(saved_aggregate(agg)).to_dict(10)["breakdown"]
    assert rows["ranks"][1]["cpu_wait_us_per_step"] == 25e3
    assert "cpu_wait_us_per_step" not in rows["ranks"][2]
    assert rows["mean"]["cpu_wait_us_per_step"] == pytest.approx((100 + 25e3) / 3)
    found, _ = window_findings(restored_aggregate(saved_aggregate(agg)).to_dict(10))
    assert [(f["rule"], f["ranks"], f["cost_ms_per_step"]) for f in found] == [
        ("host_contention", [1], 25.0)
    ]


def test_a_host_row_from_before_the_cpu_wait_still_decodes() -> None:
    from coordinator.protocol.summary_codec import HostRow, decode_summary, encode_summary

    wire = msgspec.msgpack.decode(encode_summary(_summary(0, HostRow(1.0, 1, 2.0, 3, 4.0))))
    assert wire["host"][-1] is None  # (not measured: sent as nil, trailing)
    wire["host"] = wire["host"][:-1]
    assert decode_summary(msgspec.msgpack.encode(wire)).host == HostRow(1.0, 1, 2.0, 3, 4.0)
    wire["host"] += [-1.0]
    with pytest.raises(ValueError, match=r"\$\.host\[7\]"):
        decode_summary(msgspec.msgpack.encode(wire))


def test_the_schedstat_reader_reads_this_thread_and_none_without_the_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from worker_ext.rank import cpu_wait

    before = cpu_wait.run_delay_ns()
    assert before is not None and before[0] == threading.get_native_id() and before[1] >= 0
    assert isinstance(cpu_wait.waited_ns(before), int) and cpu_wait.waited_ns(None) is None
    other: list[Any] = []  # (a reading of another thread: no difference between two clocks)
    t = threading.Thread(target=lambda: other.append(cpu_wait.run_delay_ns()))
    t.start()
    t.join()
    assert other[0] is not None and cpu_wait.waited_ns(other[0]) is None
    assert cpu_wait.per_step(9_000, (4, 6)) == 3_000 and cpu_wait.per_step(9_000, None) is None
    assert cpu_wait.per_step(None, (4, 6)) is None and cpu_wait.per_step(9, (6, 4)) is None
    monkeypatch.setattr(cpu_wait, "SCHEDSTAT", "/proc/thread-self/no-such-file")
    assert cpu_wait.run_delay_ns() is not None  # the /proc/self/task/<tid> fallback
    monkeypatch.setattr(threading, "get_native_id", lambda: 2**31 - 1)
    assert cpu_wait.run_delay_ns() is None and cpu_wait.waited_ns(before) is None


def test_a_kineto_window_s_cpu_wait_is_read_from_beside_its_file_once(tmp_path: Path) -> None:
    from worker_ext.agent.kineto_traces import KinetoRequest
    from worker_ext.agent.trace_jobs import TraceJob, cpu_wait_path, kineto_cpu_wait

    log_file = str(tmp_path / ".kineto.policy.rank0.1.0.json")
    req = KinetoRequest(pid=1, config="", log_file=log_file, directory="", metadata="")
    job = TraceJob(0, 0, (1, 2), False, "cpu", 5, False, "none", "raw", None, kineto=req)
    with open(cpu_wait_path(log_file), "w") as f:
        f.write("1234")
    assert kineto_cpu_wait(job) == 1234
    assert not os.path.exists(cpu_wait_path(log_file)) and kineto_cpu_wait(job) is None


@pytest.mark.parametrize("plant", ["fifo", "link", "text", "long", "empty"])
def test_a_planted_cpu_wait_file_is_refused_never_followed_nor_waited_on(
    tmp_path: Path, plant: str
) -> None:
    """Another user's (or a broken) file at the side file's name: a pipe (the read would
    hang), a link (to a file that holds a count: never followed), not a count, a count past an
    int64: each read as not measured, and removed."""
    from worker_ext.agent.kineto_traces import KinetoRequest
    from worker_ext.agent.trace_jobs import TraceJob, cpu_wait_path, kineto_cpu_wait

    log_file = str(tmp_path / ".kineto.policy.rank0.1.0.json")
    req = KinetoRequest(pid=1, config="", log_file=log_file, directory="", metadata="")
    job = TraceJob(0, 0, (1, 2), False, "cpu", 5, False, "none", "raw", None, kineto=req)
    path = cpu_wait_path(log_file)
    if plant == "fifo":
        os.mkfifo(path)
    elif plant == "link":
        planted = tmp_path / "planted"
        planted.write_text("999999")
        os.symlink(planted, path)
    else:
        body = {"text": b"12ab", "long": b"9" * 4000, "empty": b""}[plant]
        Path(path).write_bytes(body)
    assert kineto_cpu_wait(job) is None
    assert not os.path.lexists(path)


def test_the_summary_gives_the_measured_wait_a_recorded_step(tmp_path: Path) -> None:
    """A real torch.profiler trace of 3 steps summarised with the rank's wait a step; one
    longer than the whole window is refused (not measured)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from worker_ext.agent.trace_summary import summarise_trace

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for k in range(3):
            with torch.profiler.record_function(f"ProfilerStep#{k}"):  # (the step markers)
                torch.ones(64, 64).matmul(torch.ones(64, 64))
    path = str(tmp_path / "t.json")
    prof.export_chrome_trace(path)
    kw: dict[str, Any] = dict(rank=0, window=0, steps=(0, 2), partial=False, device="cpu")
    s, _ = summarise_trace(path, top_k=5, cpu_wait_ns=30_000, **kw)  # (a step's, as sent)
    assert s.host is not None and len(s.step_us) == 3, s.step_us
    assert s.host.cpu_wait_us == pytest.approx(30.0)
    s, _ = summarise_trace(path, top_k=5, cpu_wait_ns=10**15, **kw)  # longer than the window
    assert s.host is not None and s.host.cpu_wait_us is None
    s, _ = summarise_trace(path, top_k=5, **kw)
    assert s.host is not None and s.host.cpu_wait_us is None


# The real rank: pinned to one CPU, with or without a process burning that CPU.


def _burner(cpu: int) -> subprocess.Popen[bytes]:
    code = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True:\n    pass\n"
    return subprocess.Popen([sys.executable, "-c", code])


def _rank_main(out: str, cpu: int, burn: bool) -> None:
    """A rank pinned to ``cpu`` (a burner beside it when ``burn``): one window of ``ACTIVE``
    recorded steps of ``WORK_S`` CPU work each, through a real ``RankProfiler`` and its local
    agent; each recorded step's wall and thread CPU time, and the window's summary."""
    os.sched_setaffinity(0, {cpu})
    import torch

    from coordinator.core.config import ProfilerConfig
    from coordinator.core.schedule import Window
    from worker_ext.rank.rank_profiler import RankProfiler

    torch.set_num_threads(1)
    cfg = ProfilerConfig(enable=True, save_path=out, ranks="all", activities=["cpu"])
    rp = RankProfiler(0, cfg.validate(), os.path.join(out, "run"))
    burner = _burner(cpu) if burn else None
    time.sleep(0.2)  # (the burner running)
    walls, cpus = [], []
    rp.start_window(Window(0, 0, 1, ACTIVE), 0)
    for k in range(ACTIVE + 1):
        w0, c0 = time.perf_counter(), time.thread_time()
        while time.thread_time() - c0 < WORK_S:
            torch.ones(32, 32).add_(1)
        if k >= 1:
            walls.append(time.perf_counter() - w0)
            cpus.append(time.thread_time() - c0)
        rp.step(k)
    if burner is not None:
        burner.kill()
        burner.wait()
    st = rp.wait_for_summaries(60)
    blobs = [s.hex() for s in st["summaries"]]
    with open(os.path.join(out, "rank.json"), "w") as f:
        json.dump({"walls": walls, "cpus": cpus, "summaries": blobs}, f)


def _window(tmp_path: Path, burn: bool) -> tuple[dict[str, Any], float, float]:
    """The rank's window as ``advise`` reads it, its step and the wait it really had (wall less
    CPU time), both ms a recorded step."""
    from coordinator.core.aggregate import WindowAggregate
    from coordinator.protocol.summary_codec import decode_summary

    out = str(tmp_path / ("burn" if burn else "alone"))
    cpu = min(os.sched_getaffinity(0))
    subprocess.run(
        [sys.executable, __file__, out, str(cpu), str(int(burn))],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, check=True, timeout=240,
    )  # fmt: skip
    with open(os.path.join(out, "rank.json")) as f:
        got = json.load(f)
    (blob,) = got["summaries"]
    agg = WindowAggregate(0)
    agg.add(decode_summary(bytes.fromhex(blob)))
    step = sum(got["walls"]) / ACTIVE * 1e3
    return dict(agg.to_dict(10)), step, (sum(got["walls"]) - sum(got["cpus"])) / ACTIVE * 1e3


@pytest.mark.subprocess
def test_a_rank_sharing_its_cpu_is_named_at_the_wait_it_had(tmp_path: Path) -> None:
    t, step, waited = _window(tmp_path, burn=True)
    row = t["breakdown"]["ranks"][0]
    assert row["cpu_wait_us_per_step"] / 1e3 == pytest.approx(waited, rel=0.3), (row, waited)
    assert waited > 0.3 * step  # (the burner took about half the CPU)
    f = rules(t)["host_contention"]
    assert f["ranks"] == [0] and f["cost_ms_per_step"] == pytest.approx(waited, rel=0.3)


@pytest.mark.subprocess
def test_the_same_rank_alone_on_its_cpu_is_quiet(tmp_path: Path) -> None:
    t, step, waited = _window(tmp_path, burn=False)
    measured = t["breakdown"]["ranks"][0]["cpu_wait_us_per_step"] / 1e3
    assert measured == pytest.approx(waited, rel=0.3, abs=0.01 * step), (measured, waited)
    if waited < 0.015 * step:  # (the shared test host may run others' work on this CPU)
        assert "host_contention" not in rules(t)


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1")
