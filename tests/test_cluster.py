"""Tests that need a Ray cluster of their own, each driven from subprocesses."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from tests.conftest import ROOT
from tests.s3_server import s3_server

pytestmark = pytest.mark.subprocess  # every test here starts another process


def env(**extra):
    e = {**os.environ, "PYTHONPATH": ROOT, "RAY_AUTH_MODE": "disabled"}
    e.pop("RAY_ADDRESS", None)
    e.update(extra)
    return e


def result_of(proc: subprocess.CompletedProcess) -> dict:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        proc.returncode,
        proc.stdout[-2000:],
        proc.stderr[-4000:],
    )
    return json.loads(lines[-1][len("RESULT ") :])


def run_script(module: str, *args: str) -> dict:
    """Run a driver script of tests/scripts in its own process; the RESULT it printed."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    return result_of(proc)


def test_two_nodes_upload_to_s3_and_collect_names_the_ranks_of_a_removed_node():
    with s3_server() as s3:
        s3.make_bucket("traces")
        out = run_script("tests.scripts.multinode_run", s3.endpoint)
    assert out["distinct_nodes"] == 2
    # 1. every window of every rank, from both nodes, is in the bucket; staging is empty again
    dirs = ["window_0000_steps_1-2", "window_0001_steps_4-5"]
    assert out["uploaded"] == [
        f"traces/multi/run/{d}/policy/rank{r}.pt.trace.json.gz" for d in dirs for r in range(4)
    ]
    assert out["s3_trace_errors"] == [{}, {}]
    # the run's record in the bucket, read with --from: the live table, byte for byte
    rec = out["s3_record"]
    assert rec["dir"] == "s3://traces/multi/run/record" and rec["windows"] == 2, rec
    assert rec["pending"] == 0 and rec["error"] is None, rec
    assert [p for p in out["recorded"] if not p.startswith("phases/")] == [
        "memory.msgpack",  # (every rank's memory: issue 54 item 4)
        "run.msgpack",
        "windows/000000.msgpack",
        "windows/000001.msgpack",
    ]
    assert out["record_top_same"] and out["record_top_window"] == 0
    assert out["s3_nodes"] == {str(r): out["nodes"][r] for r in range(4)}
    # window 0 merged from the bucket: a process per rank, named by its node, on one clock
    merged = out["merged"]
    addresses = out["node_addresses"]  # both raylets have one address here: node ids added
    assert len({addresses[n] for n in out["nodes"]}) == 2
    assert merged["names"] == {
        str(r + 1): f"rank {r} · policy · {addresses[out['nodes'][r]]}" for r in range(4)
    }
    assert all(kept == events > 0 for _, kept, events in merged["kept"]) and not merged["missing"]
    assert all(d < 0.01 for d in merged["aligned_us"].values()), merged["aligned_us"]
    assert set(merged["spread_us"]) == {"1", "2"}  # both steps on all 4 ranks
    assert out["staging_dirs"] == {"head": ["run"], "node2": ["run"]}  # each node its own
    assert out["staging_files"] == {"head": [], "node2": []}
    # 2. node-local traces; node 2 removed mid-run
    assert out["ranks"] == {"0": "ok", "1": "ok", "2": "lost", "3": "lost"}
    assert out["windows"][0] == [[1, 2], [0, 1, 2, 3]]
    assert out["windows"][1] == [[4, 5], [0, 1]]
    assert out["files"]["window_0000_steps_1-2"] == [f"rank{r}.pt.trace.json" for r in range(4)]
    assert out["files"]["window_0001_steps_4-5"] == ["rank0.pt.trace.json", "rank1.pt.trace.json"]
    assert out["collected_dir"] == ["rank0.pt.trace.json", "rank1.pt.trace.json"]
    assert sorted(out["missing"]) == ["2", "3"]
    assert all("is gone" in why for why in out["missing"].values()), out["missing"]
    # node-local window 0 merged by each node's agent and joined: every rank, on one clock;
    # once node 2 has gone, its ranks are named missing and the others still merged
    lm = out["local_merge"]
    assert [r[:2] for r in lm["ranks"]] == [[0, 1], [1, 2], [2, 3], [3, 4]] and not lm["missing"]
    assert all(kept == events > 0 for _, _, kept, events in lm["ranks"]) and lm["pids"] == [
        1,
        2,
        3,
        4,
    ]
    assert all(d < 0.01 for d in lm["aligned_us"].values()), lm["aligned_us"]
    assert lm["after"] == [0, 1] and sorted(lm["after_missing"]) == ["policy 2", "policy 3"]
    assert all("is gone" in why for why in lm["after_missing"].values()), lm["after_missing"]
    assert out["torch_loaded"] is False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"no Ray head on port {port} after {deadline_s} s")


@pytest.fixture(scope="module")
def head():
    """A private `ray start --head` cluster for this module; stops only what it started."""
    with ray_head() as h:
        yield h


@contextlib.contextmanager
def ray_head(dashboard: bool = False):
    """A private `ray start --head` cluster (its own process group, its own temp dir): its
    ``env`` reaches it, ``kill()`` stops every process of it at once, by its group's pid.
    ``dashboard``: with Ray's dashboard (its job server: ``ray job submit``) on 127.0.0.1, at
    the ``dashboard`` address it yields."""
    temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths are capped
    port, metrics_port, dash_port = free_port(), free_port(), free_port()
    # (the job server's agent on a port of its own: another cluster on this machine may hold
    # Ray's default, 52365, and ``ray job submit`` then answers "No available agent")
    board = (
        [
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash_port}",
            f"--dashboard-agent-listen-port={free_port()}",
        ]
        if dashboard
        else ["--include-dashboard=false"]
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=8",
            *board,
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
            f"--metrics-export-port={metrics_port}",
        ],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: we stop this cluster and no other
    )

    def kill() -> None:
        """SIGKILL every process of this cluster at once: its process group and every process
        under them (Ray's workers, the detached coordinator among them, start sessions of their
        own and outlive a kill of the group)."""
        import psutil

        group = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if os.getpgid(p.pid) == proc.pid:
                    group.append(p)
        mine = {p.pid: p for p in group}
        for p in group:
            with contextlib.suppress(psutil.Error):
                mine.update((c.pid, c) for c in p.children(recursive=True))
        for p in mine.values():
            with contextlib.suppress(psutil.Error):
                p.kill()
        _, alive = psutil.wait_procs(list(mine.values()), timeout=30)
        assert not alive, alive
        proc.wait(timeout=30)

    try:
        wait_for_port(port, 90)
        if dashboard:
            wait_for_port(dash_port, 90)
        yield {"env": env(RAY_ADDRESS=f"127.0.0.1:{port}"), "metrics_port": metrics_port,
               "kill": kill, "dashboard": f"http://127.0.0.1:{dash_port}"}  # fmt: skip
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)  # `ray start --block` can take half a minute to wind down
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):  # raylet workers left in the group
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)


def py(head, *args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env=head["env"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def test_second_driver_reads_the_coordinator_after_the_trainer_exits(head, tmp_path):
    trainer = py(head, "tests.scripts.second_driver_trainer", str(tmp_path))
    assert trainer.returncode == 0 and "TRAINER-DONE" in trainer.stdout, trainer.stderr[-4000:]
    # A Prometheus that scrapes Ray sees the coordinator's metrics (exported every few seconds).
    deadline, text = time.monotonic() + 60, ""
    while time.monotonic() < deadline and "ray_profiler_global_step" not in text:
        time.sleep(2)
        text = scrape(head["metrics_port"])
    for name in (
        "global_step",
        "windows_captured_total",
        "worker_rpcs_total",
        "ranks_disabled",
        "ranks_lost",
    ):
        assert f"ray_profiler_{name}" in text, name
    out = result_of(py(head, "tests.scripts.second_driver_reader", "--kill"))
    st, ks = out["status"], out["kernels"]
    assert st["name"] == "profiler" and st["namespace"] == "profiler"
    assert st["global_step"] == 3 and [w["steps"] for w in st["windows"]] == [[1, 2]]
    assert st["windows"][0]["traces_pending"] == [] and st["windows"][0]["trace_errors"] == {}
    assert [t["trainer_id"] for t in st["trainers"]] == ["sft"]
    assert st["metrics"]["exported"] and st["metrics"]["values"]["profiler_global_step"] == 3
    assert ks["window"] == 0 and ks["ranks"] == [0, 1] and len(ks["kernels"]) == 5
    assert sorted(os.listdir(tmp_path / "run" / "window_0000_steps_1-2" / "policy")) == [
        "rank0.pt.trace.json.gz",
        "rank1.pt.trace.json.gz",
    ]
    gone = py(head, "tests.scripts.second_driver_reader")
    assert gone.returncode != 0 and "Failed to look up actor" in gone.stderr


def cli(head, *args, timeout=300):
    return py(head, "coordinator", *args, timeout=timeout)


def test_capture_requested_from_another_process_while_training(head, tmp_path):
    stop_file = tmp_path / "stop"
    trainer = subprocess.Popen(
        [sys.executable, "-m", "tests.scripts.capture_trainer", str(tmp_path), str(stop_file)],
        cwd=ROOT,
        env=head["env"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:  # wait until the trainer is registered and stepping
            st = cli(head, "--json", "status")
            if st.returncode == 0 and (json.loads(st.stdout)["global_step"] or -1) >= 3:
                break
            assert time.monotonic() < deadline, st.stderr
            time.sleep(1)
        assert json.loads(st.stdout)["next_window"] is None  # on-demand only: nothing planned

        waited = cli(
            head,
            "--json",
            "capture",
            "--active",
            "2",
            "--warmup",
            "1",
            "--wait",
            "--timeout",
            "120",
        )
        assert waited.returncode == 0, waited.stderr
        ks = json.loads(waited.stdout.strip().splitlines()[-1])
        assert ks["ranks"] == [0, 1] and ks["kernels"] and ks["steps"][1] - ks["steps"][0] == 1
        assert not ks["partial"] and ks["stragglers"]["ranks"].keys() == {"0", "1"}

        # overlap and cancel
        far = cli(head, "--json", "capture", "--active", "3", "--start-step", "100000")
        res = json.loads(far.stdout)
        assert res["accepted"] and res["steps"] == [100000, 100002]
        clash = cli(head, "capture", "--active", "1", "--start-step", "100001")
        assert clash.returncode == 1 and "capture refused" in clash.stderr
        assert f"overlap capture {res['window']}" in clash.stderr
        unknown = cli(head, "capture", "--active", "1", "--ranks", "0", "7")
        assert unknown.returncode == 1 and "unknown ranks [7]" in unknown.stderr
        assert cli(head, "cancel", str(res["window"])).returncode == 0
        again = cli(head, "cancel", str(res["window"]))
        assert again.returncode == 1 and "no pending capture" in again.stderr

        # the other read commands, as a person and as a script would run them
        top = cli(head, "top", "--k", "5")
        assert top.returncode == 0 and "aten::" in top.stdout and "share" in top.stdout
        strag = cli(head, "stragglers")
        assert strag.returncode == 0 and "x median" in strag.stdout
        watch = cli(head, "watch", "--count", "2", "--interval", "0.2")
        assert watch.returncode == 0 and watch.stdout.count("global step") == 2
        # above the status, the step time over the run with its windows (a capture: c)
        assert watch.stdout.count("step time, steps 0-") == 2, watch.stdout
        bands = [ln for ln in watch.stdout.splitlines() if ln.startswith("  windows  ")]
        assert len(bands) == 2 and all(set(b[10:]) == {" ", "c"} for b in bands), watch.stdout
        bare = cli(head, "watch", "--count", "1", "--no-chart")
        assert bare.returncode == 0 and "step time" not in bare.stdout
        assert "\x1b" not in watch.stdout  # into a pipe: plain text, no escape codes
        human = cli(head, "status")
        assert human.returncode == 0 and "phase" in human.stdout and "capture" in human.stdout
        # options after the command, and --address auto (Ray reads RAY_ADDRESS for it)
        after = cli(head, "status", "--json", "--address", "auto", "--namespace", "profiler")
        assert after.returncode == 0 and json.loads(after.stdout)["run"]["lifecycle"] == "running"
        assert cli(head, "status", "--bogus").returncode == 2

        # A capture the run ends before: `capture --wait` says so as soon as the trainer stops.
        waiting = subprocess.Popen(
            [sys.executable, "-m", "coordinator", "capture", "--active", "1"]
            + ["--start-step", "900000", "--wait", "--timeout", "300"],
            cwd=ROOT,
            env=head["env"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while "900000" not in json.dumps(json.loads(cli(head, "--json", "status").stdout)):
            assert time.monotonic() < deadline
            time.sleep(0.5)
    finally:
        stop_file.write_text("")
        out, err = trainer.communicate(timeout=120)
    stopped_at = time.monotonic()
    w_out, w_err = waiting.communicate(timeout=60)
    assert time.monotonic() - stopped_at < 5, "capture --wait kept waiting after the run stopped"
    assert waiting.returncode == 1, (w_out, w_err)
    assert "recorded nothing: the run stopped at step" in w_err and "before the window" in w_err
    assert trainer.returncode == 0, err[-4000:]
    run = tmp_path / "run"
    (window_dir,) = [d for d in os.listdir(run) if d.startswith(f"window_{ks['window']:04d}")]
    assert window_dir == f"window_{ks['window']:04d}_steps_{ks['steps'][0]}-{ks['steps'][1]}"
    assert sorted(os.listdir(run / window_dir / "policy")) == [
        "rank0.pt.trace.json",
        "rank1.pt.trace.json",
    ]
    assert '"enabled": true' in out
    kill = subprocess.run(
        [sys.executable, "-m", "tests.scripts.second_driver_reader", "--kill"],
        cwd=ROOT,
        env=head["env"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert kill.returncode == 0


def test_the_demo_joins_a_cluster_and_two_runs_of_it_are_never_mixed(head, tmp_path):
    args = ["trainers.demo", "--trainer", "sft", "--steps", "8", "--address"]
    args += [head["env"]["RAY_ADDRESS"], "--save-path", str(tmp_path), "--run-name", "twice"]
    first = py(head, *args)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "coordinator left running" in first.stdout  # joined: a notebook can read it
    read = result_of(py(head, "tests.scripts.second_driver_reader"))
    assert read["status"]["global_step"] == 7 and read["kernels"]["ranks"] == [0, 1]
    assert read["status"]["run_dir"] == str(tmp_path / "twice")
    second = py(head, *args, "--active", "1")  # another config, same run name
    assert second.returncode == 0, second.stderr[-3000:]
    out = result_of(py(head, "tests.scripts.second_driver_reader", "--kill"))
    st = out["status"]
    assert st["run"]["name"] == "twice.2" and st["run_dir"] == str(tmp_path / "twice.2")
    assert st["config"]["active"] == 1 and st["windows"][0]["index"] == 0
    assert [p["run"]["name"] for p in st["previous_runs"]] == ["twice"]
    assert st["previous_runs"][0]["config"]["active"] == 2
    first_dirs = sorted(os.listdir(tmp_path / "twice"))
    second_dirs = sorted(os.listdir(tmp_path / "twice.2"))
    assert first_dirs.pop(0) == second_dirs.pop(0) == "record"  # each run its own record
    assert first_dirs[0].startswith("window_0000_") and second_dirs[0].startswith("window_0000_")
    recorded = [w for w in st["previous_runs"][0]["windows"] if w["steps"]]
    assert len(first_dirs) == len(recorded)
    assert len(second_dirs) == len([w for w in st["windows"] if w["steps"]])


def test_cli_errors_are_one_line(head):
    no_coord = cli(head, "--name", "nobody", "status")
    assert no_coord.returncode == 1
    assert no_coord.stderr.strip().splitlines() == [
        "error: no profiler coordinator named 'nobody' in namespace 'profiler' "
        f"on the cluster at {head['env']['RAY_ADDRESS']}"
    ]
    no_cluster = subprocess.run(
        [sys.executable, "-m", "coordinator", "--address", f"127.0.0.1:{free_port()}", "top"],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert no_cluster.returncode == 1 and len(no_cluster.stderr.strip().splitlines()) == 1
    assert no_cluster.stderr.startswith("error: no Ray cluster answers at 127.0.0.1:")


def test_three_nodes_fan_out_through_agents_fold_partials_and_lose_a_removed_node():
    out = run_script("tests.scripts.three_nodes_run")
    assert out["distinct_nodes"] == 3
    # Window commands went through the three agents (one group: one relay); each window's
    # summaries came as one partial, merged by the relay from its three nodes' partials.
    assert out["paths"]["by_path"] == {"agent": 3}, out["paths"]
    assert out["counters"]["node_commands"] >= 6
    assert out["counters"].get("node_fallback_ranks", 0) == 0
    assert out["counters"]["partials"] == 2 and out["counters"]["summaries"] == 12
    assert out["tables"] == {"0": list(range(6)), "1": list(range(6))}
    # Node 3 removed after step 7: its ranks are lost, the others' table is complete.
    assert out["ranks"] == {"0": "ok", "1": "ok", "2": "ok", "3": "ok", "4": "lost", "5": "lost"}
    assert out["lost_reasons"] and set(out["lost_reasons"]) <= {
        "ActorDiedError",
        "RayActorError",
        "ActorUnavailableError",
    }, out["lost_reasons"]
    assert out["last"]["steps"] == [7, 8] and out["last"]["ranks"] == [0, 1, 2, 3]
    assert out["last"]["table"] == [0, 1, 2, 3] and out["last"]["pending"] == []
    # The run stopped: the agents, idle for agent_idle_exit_s = 2, left by themselves.
    assert out["agents_before_exit"] >= 2 and out["agents_after"] == []
    assert out["torch_loaded"] is False
    # Stacks from every node, read at once: six idle ranks, one group; the removed node's
    # ranks are said, with why, not waited for.
    assert out["stacks"]["nodes"] == 3 and out["stacks"]["methods"] == ["py-spy"], out["stacks"]
    assert out["stacks"]["groups"] == [[list(range(6)), "idle"]], out["stacks"]["lines"]
    gone = out["stacks_after_removal"]
    assert sorted(gone) == ["4", "5"], gone
    assert all(
        why.startswith(("exited", "node "))
        and ("exited" in why or "unreachable" in why or "agent" in why)
        for why in gone.values()
    ), gone


def test_a_run_goes_on_from_its_record_after_its_whole_cluster_is_lost(tmp_path):
    """The GCS goes with its cluster, and the coordinator's checkpoint with it: a new cluster's
    coordinator finds the run's record in save_path and goes on from it."""
    from coordinator.service.record_reader import open_record

    record = tmp_path / "long" / "record"
    with ray_head() as first:
        trainer = subprocess.Popen(
            [sys.executable, "-m", "tests.scripts.gcs_loss_trainer", str(tmp_path), "0", "-1"],
            cwd=ROOT, env=first["env"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 180
            while True:  # two windows settled in the record, and the steps after them
                before = open_record(str(record)) if (record / "run.msgpack").exists() else None
                if before and len(before.file.windows) >= 2 and before.phases.steps_seen >= 13:
                    break
                assert trainer.poll() is None, trainer.stderr.read()[-4000:]
                assert time.monotonic() < deadline, "no two windows recorded"
                time.sleep(0.5)
            first["kill"]()  # the whole cluster, GCS and all, mid-run
        finally:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait(30)
    lost = open_record(str(record))  # what the record holds once the cluster is gone
    assert lost.file.lifecycle == "running" and len(lost.file.windows) >= 2
    at = lost.file.global_step
    window0 = (record / "windows" / "000000.msgpack").read_bytes()
    with ray_head() as second:  # a new cluster: no checkpoint; the trainer resumes after `at`
        out = result_of(py(second, "tests.scripts.gcs_loss_trainer", str(tmp_path),
                           str(at + 1), str(at + 12)))  # fmt: skip
    st = out["status"]
    assert st["run"]["name"] == "long" and st["counters"]["record_restores"] == 1
    assert st["global_step"] == at + 12 and st["run_dir"] == str(tmp_path / "long")
    windows = {w["index"]: w for w in st["windows"]}
    old = {w.window.index: w.to_dict() for w in lost.run.state.closed_windows()}
    for i, w in old.items():  # restored as recorded
        assert json.loads(json.dumps(w)) == windows[i]
    new = [w for i, w in windows.items() if i not in old and w["steps"]]
    assert new and min(w["index"] for w in new) >= lost.file.next_window > max(old)  # on
    assert all(w["steps"][0] > at for w in new)  # on the absolute global step
    steps = [s["step"] for s in out["phases"]["steps"]]
    assert steps[: lost.phases.steps_seen] == [r[0] for r in lost.phases.exact]  # kept
    assert steps[lost.phases.steps_seen :] == list(range(at + 1, at + 13))  # and gone on
    assert out["record"]["error"] is None and out["record"]["pending"] == 0
    after = open_record(str(record))  # the record goes on too, nothing written over
    assert (record / "windows" / "000000.msgpack").read_bytes() == window0
    assert after.file.lifecycle == "stopped" and after.file.windows == sorted(windows)
    assert after.phases.steps_seen == lost.phases.steps_seen + 12 and not after.problems
