"""The run's record in save_path: its codec (strict, versioned), its writes (retried, reported),
and a real run's record read back with ``--from``: the live coordinator's tables, byte for byte."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import msgspec
import pytest

from coordinator.core import record_codec as codec
from coordinator.core.aggregate import WindowAggregate
from coordinator.core.device_views import DeviceFigures
from coordinator.core.partial import fold_summaries
from coordinator.core.records import WindowRecord
from coordinator.core.row_table import RowTable
from coordinator.core.saved import AggregateFile, DeviceFile, RowTableFile
from coordinator.core.schedule import Window
from coordinator.ops import offline
from coordinator.protocol.partial_codec import decode_partial, encode_partial
from coordinator.protocol.summary_codec import decode_summary, encode_summary
from coordinator.service.record_store import RecordStore
from coordinator.service.record_writes import RecordWrites
from worker_ext.agent.trace_reader import read_trace
from worker_ext.agent.trace_summary import summarise

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = os.path.join(ROOT, "tests", "data", "gpu-traces", "two-ranks")  # (in the repository)


def gpu_window() -> WindowRecord:
    """A settled window of the two real GPU ranks: rank 0 by its own summary, rank 1 in a
    node partial (the two ways a rank's figures arrive)."""
    sums = []
    for r in (0, 1):
        d = read_trace(os.path.join(GPU, f"sampled_rank-{r}.json.gz"))
        steps = offline._steps(d, None, "trace", [])
        s, _ = summarise(d, rank=r, window=4, steps=steps, partial=False, device="cuda", top_k=50)
        sums.append(decode_summary(encode_summary(s)))
    agg = WindowAggregate(4)
    agg.add(sums[0])
    agg.add_partial(decode_partial(encode_partial(fold_summaries("node", [sums[1]]))))
    keys = {("policy", 0), ("policy", 1)}
    rec = WindowRecord(window=Window(4, 10, 11, 12), participants=keys, acked=set(keys))
    rec.steps, rec.closed, rec.primary, rec.roles = (11, 12), True, "policy", {"policy": "policy"}
    rec.aggregates["policy"] = agg
    trace = {"path": "/x/rank0.json.gz", "local_path": None, "node": "n1", "error": None}
    rec.traces = {("policy", 0): trace}
    rec.trigger = None
    return rec


@pytest.fixture(scope="module")
def window() -> WindowRecord:
    return gpu_window()


def test_a_gpu_window_comes_back_with_the_same_tables_and_entry(window):
    back = codec.window_record(codec.decode(codec.encode(codec.window_file("r", window))))
    for by in ("kernel", "op"):
        for per_rank in (False, True):
            want = window.aggregates["policy"].to_dict(30, 1.25, per_rank, by)
            got = back.aggregates["policy"].to_dict(30, 1.25, per_rank, by)
            assert json.dumps(got) == json.dumps(want)
    assert want["device"] == "cuda" and want["ops"]  # (the op table is there to compare)
    assert json.dumps(back.to_dict()) == json.dumps(window.to_dict())


def test_every_field_of_the_objects_recorded_is_in_its_file_type():
    """A field added to a window, an aggregate or a table without its place in the record
    would be lost after the cluster: this fails until the record's types name it."""
    rec = WindowRecord(window=Window(0, 0, 0, 0))
    assert set(vars(rec)) == set(codec.WindowFile.__struct_fields__) - {"version", "run"}
    # (an aggregate's private attributes are saved under declared names: ``_kernels`` is
    # ``AggregateFile.kernels``; ``_stragglers`` and ``_arriver`` are caches, ``_folding`` saved
    # as ``torn``)
    names = {a.lstrip("_") for a in vars(WindowAggregate(0))} - {"stragglers", "folding", "arriver"}
    assert names == set(AggregateFile.__struct_fields__)
    assert set(vars(DeviceFigures())) == set(DeviceFile.__struct_fields__)
    assert set(vars(RowTable(1))) - {"ids"} == set(RowTableFile.__struct_fields__)


@pytest.mark.parametrize(
    "blob, said",
    [
        (b"\x00not msgpack", "not a record file"),
        (msgspec.msgpack.encode({"kind": "window", "version": 2}), "record version 2"),
        (msgspec.msgpack.encode({"kind": "tables", "version": 1}), "malformed 'tables'"),
        (msgspec.msgpack.encode({"kind": "marks", "version": 1, "run": "r"}), "malformed"),
        (
            msgspec.msgpack.encode(
                {
                    "kind": "marks",
                    "version": 1,
                    "run": "r",
                    "window": "3",
                    "marks": {},
                    "counted_slower": False,
                }
            ),  # fmt: skip
            "Expected `int`",
        ),
    ],
)
def test_a_bad_file_is_refused_naming_it_and_what_is_wrong(blob, said):
    with pytest.raises(codec.RecordError, match=said) as got:
        codec.decode(blob, "rec/marks/000003.msgpack")
    assert "rec/marks/000003.msgpack" in str(got.value)


def test_an_oversized_file_is_refused_before_it_is_decoded(monkeypatch):
    monkeypatch.setattr(codec, "MAX_FILE_BYTES", 100)
    with pytest.raises(codec.RecordError, match="over the 100"):
        codec.decode(b"\x90" * 101, "big")


def test_a_failed_write_is_retried_reported_and_the_last_version_written(tmp_path, monkeypatch):
    store = RecordStore(str(tmp_path / "rec"))
    real_put, fails = RecordStore.put, [2]

    def flaky(self, rel, blob):  # storage down for two tries
        if fails[0] > 0:
            fails[0] -= 1
            raise OSError("storage is down")
        real_put(self, rel, blob)

    monkeypatch.setattr(RecordStore, "put", flaky)
    monkeypatch.setattr("coordinator.service.record_writes.RETRY_MAX_S", 0.05)
    writes = RecordWrites()
    writes.queue(store, "run.msgpack", lambda: b"one")
    for _ in range(500):  # (the writer's thread tries at once)
        if writes.stats()["failures"]:
            break
        time.sleep(0.01)
    stats = writes.stats()
    assert stats["failures"] >= 1 and "storage is down" in stats["error"]
    writes.queue(store, "run.msgpack", lambda: b"two")  # queued again meanwhile: written once
    assert writes.flush(10.0)
    assert (tmp_path / "rec" / "run.msgpack").read_bytes() == b"two"
    stats = writes.stats()
    assert stats["error"] is None and stats["pending"] == 0 and stats["failures"] == 2
    assert not [p for p in os.listdir(tmp_path / "rec") if p.startswith(".part-")]


def test_an_unwritable_record_dir_is_reported_and_nothing_is_lost_from_the_queue(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the record's directory should be")
    writes = RecordWrites()
    writes.queue(RecordStore(str(blocked / "rec")), "run.msgpack", lambda: b"x")
    assert not writes.flush(0.5)
    stats = writes.stats()
    assert stats["pending"] == 1 and "blocked" in stats["error"] and stats["retry_in_s"] >= 0


# ------------------------------------------------------------------ real runs


def cli_json(*argv: str) -> str:
    """``ray-profiler ... --json``'s output, run in this process."""
    from coordinator.ops.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*argv, "--json"])
    assert code == 0, out.getvalue()
    return out.getvalue()


def cli_no_cluster(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``ray-profiler ...`` in a process of its own whose Ray address leads nowhere."""
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1", "PYTHONPATH": ROOT, **env}
    return subprocess.run(
        [sys.executable, "-m", "coordinator", *argv], capture_output=True, text=True, env=env,
        timeout=120, check=False,
    )  # fmt: skip


READS = [
    ("top", "--window", "1", "--k", "15"),
    ("top", "--window", "0", "--by", "op"),
    ("stragglers", "--window", "1"),
    ("diff", "0", "1", "--k", "10"),
    ("phases", "--last", "50"),
    ("windows",),
]


class Job:
    """A real run of the reference toy workers with two scheduled windows (steps 3-4 and 8-9),
    its record written to ``save``; ``work`` the train step's work from step 5 on."""

    def __init__(self, ray, workers, save, run: str, work: int) -> None:
        from trainers.hooks import ProfilingHooks

        cfg = {"enable": True, "save_path": str(save), "ranks": "all", "wait": 2, "warmup": 1,
               "active": 2, "repeat": 2, "export_type": "none", "run_name": run}  # fmt: skip
        self.name, self.run = f"profiler-{uuid.uuid4().hex[:8]}", run
        self.record = str(save / run / "record")
        hooks = ProfilingHooks.attach(cfg, workers, trainer_id="sft", name=self.name,
                                      namespace="profiler-tests")  # fmt: skip
        self.coord = hooks.coordinator
        with hooks.session(first_step=0):
            for k in range(12):
                with hooks.region("train"):
                    ray.get([w.train_step.remote(work if k >= 5 else 1) for w in workers])
                hooks.step(k)
        for i in (0, 1):
            assert ray.get(self.coord.wait_window.remote(i, timeout_s=60))["done"]
        self.flushed = ray.get(self.coord.flush_record.remote(30.0))
        self.live = {argv: self.cli(*argv) for argv in READS}
        self.status = ray.get(self.coord.status.remote())
        self.tables = [
            ray.get(self.coord.kernel_summary.remote(i, 100_000, None, False, run)) for i in (0, 1)
        ]

    def cli(self, *argv: str) -> str:
        return cli_json(*argv, "--name", self.name, "--namespace", "profiler-tests")


@pytest.fixture(scope="module")
def jobs(ray_session, worker_pool, tmp_path_factory):
    """Last week's job and this week's (its second window 4x the work), in one save_path;
    this week's coordinator still up, last week's gone."""
    workers = worker_pool.take(2)
    save = tmp_path_factory.mktemp("records")
    made = []
    try:
        made.append(Job(ray_session, workers, save, "job-0405", work=1))
        ray_session.kill(made[0].coord)
        made.append(Job(ray_session, workers, save, "job-0412", work=4))
        yield save, made[0], made[1]
    finally:
        for job in made:
            with contextlib.suppress(Exception):
                ray_session.kill(job.coord)
        worker_pool.give_back(workers)


def test_a_finished_run_s_record_gives_the_live_tables_with_no_cluster(jobs):
    _, job, _ = jobs
    entry = job.flushed
    assert entry["pending"] == 0 and entry["windows"] == 2 and entry["error"] is None
    assert entry["dir"] == job.record and entry["files"] >= 4
    assert sorted(os.listdir(job.record)) == ["memory.msgpack", "phases", "run.msgpack", "windows"]
    for argv in READS:  # its coordinator is gone; no cluster is reachable from this process
        got = cli_no_cluster(*argv, "--from", job.record, "--json")
        assert got.returncode == 0, got.stderr
        assert got.stdout == job.live[argv], argv
    st = json.loads(cli_json("status", "--from", os.path.dirname(job.record)))  # the run's dir
    assert st["windows"] == json.loads(json.dumps(job.status["windows"]))
    assert st["run"] == job.status["run"] and st["run"]["lifecycle"] == "stopped"
    assert st["record"]["dir"] == job.record and st["record"]["error"] is None
    assert st["record"]["steps"] == 12 and st["counters"] == {
        k: v for k, v in json.loads(json.dumps(job.status["counters"])).items()
    }
    text = cli_no_cluster("top", "--from", job.run, RAY_PROFILER_SAVE_PATH=str(jobs[0]))
    assert text.returncode == 0 and "aten::addmm" in text.stdout  # a run by its name
    text = cli_no_cluster("status", "--from", job.record)  # the tables for people too
    assert text.returncode == 0 and "run job-0405 (stopped)" in text.stdout, text.stderr
    text = cli_no_cluster("windows", "--from", job.record)
    lines = text.stdout.splitlines()
    assert lines[0].split()[:3] == ["window", "kind", "steps"] and len(lines) == 3


def test_a_record_refuses_what_needs_a_live_coordinator_and_names_what_is_missing(jobs, tmp_path):
    _, job, _ = jobs
    for argv in (("capture", "--active", "1"), ("auto", "on"), ("ranks",), ("cancel", "3")):
        got = cli_no_cluster(*argv, "--from", job.record)
        assert got.returncode == 1 and "needs a live coordinator" in got.stderr, got.stderr
    got = cli_no_cluster("top", "--from", str(tmp_path / "nothing"))
    assert got.returncode == 1 and "no run record at" in got.stderr
    got = cli_no_cluster("top", "--from", "job-0000")  # a name, with no save_path to look in
    assert got.returncode == 1 and "RAY_PROFILER_SAVE_PATH" in got.stderr
    got = cli_no_cluster("top", "--window", "7", "--from", job.record)
    assert got.returncode == 1 and "no window 7" in got.stderr
    broken = tmp_path / "broken"
    shutil.copytree(job.record, broken)
    bad = broken / "windows" / "000001.msgpack"
    raw = msgspec.msgpack.decode(bad.read_bytes())
    bad.write_bytes(msgspec.msgpack.encode({**raw, "steps": "8-9"}))  # a field of another type
    st = json.loads(cli_json("status", "--from", str(broken)))
    assert [w["index"] for w in st["windows"]] == [0]  # what can be read is shown
    assert "000001.msgpack: malformed 'window' file" in st["record"]["error"]
    assert "$.steps" in st["record"]["error"]


def test_windows_are_diffed_across_jobs_from_the_cli_the_notebook_and_the_web(jobs):
    from coordinator.core.window_diff import kernel_diff
    from coordinator.ops import notebook as nb
    from coordinator.ops.web.server import CoordinatorLink
    from tests.test_web import ServerThread

    save, last_week, this_week = jobs
    want = kernel_diff(last_week.tables[1], this_week.tables[1], 10)
    calls = [
        {k["name"]: k["count"] for k in t.tables[1]["kernels"]} for t in (last_week, this_week)
    ]
    assert (
        calls[1]["aten::addmm"] == 4 * calls[0]["aten::addmm"]
    )  # 4x the train steps (not the time: a busy host)
    same = json.dumps(want) + "\n"
    # both sides recorded, no cluster: a record's path, and a run's name under save_path
    got = cli_no_cluster("diff", f"{last_week.record}:1", "job-0412:1", "--k", "10", "--json",
                         RAY_PROFILER_SAVE_PATH=str(save))  # fmt: skip
    assert got.returncode == 0, got.stderr
    assert got.stdout == same
    # one side live: this week's coordinator, which keeps job-0412 and finds job-0405 by name
    assert this_week.cli("diff", "job-0405:1", "1", "--k", "10") == same
    frame = nb.diff_frame("job-0405:1", f"{this_week.record}:1", top_k=10, save_path=str(save))
    assert frame["name"].tolist() == [k["name"] for k in want["kernels"]]
    web = ServerThread(CoordinatorLink(this_week.name, "profiler-tests", this_week.coord))
    try:
        status, body = web.http("GET", "/api/diff?a=job-0405:1&b=1&top_k=10")
        assert status == 200 and body == json.loads(same)
        status, body = web.http("GET", "/api/diff?a=job-0000:1&b=1")
        assert status == 404 and "no run 'job-0000' kept or recorded" in body["error"]
        status, body = web.http("GET", "/api/diff?a=../etc:1&b=1")
        assert status == 400
    finally:
        web.close()


def test_sums_past_64_bits_come_back_exactly(window):
    """A sum of squares of nanoseconds over a thousand ranks passes msgpack's 64 bits."""
    agg = window.aggregates["policy"]
    snap = agg.snapshot()
    snap._kernels.sumsq[0] = 2**70 + 3
    snap._kernels.total[1] = -(2**65)
    rec = copy.copy(window)
    rec.aggregates = {"policy": snap}
    blob = codec.encode(codec.window_file("r", rec))
    back = codec.window_record(codec.decode(blob)).aggregates["policy"]
    assert back._kernels.sumsq[0] == 2**70 + 3 and back._kernels.total[1] == -(2**65)
    assert back._kernels.sumsq[2:] == snap._kernels.sumsq[2:]


def test_a_record_that_cannot_be_written_is_reported_and_the_run_goes_on(
    ray_session, toy_workers, tmp_path
):
    from trainers.hooks import ProfilingHooks

    workers = toy_workers(2)
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "record").write_text("a file where the record's directory goes")
    cfg = {"enable": True, "save_path": str(tmp_path), "ranks": "all", "wait": 2, "warmup": 1,
           "active": 2, "repeat": 1, "export_type": "none", "run_name": "blocked"}  # fmt: skip
    hooks = ProfilingHooks.attach(cfg, workers, trainer_id="sft",
                                  name=f"profiler-{uuid.uuid4().hex[:8]}",
                                  namespace="profiler-tests")  # fmt: skip
    coord = hooks.coordinator
    try:
        with hooks.session(first_step=0):
            for k in range(8):
                ray_session.get([w.train_step.remote() for w in workers])
                hooks.step(k)
        assert ray_session.get(coord.wait_window.remote(0, timeout_s=60))["done"]
        entry = ray_session.get(coord.flush_record.remote(2.0))
        st = ray_session.get(coord.status.remote())
    finally:
        ray_session.kill(coord)
    assert entry["pending"] >= 1 and entry["failures"] >= 1, entry
    # (each failing file retries on its own back-off, so which one's error is the latest can
    # change between the two calls: both name a file of the blocked record)
    assert "blocked/record" in entry["error"] and "blocked/record" in st["record"]["error"]
    assert st["windows"][0]["steps"] == [3, 4] and st["windows"][0]["ranks"] == [0, 1]
    assert st["global_step"] == 7 and st["run"]["lifecycle"] == "stopped"


def test_a_restarted_coordinator_s_first_reports_go_on_after_the_recorded_steps(jobs):
    """Steps reported to a restarted coordinator before its recorder's first look are kept
    after the record's steps, in its phase log and in the record's next write."""
    from coordinator.service.phase_store import PhaseStore
    from coordinator.service.record_reader import open_record
    from coordinator.service.run_recorder import _go_on, _RunRecord

    _, job, _ = jobs
    rec = open_record(job.record)
    recorded = [s for s, _, _ in rec.phases.exact]
    assert recorded == list(range(12))
    refused: list[str] = []
    phases = PhaseStore(lambda what, why: refused.append(why) or why, lambda _n: None)
    phases.keep(job.run, [], [[11, 0.1, {"train": 0.05}], [12, 0.2, {"train": 0.1}]])
    phases.keep(job.run, [], [[13, 0.3, {"train": 0.2}]])
    rr = _RunRecord(RecordStore(job.record))
    _go_on(rr, rec, phases, job.run)
    log_ = phases.log(job.run)
    assert [s for s, _, _ in log_.exact] == list(range(14)) and not refused
    assert log_.steps_seen - rr.steps_seen == 2  # steps 12 and 13: written at this look
    assert rr.windows == {0, 1} and rr.steps == 12
