"""``ray-profiler summarise --advise`` (issue 57): the findings of traces on disk.

A real 2-rank gloo job records two windows: in the first, rank 1 sleeps ``DELAY_S`` before
every step's all_reduce; in the second, no rank sleeps. ``collective_wait`` names rank 1 in the
first with a cost within 30% of the delay, and stays quiet in the second. On the real NCCL
traces, the GPU rules' costs are the figures of the window's own tables.

Run as a script (``python tests/test_findings_offline.py OUTDIR PORT``) it is the job."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import pytest

from tests.gloo_windows import join, profiler, run_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = os.path.join(ROOT, "tests", "data", "gpu-traces")
DELAY_S = 0.05
ACTIVE = 6  # recorded steps a window


def _rank_main(rank: int, world: int, out: str, port: int) -> None:
    """One rank: a little compute, then the all_reduce; rank 1 sleeps ``DELAY_S`` before it
    in the first window's steps (its warm-up too), not in the second's."""
    import torch
    import torch.distributed as dist

    join(rank, world, port)
    t, a = torch.ones(4096), torch.randn(128, 128)
    per = 1 + ACTIVE
    with profiler(out, rank, ("late", "quiet"), ACTIVE) as prof:
        for step in range(2 * per):
            for _ in range(20):
                a = torch.tanh(a @ a)
            if rank == 1 and step < per:
                time.sleep(DELAY_S)
            dist.all_reduce(t)
            prof.step()
    dist.barrier()
    dist.destroy_process_group()


def _job(out: str, port: int) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(2, out, port), nprocs=2)


@pytest.fixture(scope="module")
def gloo_windows(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The job's two windows' traces: ``late/`` and ``quiet/`` (made once for the module)."""
    return run_job(__file__, str(tmp_path_factory.mktemp("gloo2")), ("late", "quiet"), 2)


def advise_json(capsys: Any, *argv: str) -> dict[str, Any]:
    """``ray-profiler summarise ... --advise --json``, in this process: its reply."""
    from coordinator.ops.cli import main as cli_main

    assert cli_main(["summarise", *argv, "--advise", "--json"]) == 0
    reply: dict[str, Any] = json.loads(capsys.readouterr().out)
    return reply


def by_rule(reply: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["rule"]: f for f in reply["findings"]}


@pytest.mark.subprocess
def test_collective_wait_names_the_late_rank_at_its_delay(gloo_windows, capsys):
    reply = advise_json(capsys, os.path.join(gloo_windows, "late"))
    assert reply["run"] == "offline" and reply["window"] == 0 and len(reply["steps"]) == ACTIVE
    f = by_rule(reply)["collective_wait"]
    assert f["ranks"] == [1] and f["evidence"]["waiting_ranks"] == [0]
    assert f["cost_ms_per_step"] == pytest.approx(DELAY_S * 1e3, rel=0.3), f
    assert reply["findings"][0] is not None and "Rank 1" in f["advice"]
    costs = [x["cost_ms_per_step"] for x in reply["findings"]]
    assert costs == sorted(costs, reverse=True)
    # the wait is not also exposed communication: rank 0's all_reduce holds it
    assert 0 not in by_rule(reply).get("exposed_comm", {"ranks": []})["ranks"]


@pytest.mark.subprocess
def test_the_same_job_without_the_delay_names_no_late_rank_near_it(gloo_windows, capsys):
    """Without the sleep, no finding costs anything near the delay. (A loaded host's jitter
    is a real wait of a few ms a step, and may be named: it is not the injected fault.)"""
    reply = advise_json(capsys, os.path.join(gloo_windows, "quiet"))
    assert reply["findings"] or reply["quiet"]
    for f in reply["findings"]:
        assert f["cost_ms_per_step"] < 0.3 * DELAY_S * 1e3, f
        assert f["rule"] != "collective_wait" or f["ranks"] != [1] or f["cost_ms_per_step"] < 10


@pytest.mark.subprocess
def test_the_text_gives_one_line_a_finding_then_its_evidence(gloo_windows, capsys):
    from coordinator.ops.cli import main as cli_main

    assert cli_main(["summarise", os.path.join(gloo_windows, "late"), "--advise"]) == 0
    lines = capsys.readouterr().out.splitlines()
    first = next(ln for ln in lines if "collective_wait" in ln)
    assert first.split()[1:4] == ["ms/step", "collective_wait", "rank"]
    assert float(first.split()[0]) == pytest.approx(DELAY_S * 1e3, rel=0.3)
    after = lines[lines.index(first) + 1]
    assert after.startswith(" " * 20) and ":" in after
    assert any(ln.startswith("quiet: ") for ln in lines)


def test_the_nccl_pair_names_rank_1_late_and_costs_its_figures(capsys):
    from coordinator.ops.offline import collectives_reply, summarise_traces

    folder = os.path.join(TRACES, "two-ranks")
    reply = advise_json(capsys, folder)
    found = by_rule(reply)
    la = collectives_reply(summarise_traces([folder]))["last_arriver"]
    assert la is not None and la["rank"] == 1
    wait = found["collective_wait"]
    assert wait["ranks"] == [1] and wait["cost_ms_per_step"] == round(la["wait_ms_per_step"], 3)
    # rank 0's exposed communication is its wait for rank 1: counted once, as that wait
    assert 0 not in found.get("exposed_comm", {"ranks": []})["ranks"]


def test_launch_bound_on_the_nccl_rank_costs_its_launch_bound_steps_idle(capsys):
    from coordinator.ops.offline import summarise_traces

    folder = os.path.join(TRACES, "one-rank-nccl")
    table = summarise_traces([folder]).table
    bound = set(table["launch"][0]["launch_bound"])
    steps = table["device_steps"][0]
    idle_ms = sum(span - busy for s, busy, span in steps if int(s) in bound) / 1e3 / len(steps)
    f = by_rule(advise_json(capsys, folder))["launch_bound"]
    assert bound and f["ranks"] == [0]
    assert f["cost_ms_per_step"] == pytest.approx(idle_ms, abs=1e-3)


def test_advise_reads_a_record_with_from_as_its_table_says(capsys):
    """A record (summaries from before issue 56: no collectives) answers ``advise`` with the
    rules run on the same window's ``kernel_summary``."""
    from coordinator.core.findings import RULES, window_findings
    from coordinator.core.findings_inputs import GPU_RULES, HOST_ROW_RULES
    from coordinator.ops.cli import main as cli_main

    record = os.path.join(ROOT, "tests", "data", "record-v1")
    assert cli_main(["advise", "--from", record, "--json"]) == 0
    reply = json.loads(capsys.readouterr().out)
    assert (reply["run"], reply["window"], reply["steps"]) == ("golden-v1", 4, [11, 12])
    assert cli_main(["top", "--from", record, "--k", "0", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    found, quiet = window_findings(table)
    assert json.loads(json.dumps(found)) == reply["findings"]
    missing = reply["not_judged"]  # (its summaries are older than the host and GPU rules)
    assert sorted(reply["quiet"] + list(missing)) == sorted(quiet), (reply, quiet)
    expected = {*HOST_ROW_RULES, *GPU_RULES, "host_contention", "memory_peak", "memory_leak"}
    expected &= set(RULES)
    assert set(missing) == expected, missing
    assert (
        "older than this rule" in missing["dataloader"] and "device_gib" in missing["memory_peak"]
    )
    assert {f["rule"] for f in reply["findings"]} == {"gpu_idle", "exposed_comm"}
    assert cli_main(["advise", "--from", record]) == 0
    out = capsys.readouterr().out
    assert out.startswith("run golden-v1, window 4 (steps 11-12): 2 finding(s)")
    assert "not judged: dataloader: no rank's host time in the window" in out, out
    assert cli_main(["advise", "--from", record, "--window", "99"]) == 1
    assert "no window 99" in capsys.readouterr().err


if __name__ == "__main__":
    _job(sys.argv[1], int(sys.argv[2]))
