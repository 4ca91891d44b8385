"""``ray-profiler summarise --collectives`` (issue 56): a real 4-rank gloo job's traces (a
default group and two groups of 2, one rank sleeping a known time before chosen collectives)
name that rank last and the others' wait as the delay; a rank's clock shifted by seconds is
found and set; the real NCCL traces agree with a plain reading of their events; bad input is a
line in ``problems`` while the rest still answers.

Run as a script (``python tests/test_collectives_offline.py OUTDIR PORT``) it is the job."""

from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = os.path.join(ROOT, "tests", "data", "gpu-traces")
DELAY_S = 0.06
STEPS = (1, 2, 3, 4, 5)  # the recorded steps (step 0 is the profiler's warm-up)
RANK1_LATE = (2, 4)  # steps where rank 1 sleeps before the default group's all_reduce
RANK3_LATE = 3  # the step where rank 3 sleeps before its group's (ranks 2, 3) all_reduce
SHIFT_US = 5e6  # a clock 5 s off


# ------------------------------------------------------------------ the job (a script)


def _rank_main(rank: int, world: int, out: str, port: int) -> None:
    """One rank: every step the default group's all_reduce, its group's all_reduce, an
    all_gather and a broadcast; rank 1 (rank 3) sleeps ``DELAY_S`` before the chosen ones."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, schedule

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    t = torch.ones(4096)
    gathered = [torch.zeros(4096) for _ in range(world)]
    with profile(
        activities=[ProfilerActivity.CPU],
        record_shapes=True,
        schedule=schedule(wait=0, warmup=1, active=len(STEPS), repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(f"{out}/rank{rank}.json"),
    ) as prof:
        for step in range(len(STEPS) + 1):
            if rank == 1 and step in RANK1_LATE:
                time.sleep(DELAY_S)
            dist.all_reduce(t)
            if rank == 3 and step == RANK3_LATE:
                time.sleep(DELAY_S)
            dist.all_reduce(t, group=pair)
            dist.all_gather(gathered, t)
            dist.broadcast(t, 0)
            prof.step()
    dist.barrier()
    dist.destroy_process_group()


def _job(out: str, port: int) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(4, out, port), nprocs=4)


# ------------------------------------------------------------------ helpers


def summarise_json(capsys: Any, *argv: str) -> dict[str, Any]:
    """``ray-profiler summarise ... --collectives --json``, in this process."""
    from coordinator.ops.cli import main as cli_main

    code = cli_main(["summarise", *argv, "--collectives", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    reply: dict[str, Any] = json.loads(out)
    return reply


def rewrite(src: str, dst: str, edit: Any) -> None:
    """Trace ``src`` (``.json`` or ``.json.gz``) written to ``dst`` after ``edit(doc)``."""
    opener: Any = gzip.open if src.endswith(".gz") else open
    with opener(src, "rt") as f:
        doc = json.load(f)
    edit(doc)
    with (gzip.open if dst.endswith(".gz") else open)(dst, "wt") as f:  # type: ignore[operator]
        json.dump(doc, f)


def shifted(doc: dict[str, Any], us: float) -> None:
    for e in doc["traceEvents"]:
        if "ts" in e:
            e["ts"] = e["ts"] + us


def copy_ranks(src: str, dst: str, ranks: tuple[int, ...] = (0, 1, 2, 3)) -> str:
    os.makedirs(dst, exist_ok=True)
    for r in ranks:
        shutil.copy(os.path.join(src, f"rank{r}.json"), dst)
    return dst


def at(reply: dict[str, Any], group: str, step: int, seq: int = 0) -> dict[str, Any]:
    """The matched collective of ``group``, ``step``, order ``seq`` in the step."""
    found = [
        c
        for c in reply["collectives"]
        if c["group"] == group and c["step"] == step and c["seq"] == seq
    ]
    assert len(found) == 1, (group, step, seq, reply["problems"])
    return found[0]


def assert_the_late_ranks(reply: dict[str, Any]) -> None:
    """Rank 1 is last at the default group's first all_reduce of steps ``RANK1_LATE``, the
    others waiting ``DELAY_S`` (within 20%); rank 3 at its pair's all_reduce of step
    ``RANK3_LATE``, rank 2 waiting the same, and the other pair waiting for no one there."""
    delay_us = DELAY_S * 1e6
    for step in RANK1_LATE:
        c = at(reply, "0", step)
        assert c["name"] == "all_reduce" and c["ranks"] == [0, 1, 2, 3]
        assert c["last_rank"] == 1, c
        for r in ("0", "2", "3"):
            assert c["wait_us"][r] == pytest.approx(delay_us, rel=0.2), c
    for step in STEPS[1:]:  # (the first recorded step starts as each rank's profiler does)
        if step not in RANK1_LATE:  # no delay: no wait near it
            assert at(reply, "0", step)["skew_us"] < 0.2 * delay_us
    late = at(reply, "2", RANK3_LATE)
    assert late["ranks"] == [2, 3] and late["last_rank"] == 3
    assert late["wait_us"] == {"2": pytest.approx(delay_us, rel=0.2), "3": 0.0}
    assert at(reply, "1", RANK3_LATE)["skew_us"] < 0.2 * delay_us


# ------------------------------------------------------------------ the gloo job's traces


@pytest.fixture(scope="module")
def gloo_traces(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The job's four traces (made once for the module)."""
    out = str(tmp_path_factory.mktemp("gloo4"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), out, str(port)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(os.listdir(out)) == [f"rank{r}.json" for r in range(4)], done.stderr[-3000:]
    return out


@pytest.mark.subprocess
def test_the_sleeping_rank_is_last_and_the_others_wait_its_delay(gloo_traces, capsys):
    reply = summarise_json(capsys, gloo_traces)
    assert reply["run"] == "offline" and reply["steps"] == list(STEPS)
    assert reply["ranks_recorded"] == 4 and reply["ranks_without"] == []
    from worker_ext.agent.trace_reader import read_trace

    assert read_trace(os.path.join(gloo_traces, "rank0.json")).host == socket.gethostname()
    assert_the_late_ranks(reply)
    ranks = {p["rank"]: p for p in reply["ranks"]}
    assert all(not p["clock_corrected"] for p in ranks.values())  # one host: one clock
    # Subset groups match within their group only, and each is matched every step.
    for group, members in (("1", [0, 1]), ("2", [2, 3])):
        mine = [c for c in reply["collectives"] if c["group"] == group]
        assert len(mine) == len(STEPS) and all(c["ranks"] == members for c in mine)
    assert reply["matched"] == len(STEPS) * 5  # all_reduce x2 groups, all_gather, broadcast
    assert reply["problems"] == [], reply["problems"]


@pytest.mark.subprocess
def test_the_text_names_the_late_rank_and_lists_the_problems(gloo_traces, capsys):
    from coordinator.ops.cli import main as cli_main

    assert cli_main(["summarise", gloo_traces, "--collectives"]) == 0
    out = capsys.readouterr().out
    assert "collectives of window 0 (steps 1-5) of run offline; 4 ranks recorded" in out
    assert "largest skews" in out and "busbw GB/s" in out
    rows = [ln.split() for ln in out.splitlines()]
    for step in RANK1_LATE:  # group, step, seq, kind, ranks, last rank, skew ms
        row = next(r for r in rows if r[:3] == ["0", str(step), "0"])
        assert row[3:6] == ["all_reduce", "0-3", "1"] and float(row[6]) > 0.8e3 * DELAY_S


@pytest.mark.subprocess
def test_a_rank_clock_seconds_off_is_found_and_the_answers_do_not_change(
    gloo_traces, tmp_path, capsys
):
    base = summarise_json(capsys, gloo_traces)
    moved = copy_ranks(gloo_traces, str(tmp_path / "moved"))
    src = os.path.join(gloo_traces, "rank2.json")
    rewrite(src, os.path.join(moved, "rank2.json"), lambda d: shifted(d, SHIFT_US))
    reply = summarise_json(capsys, moved)
    rank2 = next(p for p in reply["ranks"] if p["rank"] == 2)
    assert rank2["clock_corrected"] and rank2["clock_reference"] == 0
    assert rank2["clock_offset_us"] == pytest.approx(SHIFT_US, abs=3_000)
    assert_the_late_ranks(reply)
    assert not any("clock" in p for p in reply["problems"])  # (seconds: said from a minute)
    for a, b in zip(base["collectives"], reply["collectives"], strict=True):
        assert (a["group"], a["step"], a["seq"]) == (b["group"], b["step"], b["seq"])
        if sorted(a["wait_us"].values())[1] > 5_000:  # (a last rank ahead of the next by 5 ms)
            assert a["last_rank"] == b["last_rank"]
        for r, w in a["wait_us"].items():
            assert b["wait_us"][r] == pytest.approx(w, abs=3_000)


# ------------------------------------------------------------------ bad input, said


@pytest.mark.subprocess
def test_a_trace_with_no_collective_is_said_beside_the_others(gloo_traces, tmp_path, capsys):
    work = copy_ranks(gloo_traces, str(tmp_path / "quiet"), (0, 1, 2))
    comm = ("c10d::", "gloo:", "record_param_comms")

    def drop_collectives(doc: dict[str, Any]) -> None:
        doc["traceEvents"] = [
            e for e in doc["traceEvents"] if not str(e.get("name", "")).startswith(comm)
        ]

    rewrite(os.path.join(gloo_traces, "rank3.json"), os.path.join(work, "rank3.json"),
            drop_collectives)  # fmt: skip
    reply = summarise_json(capsys, work)
    assert reply["ranks_without"] == [3]
    assert "ranks 3: no collective in their traces" in reply["problems"]
    assert any(p.startswith("group 2: only rank 2 recorded it") for p in reply["problems"])
    for step in RANK1_LATE:  # the rest still answers
        c = at(reply, "0", step)
        assert c["last_rank"] == 1 and c["ranks"] == [0, 1, 2] and c["missing"] == [3]


@pytest.mark.subprocess
def test_groups_naming_ranks_not_given_and_a_lone_rank_of_a_group_are_said(
    gloo_traces, tmp_path, capsys
):
    work = copy_ranks(gloo_traces, str(tmp_path / "three"), (0, 1, 2))

    def name_rank_9(doc: dict[str, Any]) -> None:
        for g in doc["distributedInfo"]["pg_config"]:
            if g["pg_name"] == "1":
                g["ranks"] = [0, 1, 9]

    rewrite(os.path.join(gloo_traces, "rank0.json"), os.path.join(work, "rank0.json"),
            name_rank_9)  # fmt: skip
    reply = summarise_json(capsys, work)
    problems = reply["problems"]
    assert any(p.startswith("group 0: ranks 3 of the group were not recorded") for p in problems)
    assert any(p.startswith("group 1: ranks 9 of the group were not recorded") for p in problems)
    assert "group 1: rank 1's trace names ranks 0-1, another's 0-1, 9; the larger kept" in problems
    assert any(p.startswith("group 2: only rank 2 recorded it") for p in problems)
    assert at(reply, "1", RANK1_LATE[0])["ranks"] == [0, 1]  # the rest still answers
    assert at(reply, "0", RANK1_LATE[0])["last_rank"] == 1


@pytest.mark.subprocess
def test_a_rank_clock_hours_off_is_said_and_set(gloo_traces, tmp_path, capsys):
    work = copy_ranks(gloo_traces, str(tmp_path / "hours"))
    hours_us = 3 * 3600 * 1e6
    rewrite(os.path.join(gloo_traces, "rank3.json"), os.path.join(work, "rank3.json"),
            lambda d: shifted(d, -hours_us))  # fmt: skip
    reply = summarise_json(capsys, work)
    rank3 = next(p for p in reply["ranks"] if p["rank"] == 3)
    assert rank3["clock_corrected"] and rank3["clock_offset_us"] == pytest.approx(
        -hours_us, abs=3_000
    )
    assert any(p.startswith("rank 3: its clock reads -10,800.0") for p in reply["problems"])
    assert_the_late_ranks(reply)


@pytest.mark.subprocess
def test_malformed_sizes_are_said_and_the_collectives_still_match(gloo_traces, tmp_path, capsys):
    work = copy_ranks(gloo_traces, str(tmp_path / "odd"))

    def garble(doc: dict[str, Any]) -> None:
        for e in doc["traceEvents"]:
            name = str(e.get("name", ""))
            if name.startswith(("gloo:all_gather", "c10d::allgather")):
                e["args"]["Input Dims"] = [["garbage"]]
            elif name.startswith(("gloo:broadcast", "c10d::broadcast")):
                del e["args"]["Input Dims"]  # (as with record_shapes off)

    rewrite(os.path.join(gloo_traces, "rank0.json"), os.path.join(work, "rank0.json"), garble)
    reply = summarise_json(capsys, work)
    said = [p for p in reply["problems"] if p.startswith("rank 0: ")]
    assert f"rank 0: {len(STEPS)} all_gather collective(s) with size arguments that are malformed" \
        " (In/Out msg nelems, dtype, Input Dims): counted as 0 bytes" in said  # fmt: skip
    assert any(p.startswith(f"rank 0: {len(STEPS)} broadcast collective(s) with no size in the")
               for p in said)  # fmt: skip
    gathers = [c for c in reply["collectives"] if c["name"] == "all_gather"]
    assert len(gathers) == len(STEPS) and all(c["bytes"] > 0 for c in gathers)  # others' size
    assert_the_late_ranks(reply)


@pytest.mark.subprocess
def test_gloo_threads_that_do_not_split_evenly_into_the_groups_are_said(
    gloo_traces, tmp_path, capsys
):
    work = copy_ranks(gloo_traces, str(tmp_path / "idle"))

    def idle_thread(doc: dict[str, Any]) -> None:
        tids = sorted(
            {e["tid"] for e in doc["traceEvents"] if e.get("name", "").startswith("gloo:")}
        )
        doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("tid") != tids[-1]]

    rewrite(os.path.join(gloo_traces, "rank0.json"), os.path.join(work, "rank0.json"),
            idle_thread)  # fmt: skip
    reply = summarise_json(capsys, work)
    assert any(p.startswith("rank 0: 3 gloo threads do not split evenly into the rank's 2 groups")
               for p in reply["problems"]), reply["problems"]  # fmt: skip
    assert at(reply, "2", RANK3_LATE)["last_rank"] == 3  # (the other pair: still matched)


def test_malformed_and_missing_nccl_args_are_said(tmp_path, capsys):
    src = os.path.join(TRACES, "one-rank-nccl", "nccl_rank0_of_2.json.gz")

    def garble(doc: dict[str, Any]) -> None:
        params = [e for e in doc["traceEvents"] if e.get("name") == "record_param_comms"]
        params[0]["args"].update({"In msg nelems": "garbage", "Out msg nelems": [1], "dtype": 7})
        del params[1]["args"]

    rewrite(src, str(tmp_path / "rank0.json.gz"), garble)
    reply = summarise_json(capsys, str(tmp_path))
    assert any("malformed" in p for p in reply["problems"]), reply["problems"]
    assert any(p.startswith("group 0: only rank 0 recorded it") for p in reply["problems"])
    assert any(p.startswith("group 0: ranks 1 of the group were not") for p in reply["problems"])


# ------------------------------------------------------------------ the live command, and its text


def test_collectives_reads_a_record_with_from(capsys):
    from coordinator.ops.cli import main as cli_main

    record = os.path.join(ROOT, "tests", "data", "record-v1")  # (summaries from before issue 56)
    assert cli_main(["collectives", "--from", record, "--json"]) == 0
    reply = json.loads(capsys.readouterr().out)
    assert (reply["run"], reply["window"], reply["steps"]) == ("golden-v1", 4, [11, 12])
    assert reply["ranks_without"] == [0, 1] and reply["collectives"] == []
    assert reply["problems"][0].startswith("no rank's summary of this window carried a collective")
    assert cli_main(["collectives", "--from", record]) == 0
    out = capsys.readouterr().out
    assert out.startswith("collectives of window 4 (steps 11-12) of run golden-v1; role policy")
    assert "problems (1):\n  no rank's summary of this window carried a collective" in out
    assert cli_main(["collectives", "--from", record, "--window", "99"]) == 1
    assert "no window 99" in capsys.readouterr().err
    assert cli_main(["collectives", "--from", record, "--shown", "-1"]) == 1


def test_the_text_of_1024_ranks_is_bounded_and_names_the_late_rank():
    from coordinator.core.collectives import match_window
    from coordinator.ops.collective_table import COLLECTIVE_ROWS, RANK_ROWS, render_collectives
    from coordinator.protocol.collective_replies import RankCollective

    per_rank = {r: [] for r in range(1024)}
    for k in range(40):  # 40 all_reduces, 4 a step; rank 700 late by 30 ms at each
        t = 1e12 + k * 1e5
        for r, calls in per_rank.items():
            a = t + (30e3 if r == 700 else r % 7)
            calls.append(RankCollective("0", None, "all_reduce", 1 << 20, "float", k // 4, a,
                                        t + 30e3 + 500 - a, t + 30e3 + 500))  # fmt: skip
    reply = {"run": "sim", "window": 2, "steps": list(range(10)), "ranks_recorded": 1024,
             **match_window(per_rank)}  # fmt: skip
    text = render_collectives(reply)
    lines = text.splitlines()
    assert len(lines) < RANK_ROWS + COLLECTIVE_ROWS + 20
    assert "1024 ranks recorded; 40 matched, 40 listed" in lines[0]
    assert any(ln.split()[:3] == ["700", "40", "40"] for ln in lines)  # rank, colls, last
    assert f"... {1024 - RANK_ROWS} more ranks left out" in text
    top = lines[lines.index(next(ln for ln in lines if ln.startswith("largest skews"))) + 2]
    assert top.split()[4:6] == ["0-1023", "700"] and float(top.split()[6]) == pytest.approx(
        30, 0.01
    )


# ------------------------------------------------------------------ the real NCCL traces

_KINDS = {
    "c10d::allreduce_": "all_reduce",
    "c10d::broadcast_": "broadcast",
    "c10d::alltoall_base_": "all_to_all",
    "c10d::_allgather_base_": "all_gather",
}
_ITEM = {
    "Float": 4,
    "float": 4,
    "Long": 8,
    "long": 8,
    "signed char": 1,
    "unsigned char": 1,
    "int": 4,
}


def plain_reading(path: str) -> list[tuple[Any, ...]]:
    """Each collective of a trace, read straight from its events: the outermost c10d op;
    ``record_param_comms`` under it (group, Seq, sizes); the NCCL kernel its launch started
    (by correlation): arrival = the kernel's start, work = its duration; else the size of the
    op's largest tensor (its own Input Dims: ``_allgather_base_``'s output), else of the
    ``nccl:`` annotation's input under it. Sorted by arrival."""
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    base = doc.get("baseTimeNanoseconds", 0) / 1e3
    ev = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    kernels = {
        e["args"]["correlation"]: e
        for e in ev
        if e.get("cat") == "kernel" and e["name"].lower().startswith("nccl")
    }
    steps = [
        (int(e["name"].split("#")[1]), e["ts"], e["ts"] + e["dur"])
        for e in ev
        if e["name"].startswith("ProfilerStep#")
    ]
    ops = sorted((e for e in ev if e["name"] in _KINDS), key=lambda e: e["ts"])
    out, last_end = [], dict[Any, float]()
    for op in ops:
        where, end = (op["pid"], op["tid"]), op["ts"] + op["dur"]
        if op["ts"] < last_end.get(where, -math.inf):
            continue  # (nested)
        last_end[where] = end

        def inside(e: dict[str, Any], op: dict[str, Any] = op, where: Any = where) -> bool:
            return (e["pid"], e["tid"]) == where and op["ts"] <= e["ts"] <= op["ts"] + op["dur"]

        params = next((e for e in ev if e["name"] == "record_param_comms" and inside(e)), None)
        args = params.get("args", {}) if params else {}
        launched = [
            kernels[e["args"]["correlation"]]
            for e in ev
            if e.get("cat") == "cuda_runtime"
            and inside(e)
            and e.get("args", {}).get("correlation") in kernels
        ]
        k0 = min(k["ts"] for k in launched)
        k1 = max(k["ts"] + k["dur"] for k in launched)
        own = [
            (math.prod(d), t)
            for d, t in zip(
                op["args"].get("Input Dims", []), op["args"].get("Input type", []), strict=True
            )
            if d and t in _ITEM
        ]
        if "In msg nelems" in args:
            n = max(args["In msg nelems"], args["Out msg nelems"]) * _ITEM[args["dtype"]]
        elif own:
            n = max(k * _ITEM[t] for k, t in own)
        else:
            note = next(e for e in ev if e["name"].startswith("nccl:") and inside(e))
            n = math.prod(note["args"]["Input Dims"][0]) * _ITEM[note["args"]["Input type"][0]]
        step = next((s for s, a, b in steps if a <= op["ts"] <= b), None)
        group = str(args.get("Process Group Name", "0"))
        out.append((group, args.get("Seq"), _KINDS[op["name"]], n, step, base + k0, k1 - k0))
    return sorted(out, key=lambda c: c[5])


@pytest.mark.parametrize(
    "path",
    [
        os.path.join(TRACES, "one-rank-nccl", "nccl_rank0_of_2.json.gz"),
        os.path.join(TRACES, "two-ranks", "sampled_rank-0.json.gz"),
        os.path.join(TRACES, "two-ranks", "sampled_rank-1.json.gz"),
    ],
)
def test_each_rank_collectives_agree_with_a_plain_reading_of_the_nccl_trace(path):
    from coordinator.ops.offline import summarise_traces

    done = summarise_traces([path])
    (block,) = done.blocks.values()
    assert block is not None and done.nodes == {}  # (these traces name no host_name)
    got = [(c.group, c.seq, c.name, c.nbytes, c.step, c.arrive_us, c.work_us) for c in block.calls]
    want = plain_reading(path)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        assert g[:5] == w[:5]
        assert g[5] == pytest.approx(w[5], abs=1.0) and g[6] == pytest.approx(w[6], abs=0.01)


def test_the_two_rank_folder_names_its_disagreement_and_matches_the_rest(capsys):
    reply = summarise_json(capsys, os.path.join(TRACES, "two-ranks"))
    assert reply["steps"] == [551, 552] and reply["ranks_recorded"] == 2
    assert reply["problems"] == [  # (two ranks of a 128-rank job, sampled)
        "group 0: ranks 2-127 of the group were not recorded in this window; matched among the "
        "ranks that were",
        "group 0: the ranks disagree on the kind of 2 collective(s) (step 552 #1, step 552 #2): "
        "their orders differ; those are not matched",
    ]
    assert reply["matched"] == 8 and len(reply["collectives"]) == 8  # the view is kept
    for c in reply["collectives"]:
        assert c["ranks"] == [0, 1] and c["transfer_us"] > 0 and c["bytes"] > 0
        assert c["skew_us"] == pytest.approx(max(c["wait_us"].values()))
        assert min(c["wait_us"].values()) == 0.0
        assert c["busbw_gbps"] is not None and c["busbw_gbps"] > 0


def test_the_config_s_cap_reaches_the_agent_s_summary_whole_steps_kept_the_rest_folded(tmp_path):
    """A trace job carries the config's ``collectives_cap`` to the reader: the real NCCL
    trace's 21 collectives (7 a step) with a cap of 10 keep step 4's seven, fold the rest."""
    from coordinator.protocol.summary_codec import decode_summary
    from worker_ext.agent.trace_jobs import TraceJob, summarise_job

    src = os.path.join(TRACES, "one-rank-nccl", "nccl_rank0_of_2.json.gz")
    path = str(tmp_path / "rank0.json.gz")
    shutil.copy(src, path)
    job = TraceJob(0, 0, (4, 6), False, "cuda", 20, False, "none", path, None, collectives_cap=10)
    res, blob, _ = summarise_job(job)
    assert blob is not None, res.errors
    block = decode_summary(blob).collectives
    assert block is not None and [c.step for c in block.calls] == [4] * 7, block.calls
    assert block.cut == 14 and sum(f.count for f in block.folded) == 14
    assert "past the cap of 10" in " ".join(block.notes)


if __name__ == "__main__":
    _job(sys.argv[1], int(sys.argv[2]))
