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

from tests.conftest import ROOT


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


def test_multinode_traces_on_both_nodes_and_a_removed_node_is_lost():
    proc = subprocess.run(
        [sys.executable, "-m", "tests.scripts.multinode_run"],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    out = result_of(proc)
    assert out["distinct_nodes"] == 2
    assert out["ranks"] == {"0": "ok", "1": "ok", "2": "lost", "3": "lost"}
    assert out["windows"][0] == [[1, 2], [0, 1, 2, 3]]
    assert out["windows"][1] == [[4, 5], [0, 1]]
    assert out["files"]["window_0000_steps_1-2"] == [f"rank{r}.pt.trace.json" for r in range(4)]
    assert out["files"]["window_0001_steps_4-5"] == ["rank0.pt.trace.json", "rank1.pt.trace.json"]
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


def test_second_driver_reads_the_coordinator_after_the_trainer_exits(tmp_path):
    temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths are capped
    port = free_port()
    head = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=8",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
        ],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: we stop this cluster and no other
    )
    try:
        wait_for_port(port, 90)
        address = env(RAY_ADDRESS=f"127.0.0.1:{port}")
        trainer = subprocess.run(
            [sys.executable, "-m", "tests.scripts.second_driver_trainer", str(tmp_path)],
            cwd=ROOT,
            env=address,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert trainer.returncode == 0 and "TRAINER-DONE" in trainer.stdout, trainer.stderr[-4000:]
        reader = subprocess.run(
            [sys.executable, "-m", "tests.scripts.second_driver_reader", "--kill"],
            cwd=ROOT,
            env=address,
            capture_output=True,
            text=True,
            timeout=120,
        )
        out = result_of(reader)
        st, ks = out["status"], out["kernels"]
        assert st["name"] == "profiler" and st["namespace"] == "profiler"
        assert st["global_step"] == 3 and [w["steps"] for w in st["windows"]] == [[1, 2]]
        assert [t["trainer_id"] for t in st["trainers"]] == ["sft"]
        assert ks["window"] == 0 and ks["ranks"] == [0, 1] and len(ks["kernels"]) == 5
        assert sorted(os.listdir(tmp_path / "run" / "window_0000_steps_1-2")) == [
            "rank0.pt.trace.json.gz",
            "rank1.pt.trace.json.gz",
        ]
        gone = subprocess.run(
            [sys.executable, "-m", "tests.scripts.second_driver_reader"],
            cwd=ROOT,
            env=address,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert gone.returncode != 0 and "Failed to look up actor" in gone.stderr
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=30)
        # anything of that cluster still in the group (raylet workers) goes too
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)
