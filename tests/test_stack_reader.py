"""The node agent's stack reader against real processes: py-spy, the faulthandler fallback when
py-spy is missing or may not attach, and a process already gone."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time

import pytest

from coordinator.core.stacks import main_thread, short_stack
from tests.configs import ROOT
from worker_ext.agent.stack_reader import read_stack, read_stacks, request_flight_recorder

pytestmark = pytest.mark.subprocess
STUCK = os.path.join(ROOT, "tests", "scripts", "stuck_process.py")


def start_stuck(tmp_path, monkeypatch, *args, **env_vars):
    monkeypatch.setenv("RAY_PROFILER_STACKS_DIR", str(tmp_path / "stacks"))
    env = {**os.environ, "PYTHONPATH": ROOT, **env_vars}
    return subprocess.Popen(
        [sys.executable, STUCK, *args], stdout=subprocess.PIPE, text=True, env=env
    )


@pytest.fixture
def stuck(tmp_path, monkeypatch):
    """A real process sleeping in slow_loader, its dump registered in a private directory."""
    proc = start_stuck(tmp_path, monkeypatch)
    try:
        dump = json.loads(proc.stdout.readline())
        yield proc, {"pid": proc.pid, "dump": dump}
    finally:
        proc.kill()
        proc.wait()


def stack_of(got):
    thread = main_thread(got["threads"])
    return short_stack(thread["frames"]) if thread else None


def test_py_spy_reads_a_stuck_process_from_outside(stuck):
    proc, target = stuck
    got = read_stack(target, native=False, method="auto", timeout_s=20)
    assert got["method"] == "py-spy" and got["error"] is None, got
    assert stack_of(got) == "slow_loader <- load_batch <- <module>"
    assert proc.poll() is None  # read, not harmed


def test_without_py_spy_the_faulthandler_dump_is_read_and_says_why(stuck, monkeypatch):
    proc, target = stuck
    monkeypatch.setenv("RAY_PROFILER_PY_SPY", "none")
    for _ in range(2):  # the dump file grows; each read takes only the new dump
        got = read_stack(target, native=False, method="auto", timeout_s=10)
        assert got["method"] == "faulthandler", got
        assert got["tried"] == ["py-spy: py-spy not installed"]
        assert stack_of(got) == "slow_loader <- load_batch <- <module>"
    assert proc.poll() is None  # the signal dumped, and the process goes on


def test_ptrace_refused_falls_back_and_says_permission(stuck, monkeypatch, tmp_path):
    proc, target = stuck
    fake = tmp_path / "py-spy"  # a fault injected: py-spy as it answers where ptrace is refused
    fake.write_text("#!/bin/sh\necho 'Error: Operation not permitted (os error 1)' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("RAY_PROFILER_PY_SPY", str(fake))
    got = read_stack(target, native=False, method="auto", timeout_s=10)
    assert got["method"] == "faulthandler"
    assert got["tried"][0].startswith("py-spy: permission: ptrace not permitted")
    only = read_stack(target, native=False, method="py-spy", timeout_s=10)
    assert only["method"] is None and only["error"].startswith("permission: ptrace not permitted")


def test_a_process_already_gone_is_reported_at_once(stuck):
    proc, target = stuck
    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    got = read_stacks(
        {
            "targets": [target],
            "native": False,
            "method": "auto",
            "at": time.time(),
            "timeout_s": 30,
            "flight_recorder_dir": None,
        }
    )
    assert [g["error"] for g in got] == ["exited"] and time.monotonic() - t0 < 2.0


def test_a_process_without_a_dump_and_without_py_spy_says_both(stuck, monkeypatch):
    proc, target = stuck
    monkeypatch.setenv("RAY_PROFILER_PY_SPY", "none")
    got = read_stack({"pid": proc.pid, "dump": None}, native=False, method="auto", timeout_s=5)
    assert got["method"] is None
    assert got["error"] == (
        "py-spy: py-spy not installed; faulthandler: faulthandler not available: "
        "the process has not registered it"
    )


def test_native_frames_fall_back_to_python_frames_when_py_spy_cannot_unwind(
    stuck, tmp_path, monkeypatch
):
    from worker_ext.agent.stack_reader import find_py_spy

    real = find_py_spy()
    assert real, "py-spy is a dependency"
    # The fault, injected: a py-spy that cannot unwind native frames (as on some builds), and
    # is the real one without --native.
    shim = tmp_path / "py-spy"
    shim.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do if [ "$a" = "--native" ]; then\n'
        "  echo 'Error: Failed to unwind native stack (injected)' >&2; exit 1; fi; done\n"
        f'exec "{real}" "$@"\n'
    )
    shim.chmod(0o755)
    monkeypatch.setenv("RAY_PROFILER_PY_SPY", str(shim))
    proc, target = stuck
    got = read_stack(target, native=True, method="py-spy", timeout_s=20)
    assert got["method"] == "py-spy" and "slow_loader" in stack_of(got)
    assert len(got["tried"]) == 1 and got["tried"][0].startswith("py-spy --native: ")
    assert "Failed to unwind native stack (injected)" in got["tried"][0]


def test_a_cpu_process_has_no_flight_recorder_and_says_why(stuck, tmp_path):
    proc, target = stuck
    fr = request_flight_recorder(proc.pid, target["dump"], str(tmp_path / "fr"), 5)
    assert fr == {"path": None, "reason": "not available: TORCH_NCCL_TRACE_BUFFER_SIZE is not > 0"}


def test_the_flight_recorder_pipe_brings_torch_s_own_dump_back(tmp_path, monkeypatch):
    proc = start_stuck(tmp_path, monkeypatch, "--as-cuda", TORCH_NCCL_TRACE_BUFFER_SIZE="2000")
    try:
        dump = json.loads(proc.stdout.readline())
        assert dump["flight_recorder"] and dump["flight_recorder_note"] is None
        for _ in range(2):  # asked at once, and again: the pipe always has its reader
            fr = request_flight_recorder(proc.pid, dump, str(tmp_path / "fr"), 30)
            assert fr["reason"] is None, fr
            with open(fr["path"], "rb") as f:
                trace = pickle.load(f)  # torch's Flight Recorder format: no collective ran
            assert trace["entries"] == [] and "version" in trace
            os.unlink(fr["path"])
    finally:
        proc.kill()
        proc.wait()


def test_a_process_that_exits_leaves_no_stack_dump_behind(tmp_path, monkeypatch):
    proc = start_stuck(tmp_path, monkeypatch, "--as-cuda", TORCH_NCCL_TRACE_BUFFER_SIZE="2000")
    dump = json.loads(proc.stdout.readline())
    assert os.path.exists(dump["path"]) and os.path.exists(dump["flight_recorder"])
    proc.send_signal(2)  # Ctrl-C: the interpreter exits normally, its exit handlers run
    proc.wait(30)
    assert os.listdir(tmp_path / "stacks") == []


def test_the_agent_sweeps_the_dumps_of_processes_killed_outright(tmp_path, monkeypatch):
    from worker_ext.agent.stack_reader import sweep_dumps

    killed = start_stuck(tmp_path, monkeypatch, "--as-cuda", TORCH_NCCL_TRACE_BUFFER_SIZE="2000")
    alive = start_stuck(tmp_path, monkeypatch)
    try:
        dead = json.loads(killed.stdout.readline())
        live = json.loads(alive.stdout.readline())
        killed.kill()  # SIGKILL, as ray.kill: no exit handler runs
        killed.wait(30)
        (tmp_path / "stacks" / "notes.txt").write_text("not a dump")
        folder = tmp_path / "stacks"
        assert sorted(sweep_dumps(folder)) == [f"{killed.pid}.fr", f"{killed.pid}.txt"]
        assert not os.path.exists(dead["path"]) and not os.path.exists(dead["flight_recorder"])
        assert sorted(os.listdir(folder)) == [f"{alive.pid}.txt", "notes.txt"]
        assert os.path.exists(live["path"]) and sweep_dumps(folder) == []
    finally:
        for p in (killed, alive):
            p.kill()
            p.wait()
