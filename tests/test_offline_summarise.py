"""``ray-profiler summarise``: any trace's cross-rank tables with no Ray (issue 29), the same
tables the coordinator gives online, and bad input named and refused with exit status 2."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import uuid

from coordinator import get_or_create_coordinator
from coordinator.ops.cli import main as cli_main
from coordinator.ops.offline import summarise_traces
from coordinator.protocol.replies import KernelSummaryReply
from tests.configs import ROOT, profiler_config
from tests.fault_cases import wait_for_windows

TRACES = os.path.join(ROOT, "tests", "data", "gpu-traces")
TWO_RANKS = os.path.join(TRACES, "two-ranks")


def run(capsys, *argv):
    code = cli_main(["summarise", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_shared_two_rank_window_prints_a_two_rank_table(capsys):
    code, out, err = run(capsys, TWO_RANKS)
    assert code == 0 and err == ""
    assert "2 trace(s): rank 0 " in out and "policy ranks [0, 1], device time per kernel" in out
    assert "window 0 steps [551, 552]" in out and "ncclKernel_SendRecv_RING_SIMPLE" in out
    lines = out.splitlines()
    idle = next(i for i, ln in enumerate(lines) if ln.startswith("rank  window ms"))
    assert "overlap" in lines[idle] and lines[idle + 1].split()[0] == "0"
    assert any(ln.split()[:2] == ["1", "1154"] for ln in lines)  # rank 1's launches


def test_json_is_the_kernel_summary_reply(capsys):
    code, out, _ = run(capsys, TWO_RANKS, "--json", "--k", "5")
    ks = json.loads(out)
    assert code == 0 and set(ks) == set(KernelSummaryReply.__required_keys__)
    assert ks["ranks"] == [0, 1] and ks["device"] == "cuda" and len(ks["kernels"]) == 5
    assert set(ks["per_rank"]) == {k["name"] for k in ks["kernels"]}
    assert ks["launch"]["1"]["kernels"] == 1154 and ks["unattributed_us"] == {"0": 0.0, "1": 0.0}
    code, out, _ = run(capsys, TWO_RANKS, "--json", "--by", "op", "--k", "3")
    ops = json.loads(out)
    assert ops["by"] == "op" and [k["name"] for k in ops["kernels"]][0] == "record_param_comms"
    first = ops["ops"]["record_param_comms"]
    assert first["cpu_us"] > 0 and first["kernels"][0][0].startswith("ncclKernel_SendRecv")


def test_steps_pick_the_window_and_the_rest_is_unattributed(capsys):
    both = summarise_traces([TWO_RANKS]).table
    last = summarise_traces([TWO_RANKS], steps=(552, 552)).table
    assert last["steps"] == [552, 552]
    for r in ("0", "1"):
        rank = int(r)
        assert last["device_steps"][rank] == [both["device_steps"][rank][1]]
        assert last["unattributed_us"][rank] > 0  # step 551's device work, counted apart


def test_bad_input_is_named_and_exits_2(tmp_path, capsys):
    not_a_trace = tmp_path / "notes.json"
    not_a_trace.write_text("not json")
    truncated = tmp_path / "cut.json.gz"
    src = os.path.join(TWO_RANKS, "sampled_rank-0.json.gz")
    with open(src, "rb") as f:
        truncated.write_bytes(f.read()[:30_000])
    twice = tmp_path / "twice"
    twice.mkdir()
    shutil.copy(src, twice / "a.json.gz")
    shutil.copy(src, twice / "b.json.gz")
    (tmp_path / "empty").mkdir()
    cases = [
        ([str(not_a_trace)], f"{not_a_trace} is not a valid chrome trace"),
        ([str(truncated)], f"{truncated} cannot be read: Compressed file ended"),
        ([str(twice)], f"{twice}/b.json.gz and {twice}/a.json.gz both claim rank 0"),
        ([str(tmp_path / "nothing")], "nothing: no such file or directory"),
        ([str(tmp_path / "empty")], "empty: no .json or .json.gz trace"),
        ([TWO_RANKS, "--steps", "9-3"], "--steps '9-3'"),
        ([TWO_RANKS, "--steps", "700-800"], "no ProfilerStep in steps 700-800 (it has 551-552)"),
    ]
    for argv, said in cases:
        code, out, err = run(capsys, *argv)
        assert (code, out) == (2, ""), argv
        assert err.startswith("error: ") and said in err, (argv, err)


def test_a_trace_with_no_step_marker_is_read_whole_and_says_so(tmp_path, capsys):
    t0 = 1_700_000_000_000.0
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": t0, "dur": 30},
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "aten::add",
            "pid": 1,
            "tid": 1,
            "ts": t0 + 40,
            "dur": 10,
        },
    ]
    path = tmp_path / "plain.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    code, out, _ = run(capsys, str(path))
    assert code == 0
    assert f"note: {path} has no ProfilerStep marker: read whole as one window" in out
    assert f"note: {path} names no rank (no distributedInfo): read as rank 0" in out
    table = summarise_traces([str(path)]).table
    assert {k["name"]: k["total_us"] for k in table["kernels"]} == {
        "aten::mm": 30.0,
        "aten::add": 10.0,
    }
    assert table["breakdown"]["ranks"][0]["window_us"] == 50.0


def test_offline_gives_the_table_the_coordinator_gave_online(
    ray_session, ray_actors, toy_workers, tmp_path
):
    """A real window of two CPU ranks: the coordinator's ``kernel_summary(per_rank=True)``,
    and ``summarise`` of the traces the ranks wrote, are the same table."""
    ray = ray_session
    cfg = profiler_config(tmp_path, wait=0, warmup=1, active=3, repeat=1)
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    coord = get_or_create_coordinator(cfg, name=name, namespace="profiler-tests")
    ray_actors.append(coord)
    workers = toy_workers(2)
    ray.get(coord.register.remote("t", workers))
    ray.get(coord.start.remote("t", 0))
    for k in range(6):
        ray.get([w.train_step.remote(3) for w in workers])
        ray.get(coord.step.remote("t", k))
    ray.get(coord.stop.remote("t"))
    (window,) = wait_for_windows(ray, coord)["windows"]
    online = ray.get(coord.kernel_summary.remote(window=0, top_k=20, per_rank=True))
    offline = summarise_traces([window["trace_dir"]], tuple(window["steps"]), 20).table
    differ = {"run", "trainer_id", "role"}  # what only the coordinator knows
    for row in online["breakdown"]["ranks"].values():  # what only the live rank measured
        assert row.pop("cpu_wait_us_per_step") >= 0.0  # (its thread's wait for a CPU)
    online["breakdown"].get("mean", {}).pop("cpu_wait_us_per_step", None)
    assert {k: v for k, v in offline.items() if k not in differ} == {
        k: v for k, v in online.items() if k not in differ
    }
    assert online["ranks"] == [0, 1] and online["kernels"]


def test_the_notebook_frame_of_the_op_table_holds_each_op_s_cpu_time_and_kernels():
    from coordinator.ops import notebook as nb

    ops = summarise_traces([TWO_RANKS], top_k=4, by="op").table
    frame = nb.kernels_frame(ops)
    assert frame.attrs["by"] == "op" and list(frame["name"])[0] == "record_param_comms"
    row = frame.iloc[0]
    assert row["cpu_us"] == ops["ops"]["record_param_comms"]["cpu_us"] > 0
    assert row["kernels"][0][0].startswith("ncclKernel_SendRecv")
    kernels = nb.kernels_frame(summarise_traces([TWO_RANKS], top_k=4).table)
    assert "cpu_us" not in kernels.columns and kernels.attrs["by"] == "kernel"
