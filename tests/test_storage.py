"""Traces where users can reach them: a URL save_path (a real S3 server on loopback) and collect."""

import gzip
import json
import os
import shutil
import subprocess
import sys
import time
import tracemalloc
import uuid

import pytest

from coordinator import attach_coordinator
from coordinator.core.config import ProfilerConfig
from coordinator.core.storage import REDACTED, redact
from coordinator.ops.collect import collect_window
from tests.configs import ROOT, profiler_config
from tests.s3_server import s3_server

FAKE_SECRET = "FAKE-SECRET-must-never-be-printed-7e1f"


# ---------------------------------------------------------------- config, no cluster


def test_a_url_save_path_is_checked_for_its_backend_not_for_reachability():
    cfg = ProfilerConfig(
        enable=True,
        save_path="s3://bucket/runs",
        storage_options={"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}},
    ).validate()
    assert cfg.remote and cfg.save_path == "s3://bucket/runs"  # nothing listens there: fine
    with pytest.raises(ValueError, match=r"'save_path' 'gs://b/p' needs .*pip install gcsfs"):
        ProfilerConfig(enable=True, save_path="gs://b/p").validate()
    with pytest.raises(ValueError, match="protocol 'nope', which fsspec does not know"):
        ProfilerConfig(enable=True, save_path="nope://b/p").validate()
    with pytest.raises(ValueError, match="'storage_options' must be a mapping"):
        ProfilerConfig.from_dict({"enable": True, "save_path": "s3://b", "storage_options": None})
    with pytest.raises(ValueError, match="'staging_path' must be a local directory"):
        ProfilerConfig(enable=True, save_path="s3://b", staging_path="s3://other").validate()


def test_file_urls_are_local_paths(tmp_path):
    cfg = ProfilerConfig(enable=True, save_path=f"file://{tmp_path}").validate()
    assert cfg.save_path == str(tmp_path) and not cfg.remote


def test_credentials_are_redacted_wherever_the_config_is_shown():
    opts = {
        "key": "AKIA-something",
        "secret": FAKE_SECRET,
        "token": "t",
        "anon": False,
        "client_kwargs": {"endpoint_url": "http://h:1", "aws_secret_access_key": FAKE_SECRET},
    }
    shown = ProfilerConfig(enable=True, save_path="s3://b", storage_options=opts).public_dict()
    assert FAKE_SECRET not in json.dumps(shown) and "AKIA" not in json.dumps(shown)
    assert shown["storage_options"]["client_kwargs"]["endpoint_url"] == "http://h:1"
    assert shown["storage_options"]["anon"] is False
    assert redact(opts)["secret"] == REDACTED


# ---------------------------------------------------------------- a real S3 server


@pytest.fixture
def s3():
    with s3_server() as server:
        server.make_bucket("traces")
        yield server


def train(ray, coord, workers, steps, tid="t"):
    ray.get(coord.start.remote(tid, 0))
    for k in range(steps):
        ray.get([w.train_step.remote() for w in workers])
        ray.get(coord.step.remote(tid, k))
    ray.get(coord.stop.remote(tid))


def wait_for_traces(ray, coord, timeout=90):
    deadline = time.monotonic() + timeout
    while True:
        st = ray.get(coord.status.remote())
        if not any(w["traces_pending"] for w in st["windows"]):
            return st
        assert time.monotonic() < deadline, [w["traces_pending"] for w in st["windows"]]
        time.sleep(0.2)


def s3_run(ray, ray_actors, toy_workers, s3, tmp_path, **kw):
    cfg = profiler_config(
        "s3://traces/runs",
        export_type="chrome_trace_gz",
        wait=1,
        warmup=1,
        active=2,
        repeat=2,
        staging_path=str(tmp_path / "staging"),
        storage_options=s3.storage_options(secret=FAKE_SECRET),
        **kw,
    )
    coord, _ = attach_coordinator(
        cfg, name=f"s3-{uuid.uuid4().hex[:8]}", namespace="profiler-tests", trainer_id="t"
    )
    workers = toy_workers(2)
    ray_actors.append(coord)
    ray.get(coord.register.remote("t", workers))
    return coord, workers


def test_every_window_of_every_rank_lands_in_the_bucket_and_staging_is_emptied(
    ray_session, ray_actors, toy_workers, s3, tmp_path
):
    ray = ray_session
    coord, workers = s3_run(ray, ray_actors, toy_workers, s3, tmp_path)
    train(ray, coord, workers, steps=9)
    st = wait_for_traces(ray, coord)
    assert ray.get(coord.flush_record.remote(30.0))["pending"] == 0
    dirs = ["window_0000_steps_2-3", "window_0001_steps_6-7"]
    found = sorted(s3.fs().find("traces/runs/run"))
    files = [f for f in found if not f.startswith("traces/runs/run/record/")]
    assert "traces/runs/run/record/run.msgpack" in found  # the run's record, in the bucket too
    assert files == [
        f"traces/runs/run/{d}/policy/rank{r}.pt.trace.json.gz" for d in dirs for r in (0, 1)
    ]
    with s3.fs().open(files[0], "rb") as f:
        trace = json.loads(gzip.decompress(f.read()))
    assert trace["rank"] == 0 and any(
        e.get("name", "").startswith("ProfilerStep#2") for e in trace["traceEvents"]
    )
    assert [w["trace_dir"] for w in st["windows"]] == [
        f"s3://traces/runs/run/{d}/policy" for d in dirs
    ]
    for w in st["windows"]:
        assert w["trace_errors"] == {} and w["traces_pending"] == []
        assert {r: t["path"] for r, t in w["traces"].items()} == {
            r: f"{w['trace_dir']}/rank{r}.pt.trace.json.gz" for r in (0, 1)
        }
        assert all(t["local_path"] is None for t in w["traces"].values())
    staged = [p for p in (tmp_path / "staging").rglob("*") if p.is_file()]
    assert staged == []  # uploaded, then removed
    text = json.dumps(st)
    assert FAKE_SECRET not in text and st["config"]["storage_options"]["secret"] == REDACTED


def test_a_stopped_server_costs_nothing_but_the_upload_and_collect_still_gets_the_traces(
    ray_session, ray_actors, toy_workers, s3, tmp_path, monkeypatch
):
    ray = ray_session
    coord, workers = s3_run(ray, ray_actors, toy_workers, s3, tmp_path)
    ray.get(coord.start.remote("t", 0))
    for k in range(9):
        if k == 4:  # window 0 (steps 2-3) is closed; wait for its upload, then stop the server
            wait_for_traces(ray, coord)
            s3.stop()
        ray.get([w.train_step.remote() for w in workers])
        assert ray.get(coord.step.remote("t", k))["applied"]  # training never notices
    ray.get(coord.stop.remote("t"))
    st = wait_for_traces(ray, coord, timeout=120)
    assert st["global_step"] == 8 and {r["state"] for r in st["ranks"]} == {"ok"}
    ok, failed = st["windows"]
    assert ok["trace_errors"] == {}
    assert sorted(failed["trace_errors"]) == [0, 1]
    for r, err in failed["trace_errors"].items():
        assert err["where"] == "upload" and "failed 4 times" in err["message"]
        local = failed["traces"][r]["local_path"]
        assert local and os.path.exists(local) and local in err["message"]
    # The local copies are still there for whoever wants them: collect fetches them.
    dest = tmp_path / "collected"
    res = collect_window(coord, failed["index"], str(dest))
    assert res["missing"] == {} and sorted(res["files"]) == [0, 1]
    assert sorted(os.listdir(dest)) == ["rank0.pt.trace.json.gz", "rank1.pt.trace.json.gz"]
    for r in (0, 1):
        trace = json.loads(gzip.decompress((dest / f"rank{r}.pt.trace.json.gz").read_bytes()))
        assert trace["rank"] == r
    assert FAKE_SECRET not in json.dumps(st)


def test_collect_downloads_a_window_already_in_the_bucket_and_the_cli_shows_no_secret(
    ray_session, ray_actors, toy_workers, s3, tmp_path, monkeypatch
):
    ray = ray_session
    coord, workers = s3_run(ray, ray_actors, toy_workers, s3, tmp_path)
    train(ray, coord, workers, steps=5)
    wait_for_traces(ray, coord)
    # The collector's own credentials (the run's are redacted): the usual environment variables.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret")
    res = collect_window(coord, 0, str(tmp_path / "w0"))
    assert res["missing"] == {} and res["bytes"] > 0
    assert sorted(os.listdir(tmp_path / "w0")) == [
        "rank0.pt.trace.json.gz",
        "rank1.pt.trace.json.gz",
    ]
    name = ray.get(coord.status.remote())["name"]
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
    }
    cli = [sys.executable, "-m", "coordinator", "--name", name, "--namespace", "profiler-tests"]
    outputs = []
    for args in (
        ["status"],
        ["--json", "status"],
        ["collect", "--window", "0", "--to", str(tmp_path / "cli")],
        ["collect", "--window", "0", "--merge", str(tmp_path / "w0.json.gz")],
        [
            "collect",
            "--window",
            "0",
            "--merge",
            str(tmp_path / "r1.json"),
            "--ranks",
            "1",
            "--min-us",
            "5",
        ],
    ):
        proc = subprocess.run(
            cli + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        outputs.append(proc.stdout + proc.stderr)
    assert "rank 1:" in outputs[2] and os.path.exists(tmp_path / "cli" / "rank1.pt.trace.json.gz")
    # --merge: both ranks in one trace, read from the bucket, every event, on one clock
    assert "2 ranks" in outputs[3] and "rank 1 · policy · " in outputs[3]
    merged = json.loads(gzip.decompress((tmp_path / "w0.json.gz").read_bytes()))
    names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"]
             if e["name"] == "process_name"}  # fmt: skip
    assert sorted(names) == [1, 2] and names[2].startswith("rank 1 · policy · ")
    base = merged["baseTimeNanoseconds"] / 1000
    for pid, r in ((1, 0), (2, 1)):
        original = json.loads(gzip.decompress((tmp_path / "w0" / f"rank{r}.pt.trace.json.gz")
                                              .read_bytes()))  # fmt: skip
        step = next(e for e in original["traceEvents"] if e.get("name") == "ProfilerStep#2")
        mine = next(e for e in merged["traceEvents"]
                    if e["pid"] == pid and e["name"] == "ProfilerStep#2")  # fmt: skip
        assert abs(mine["ts"] + base - step["ts"] - original["baseTimeNanoseconds"] / 1000) < 0.01
    counts = merged["rayProfiler"]["ranks"]
    assert [(c["rank"], c["below_min_us"], c["over_max_events"]) for c in counts] == [
        (0, 0, 0), (1, 0, 0)]  # fmt: skip
    assert all(c["kept"] == c["events"] > 0 for c in counts)
    only = json.loads((tmp_path / "r1.json").read_text())["rayProfiler"]
    assert [c["rank"] for c in only["ranks"]] == [1] and only["min_us"] == 5
    assert only["ranks"][0]["below_min_us"] > 0
    bad = subprocess.run(
        cli + ["collect", "--window", "0", "--merge", str(tmp_path / "x.json"), "--ranks", "7"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 1 and "has no rank 7" in bad.stderr, bad.stderr[-2000:]
    # --to may be a URL as well
    to_bucket = collect_window(
        coord, 0, "s3://traces/collected/w0", storage_options=s3.storage_options()
    )
    assert to_bucket["missing"] == {} and sorted(s3.fs().ls("traces/collected/w0")) == [
        f"traces/collected/w0/rank{r}.pt.trace.json.gz" for r in (0, 1)
    ]
    # The run's record in the bucket serves the same traces and timeline, with no coordinator
    # (issue 47): the traces read from the bucket, the credentials from the environment.
    from coordinator.ops.recorded import RecordedCoordinator, open_record
    from coordinator.ops.timeline import merge_window

    record = ray.get(coord.flush_record.remote(30.0))["dir"]
    h = RecordedCoordinator(open_record(record, s3.storage_options()))
    again = collect_window(h, 0, str(tmp_path / "from-record"))
    assert again["missing"] == {} and again["bytes"] == res["bytes"]
    for r in (0, 1):
        name = f"rank{r}.pt.trace.json.gz"
        assert (tmp_path / "from-record" / name).read_bytes() == (
            tmp_path / "w0" / name
        ).read_bytes()
    merge_window(h, 0, str(tmp_path / "w0-record.json.gz"))
    assert json.loads(gzip.decompress((tmp_path / "w0-record.json.gz").read_bytes())) == merged
    for text in outputs:
        assert FAKE_SECRET not in text
    # ...nor in any log this Ray session wrote (driver, coordinator, ranks, node agent).
    logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
    for root, _, names in os.walk(logs):
        for n in names:
            with open(os.path.join(root, n), "rb") as f:
                assert FAKE_SECRET.encode() not in f.read(), n


def test_collecting_a_large_trace_streams_it_in_chunks(ray_session, tmp_path):
    """A 96 MB trace on a node comes over through its agent 4 MB at a time: the collector holds
    a chunk or two, never the file (each chunk travels through Ray's object store, freed once
    it is written)."""
    from coordinator.ops.collect import CHUNK_BYTES, _collect_one
    from worker_ext.rank.agent_link import NodeAgentLink

    ray = ray_session
    NodeAgentLink().prepare()  # this node's agent is up
    wdir = tmp_path / "window_0000_steps_1-2"
    wdir.mkdir()
    src = wdir / "rank0.pt.trace.json"
    with open(src, "wb") as f:
        for _ in range(96):
            f.write(os.urandom(1 << 20))

    node = ray.get_runtime_context().get_node_id()
    trace = {"path": str(src), "local_path": str(src), "node": node, "error": None}
    tracemalloc.start()
    try:
        target, written = _collect_one(trace, str(tmp_path / "out"), {})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert written == 96 << 20 and os.path.getsize(target) == 96 << 20
    with open(src, "rb") as a, open(target, "rb") as b:
        assert a.read() == b.read()
    assert peak < 3 * CHUNK_BYTES  # a chunk or two in memory at a time, never the file


def test_a_node_agent_merges_its_ranks_into_a_piece_and_refuses_what_is_not_a_trace(
    ray_session, tmp_path
):
    """The node agent's piece of a merged timeline (``merge_traces``): real GPU traces placed
    in a window directory of this node, read back a chunk at a time, then dropped; a path
    outside the trace layout and an unknown piece are refused, and a rank whose file is not a
    trace is named while the others are merged."""
    from coordinator.protocol.names import AGENT_NAMESPACE, agent_name
    from worker_ext.rank.agent_link import NodeAgentLink

    ray = ray_session
    NodeAgentLink().prepare()
    agent = ray.get_actor(agent_name(ray.get_runtime_context().get_node_id()),
                          namespace=AGENT_NAMESPACE)  # fmt: skip
    wdir = tmp_path / "window_0003_steps_551-552" / "policy"
    wdir.mkdir(parents=True)
    traces = os.path.join(ROOT, "tests", "data", "gpu-traces", "two-ranks")
    for r in (0, 1):
        shutil.copy(os.path.join(traces, f"sampled_rank-{r}.json.gz"),
                    wdir / f"rank{r}.pt.trace.json.gz")  # fmt: skip
    (wdir / "rank2.pt.trace.json").write_text("{not json")
    ranks = [
        {"label": {"rank": r, "role": "policy", "node": "n"}, "pid": r + 1,
         "path": str(wdir / (f"rank{r}.pt.trace.json.gz" if r < 2 else "rank2.pt.trace.json"))}
        for r in (0, 1, 2)
    ]  # fmt: skip
    piece = ray.get(agent.merge_traces.remote(ranks, 0.0, 100_000))
    assert [c["rank"] for c in piece["ranks"]] == [0, 1] and list(piece["failed"]) == [3]
    assert "not JSON" in piece["failed"][3]
    got, offset = b"", 0
    while chunk := ray.get(agent.read_piece_chunk.remote(piece["piece"], offset, 50_000)):
        got, offset = got + chunk, offset + len(chunk)
    merged = json.loads(gzip.decompress(got))
    assert len(got) == piece["bytes"] and len(merged["traceEvents"]) == piece["events"]
    assert {e["pid"] for e in merged["traceEvents"]} == {1, 2}
    assert ray.get(agent.drop_piece.remote(piece["piece"])) is True
    with pytest.raises(ray.exceptions.RayTaskError, match="no piece"):
        ray.get(agent.read_piece_chunk.remote(piece["piece"], 0, 10))
    bad = [dict(ranks[0], path="/etc/passwd")]
    with pytest.raises(ray.exceptions.RayTaskError, match="not trace files"):
        ray.get(agent.merge_traces.remote(bad, 0.0, 100_000))
