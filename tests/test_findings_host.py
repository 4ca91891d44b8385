"""The findings' ``dataloader`` and ``zero_grad`` rules (issue 57): on hand-built window figures
(each fires with the right ranks and cost, stays quiet without the fault, and the time is not
counted again by ``collective_wait``, ``straggler`` or ``gpu_idle``); the figures' way from a
rank's summary through node partials and the window's aggregate (and a summary from before
them); and a real 3-rank gloo job whose traces ``summarise --advise`` reads.

The job records two windows: in ``faulty``, rank 1's Dataset sleeps ``SLEEP_S`` an item (its
DataLoader ``BATCH`` items a step, ``num_workers=0``) and every rank zeroes its gradients
with ``zero_grad(set_to_none=False)``, timed; in ``clean``, no rank sleeps and gradients are
set to None. Run as a script (``python tests/test_findings_host.py OUTDIR PORT``) it is the job.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import msgspec
import pytest

from tests.gloo_windows import join, profiler, run_job
from tests.test_findings_core import STEP_MS, _arriver, _rank, _row, rules, table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLEEP_S = 0.01
BATCH = 4
ACTIVE = 6
WORLD = 3


def _host(t: dict[str, Any], rank: int, loader_ms: float = 0.1, zero_ms: float = 0.0) -> None:
    row = t["breakdown"]["ranks"][rank]
    row["dataloader_us_per_step"], row["zero_grad_us_per_step"] = loader_ms * 1e3, zero_ms * 1e3


def _hosted(ranks: int = 4, device: str = "cpu") -> dict[str, Any]:
    t = table(ranks, device)
    for r in range(ranks):
        _host(t, r)
    return t


def test_the_host_rules_are_quiet_on_a_quiet_window() -> None:
    assert rules(_hosted()) == {}
    assert rules(_hosted(device="cuda")) == {}


def test_dataloader_names_the_rank_over_five_percent_at_its_time() -> None:
    t = _hosted()
    _host(t, 1, loader_ms=30.0)
    f = rules(t)["dataloader"]
    assert f["ranks"] == [1] and not f["all_ranks"]
    assert f["cost_ms_per_step"] == 30.0
    assert f["evidence"]["ms_per_step"] == {1: 30.0}
    assert f["evidence"]["share_of_step"] == {1: 0.3}
    for api in ("num_workers", "pin_memory=True", "persistent_workers=True"):
        assert api in f["advice"]
    _host(t, 1, loader_ms=4.0)  # 4%: under torch-tb-profiler's 5%
    assert rules(t) == {}
    assert rules(t, settings={"dataloader": {"share": 0.03}})["dataloader"]["ranks"] == [1]


def test_zero_grad_fires_on_any_zeroing_and_costs_its_time() -> None:
    t = _hosted()
    for r in range(4):
        _host(t, r, zero_ms=2.0 + r)
    f = rules(t)["zero_grad"]
    assert f["all_ranks"] and f["cost_ms_per_step"] == pytest.approx(3.5)
    assert "set_to_none=True" in f["advice"] and "optimizer.zero_grad" in f["advice"]
    assert rules(t, settings={"zero_grad": {"min_share": 0.05}}) == {}  # 2-5% of the step


def test_a_rank_late_for_its_data_is_not_also_a_collective_wait() -> None:
    t = _hosted()
    _host(t, 1, loader_ms=30.1)
    t["stragglers"]["last_arriver"] = _arriver(rank=1, wait_ms=30.0)
    for r in (0, 2, 3):
        t["breakdown"]["ranks"][r] = {**_row(comm_ms=34.0), "dataloader_us_per_step": 100.0}
    found = rules(t)
    assert found["dataloader"]["ranks"] == [1] and found["dataloader"]["cost_ms_per_step"] == 30.1
    assert set(found) == {"dataloader"}  # its wait is its data loading: counted once
    t["stragglers"]["last_arriver"] = _arriver(rank=1, wait_ms=45.0)  # 15 ms more than that
    f = rules(t)["collective_wait"]
    assert f["cost_ms_per_step"] == pytest.approx(45.0 - 30.0)
    assert f["evidence"]["host_subtracted_ms"] == pytest.approx(30.0)


def test_zeroing_alike_on_every_rank_takes_nothing_off_the_wait() -> None:
    t = _hosted()
    for r in range(4):
        _host(t, r, zero_ms=5.0)
    t["stragglers"]["last_arriver"] = _arriver(rank=1, wait_ms=30.0)
    found = rules(t)
    assert found["collective_wait"]["cost_ms_per_step"] == 30.0
    assert found["zero_grad"]["cost_ms_per_step"] == 5.0


def test_a_rank_slow_for_its_data_is_not_also_a_straggler() -> None:
    t = _hosted()
    t["stragglers"]["ranks"][2] = _rank(step_ms=STEP_MS + 40.0)  # no collectives: its own step
    _host(t, 2, loader_ms=40.1)
    found = rules(t)
    assert set(found) == {"dataloader"} and found["dataloader"]["ranks"] == [2]
    _host(t, 2, loader_ms=4.0)  # under the threshold: the straggler's excess is its own
    assert set(rules(t)) == {"straggler"}


def test_the_device_idle_of_a_rank_loading_data_is_counted_once() -> None:
    t = _hosted(device="cuda")
    t["breakdown"]["ranks"][1] = {**_row(other_ms=40.0), "dataloader_us_per_step": 30e3}
    found = rules(t)
    assert found["dataloader"]["cost_ms_per_step"] == 30.0
    assert "gpu_idle" not in found  # 40 - 30 = 10 ms idle left: under 15%
    t["breakdown"]["ranks"][1]["other_us"] = 50e3 * 4  # 20 ms idle left: over 15%
    found = rules(t)
    assert found["gpu_idle"]["ranks"] == [1]
    assert found["gpu_idle"]["cost_ms_per_step"] == pytest.approx(20.0)


def test_on_a_cuda_rank_loading_costs_at_most_the_device_s_idle() -> None:
    """Loading while the device still runs the queued kernels costs the step nothing: a CUDA
    rank's ``dataloader`` cost is its device's idle at most, the whole time in evidence."""
    t = _hosted(device="cuda")
    t["breakdown"]["ranks"][1] = {**_row(other_ms=10.0), "dataloader_us_per_step": 30e3}
    found = rules(t)
    f = found["dataloader"]
    assert (f["ranks"], f["cost_ms_per_step"]) == ([1], 10.0), f
    assert f["evidence"]["host_ms"] == {1: 30.0} and f["evidence"]["share_of_step"][1] == 0.3
    assert "gpu_idle" not in found  # its idle is the loading's, counted once
    t["breakdown"]["ranks"][1]["other_us"] = 0.0  # the device never idles: nothing to save
    assert "dataloader" not in rules(t)
    cpu = _hosted()
    cpu["breakdown"]["ranks"][1] = {**_row(other_ms=10.0), "dataloader_us_per_step": 30e3}
    assert rules(cpu)["dataloader"]["cost_ms_per_step"] == 30.0  # a CPU rank: no device


def _summary(rank: int, host: Any) -> Any:
    from coordinator.protocol.summary_codec import Breakdown, KernelRow, RankSummary

    return RankSummary(
        rank=rank, window=2, steps=(5, 8), partial=False, device="cpu",
        kernels=[KernelRow("aten::mm", 1e3, 4, 0)], step_us=[(s, 100e3) for s in range(5, 9)],
        breakdown=Breakdown(compute_us=1e3, other_us=399e3, window_us=400e3), host=host,
    )  # fmt: skip


def test_the_host_figures_go_from_summaries_through_partials_into_the_findings() -> None:
    from coordinator.core.aggregate import WindowAggregate, restored_aggregate, saved_aggregate
    from coordinator.core.findings import window_findings
    from coordinator.core.partial import fold_summaries
    from coordinator.protocol.partial_codec import decode_partial, encode_partial
    from coordinator.protocol.summary_codec import HostRow, decode_summary, encode_summary

    sent = [_summary(0, HostRow(100.0, 4, 0.0, 0)), _summary(1, HostRow(25e3, 4, 0.0, 0))]
    sent.append(_summary(2, None))  # a summary without them: its rank counts 0 in the mean
    got = [decode_summary(encode_summary(s)) for s in sent]
    assert [s.host for s in got] == [s.host for s in sent]
    agg = WindowAggregate(2)
    agg.add_partial(decode_partial(encode_partial(fold_summaries("n", got[:2]))))
    agg.add(got[2])
    agg = restored_aggregate(saved_aggregate(agg))
    rows = agg.to_dict(10)["breakdown"]
    assert rows["ranks"][1]["dataloader_us_per_step"] == 25e3
    assert "dataloader_us_per_step" not in rows["ranks"][2]
    assert rows["mean"]["dataloader_us_per_step"] == pytest.approx((100 + 25e3) / 3)
    found, _ = window_findings(agg.to_dict(10))
    assert [(f["rule"], f["ranks"], f["cost_ms_per_step"]) for f in found] == [
        ("dataloader", [1], 25.0)
    ]


def test_a_summary_from_before_the_host_figures_still_decodes() -> None:
    from coordinator.protocol.summary_codec import HostRow, decode_summary, encode_summary

    wire = msgspec.msgpack.decode(encode_summary(_summary(0, HostRow(1.0, 1, 2.0, 3))))
    del wire["host"]
    assert decode_summary(msgspec.msgpack.encode(wire)).host is None
    wire["host"] = [1.0, 1, -2.0, 3]
    with pytest.raises(ValueError, match=r"\$\.host\[2\]"):
        decode_summary(msgspec.msgpack.encode(wire))


def test_the_reader_counts_the_outermost_zeroing_under_zero_grad_and_each_next(tmp_path):
    """A real torch.profiler trace: each parameter's ``aten::zero_`` under the optimizer's
    ``zero_grad`` once (not its ``aten::fill_`` inside, nor a new zeros tensor's), every
    ``__next__`` of the DataLoader; with ``set_to_none=True``, no zeroing."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from worker_ext.agent.trace_summary import summarise_trace

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    batches = iter(torch.utils.data.DataLoader(torch.ones(64, 64), batch_size=8))
    got = []
    for none in (False, True):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                model(next(batches)).sum().backward()
                torch.zeros(4096).add_(1)  # a new zeros tensor: not a gradient zeroed
                opt.zero_grad(set_to_none=none)
        path = str(tmp_path / f"none{none}.json")
        prof.export_chrome_trace(path)
        s, _ = summarise_trace(
            path, rank=0, window=0, steps=(0, 0), partial=False, device="cpu", top_k=5
        )
        got.append(s.host)
    zeroed, set_to_none = got
    assert zeroed is not None and set_to_none is not None
    assert (zeroed.dataloader_calls, zeroed.zero_grad_ops) == (3, 3 * 4)
    assert zeroed.dataloader_us > 0 and zeroed.zero_grad_us > 0
    assert (set_to_none.dataloader_calls, set_to_none.zero_grad_ops) == (3, 0)
    assert set_to_none.zero_grad_us == 0.0


# The real job.


def _rank_main(rank: int, world: int, out: str, port: int) -> None:
    """One rank: a DataLoader over a Dataset that sleeps on rank 1 in the first window (its
    warm-up too), a model of 8.4 M parameters, the gradients zeroed by kernels (timed) in the
    first window and set to None in the second, an all_reduce to end each step."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, Dataset

    class Items(Dataset[torch.Tensor]):
        slow = False

        def __len__(self) -> int:
            return 1 << 20

        def __getitem__(self, i: int) -> torch.Tensor:
            if self.slow:
                time.sleep(SLEEP_S)
            return torch.ones(1024)

    join(rank, world, port)
    items = Items()
    batches = iter(DataLoader(items, batch_size=BATCH, num_workers=0))
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(8)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, foreach=False)
    t, per, zeroing = torch.ones(1024), 1 + ACTIVE, []
    with profiler(out, rank, ("faulty", "clean"), ACTIVE) as prof:
        for step in range(2 * per):
            items.slow = rank == 1 and step < per
            x = next(batches)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=step >= per)
            if 1 <= step < per:  # the first window's recorded steps
                zeroing.append(time.perf_counter() - t0)
            model(x).sum().backward()
            opt.step()
            dist.all_reduce(t)
            prof.step()
    with open(os.path.join(out, f"zeroing{rank}.json"), "w") as f:
        json.dump(zeroing, f)
    dist.barrier()
    dist.destroy_process_group()


def _job(out: str, port: int) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(WORLD, out, port), nprocs=WORLD)


@pytest.fixture(scope="module")
def host_windows(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The job's two windows' traces, ``faulty/`` and ``clean/``, and each rank's measured
    zeroing times (made once for the module)."""
    out = str(tmp_path_factory.mktemp("host3"))
    return run_job(__file__, out, ("faulty", "clean"), WORLD)


def _advise(capsys: Any, folder: str) -> dict[str, dict[str, Any]]:
    from tests.test_findings_offline import advise_json, by_rule

    return by_rule(advise_json(capsys, folder))


@pytest.mark.subprocess
def test_dataloader_names_the_rank_whose_items_sleep_at_their_time(host_windows, capsys):
    found = _advise(capsys, os.path.join(host_windows, "faulty"))
    f = found["dataloader"]
    assert f["ranks"] == [1], f
    assert f["cost_ms_per_step"] == pytest.approx(BATCH * SLEEP_S * 1e3, rel=0.3), f
    # the others' wait for rank 1 at the all_reduce is its data loading: not counted again
    # (on a loaded host, another rank's jitter is a real wait and may be named)
    for rule in ("collective_wait", "straggler"):
        again = found.get(rule, {"ranks": []})
        assert 1 not in again["ranks"] or again["cost_ms_per_step"] < 0.3 * f["cost_ms_per_step"]


@pytest.mark.subprocess
def test_zero_grad_costs_the_measured_zeroing(host_windows, capsys):
    found = _advise(capsys, os.path.join(host_windows, "faulty"))
    measured = []
    for r in range(WORLD):
        with open(os.path.join(host_windows, f"zeroing{r}.json")) as fh:
            measured.append(sum(json.load(fh)) / ACTIVE * 1e3)
    f = found["zero_grad"]
    assert f["all_ranks"], f
    assert f["cost_ms_per_step"] == pytest.approx(sum(measured) / WORLD, rel=0.3), (f, measured)


@pytest.mark.subprocess
def test_the_same_job_without_the_faults_is_quiet(host_windows, capsys):
    from tests.test_findings_offline import advise_json

    reply = advise_json(capsys, os.path.join(host_windows, "clean"))
    assert {"dataloader", "zero_grad"} <= set(reply["quiet"]), reply
    # nothing names rank 1 near the sleep it no longer has (a loaded host's jitter is a real
    # wait or a slower rank of a few ms, and may be named: it is not the injected fault)
    for f in reply["findings"]:
        assert 1 not in f["ranks"] or f["cost_ms_per_step"] < 0.5 * BATCH * SLEEP_S * 1e3, f


if __name__ == "__main__":
    _job(sys.argv[1], int(sys.argv[2]))
