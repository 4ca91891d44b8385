"""The main job's entry point, its flags and errors, and the docker files that run it."""

import contextlib
import io
import json
import os
import shlex
import subprocess
import sys

import pytest
import yaml

from tests.conftest import ROOT
from tests.no_false_alarm import assert_no_false_alarm, from_cli, in_process
from trainers.demo import build_config, parse_args, print_kernels


def run_demo(*args, timeout=240):
    env = {**os.environ, "PYTHONPATH": ROOT, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [sys.executable, "-m", "trainers.demo", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cli(*args: str) -> str:
    """``ray-profiler ...``'s output, in a process with no cluster to reach."""
    env = {**os.environ, "PYTHONPATH": ROOT, "RAY_ADDRESS": "127.0.0.1:1"}
    proc = subprocess.run([sys.executable, "-m", "coordinator", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.subprocess
def test_demo_prints_steps_status_kernels_and_traces(tmp_path):
    proc = run_demo(
        "--trainer",
        "rl",
        "--steps",
        "8",
        "--save-path",
        str(tmp_path),
        "--run-name",
        "demo",
        "--skip-first",
        "1",
        "--wait",
        "1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    step_lines = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert len(step_lines) == 8 and "reward" in step_lines[0] and " ms " in step_lines[0]
    assert "profiler: recording" in out and "profiler: warmup" in out
    assert "== profiler status ==" in out and "== top kernels, policy" in out
    # both roles by default: the policy ranks and generation worker 0, each its own table
    assert "== top kernels, rollout, window 1 steps [7, 7], ranks [0]" in out
    assert "    rollout  ranks [0], busy " in out
    assert f"traces: {tmp_path / 'demo'} (window_.../<role>/rank<r>...)" in out
    # windows record 3-4 and 7-8; the run ends after step 7, so the second one is partial
    assert sorted(os.listdir(tmp_path / "demo")) == [
        "record",
        "window_0000_steps_3-4",
        "window_0001_steps_7-7",
    ]
    # its cluster is gone: the run's record shows the tables the demo printed from the live one
    record = tmp_path / "demo" / "record"
    assert f"record: {record} (after the cluster: ray-profiler status --from {record})" in out
    for role in ("policy", "rollout"):
        ks = json.loads(cli("top", "--from", str(record), "--role", role, "--k", "10", "--json"))
        shown = io.StringIO()
        with contextlib.redirect_stdout(shown):
            print_kernels(ks)
        assert shown.getvalue() in out, role
    phases = cli("phases", "--last", "1000", "--from", str(tmp_path / "demo"))
    assert phases in out
    for d in os.listdir(tmp_path / "demo"):
        if d.startswith("window_"):
            assert sorted(os.listdir(tmp_path / "demo" / d)) == ["policy", "rollout"]
    # No false alarm (issue 57, item 5): each window's findings, each role, from the record.
    assert_no_false_alarm(
        from_cli(in_process, ["--from", str(record)]), [0, 1], ["policy", "rollout"]
    )


@pytest.mark.subprocess
def test_the_ray_train_demo_prints_a_two_rank_table(tmp_path):
    """``make demo DEMO_ARGS="--trainer ray-train"``: a 2-worker TorchTrainer, each worker
    stepping itself (RankSession); the cross-rank table lists both ranks."""
    flags = ["--steps", "8", "--run-name", "rt", "--skip-first", "1", "--wait", "1"]
    proc = run_demo("--trainer", "ray-train", "--save-path", str(tmp_path), *flags, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "ray-train trainer (TorchTrainer, SPMD), 2 workers, 8 steps; profiling on" in out
    assert len([ln for ln in out.splitlines() if ln.startswith("step ")]) == 8
    # windows record 3-4 and 7-8: the run ends after step 7, so the second one is partial
    assert "  window 0: steps [3, 4]\n" in out and "window 1: steps [7, 7] partial" in out
    assert "worker RPCs 0" in out  # (the coordinator never called a rank)
    assert "== top kernels, policy, window 1 steps [7, 7], ranks [0, 1]" in out
    assert "region                     mean ms" in out and "\ntrain " in out
    assert sorted(os.listdir(tmp_path / "rt" / "window_0000_steps_3-4" / "policy")) == [
        "rank0.pt.trace.json.gz", "rank1.pt.trace.json.gz"]  # fmt: skip


@pytest.mark.subprocess
def test_the_attach_demo_profiles_a_job_that_imports_nothing_of_ours(tmp_path):
    """``make demo DEMO_ARGS="--attach"``: the job (trainers/reference/unchanged.py) is profiled
    through the runtime_env's setup hook alone, on its optimizer steps; two-rank table."""
    from pathlib import Path

    from tests.house_rules import PACKAGES, imports

    job = Path(ROOT, "trainers", "reference", "unchanged.py")
    used = imports("trainers.reference.unchanged", job)
    assert not [m for m in used if m.split(".")[0] in PACKAGES], used  # nothing of ours
    flags = ["--steps", "8", "--run-name", "at", "--skip-first", "1", "--wait", "1"]
    proc = run_demo("--attach", "--save-path", str(tmp_path), *flags, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "an unchanged job: 2 policy actors, 8 global steps of 2 optimizer steps each" in out
    assert len([ln for ln in out.splitlines() if ln.startswith("step ")]) == 8
    # 16 optimizer steps, the first spent attaching: windows record 3-4 and 7-8
    assert "  window 0: steps [3, 4]\n" in out and "  window 1: steps [7, 8]\n" in out
    assert "  attached.PolicyWorker rank 1: ok, windows 2" in out
    assert "== top kernels, policy, window 1 steps [7, 8], ranks [0, 1]" in out
    assert "Optimizer.step#Adam.step" in out
    # rank 0's last steps came from its node agent after its process was killed; the run ends
    # with the demo's job (issue 54 item 5), and its record says so
    assert ", run stopped (the run stopped at step 16)" in out and "\nglobal step 16," in out
    assert "; 15 steps seen" in out, out
    cli = [sys.executable, "-m", "coordinator", "status", "--from", str(tmp_path / "at" / "record"),
           "--json"]  # fmt: skip
    done = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, check=True)
    got = json.loads(done.stdout)
    assert (got["global_step"], got["run"]["lifecycle"], got["record"]["steps"]) == (
        16, "stopped", 15)  # fmt: skip


def test_demo_config_file_and_flags(tmp_path):
    cfg_file = tmp_path / "profiler.yaml"
    cfg_file.write_text("wait: 7\nactive: 4\nexport_type: chrome_trace\nranks: [0]\n")
    args = parse_args(["--config", str(cfg_file), "--active", "2", "--save-path", str(tmp_path)])
    cfg = build_config(args)
    assert (cfg.wait, cfg.active, cfg.export_type, cfg.ranks) == (7, 2, "chrome_trace", [0])
    assert build_config(parse_args(["--no-profile"])).enable is False


@pytest.mark.subprocess
def test_demo_bad_config_is_one_clear_line(tmp_path):
    cfg_file = tmp_path / "bad.yaml"
    cfg_file.write_text("warmup: null\n")
    proc = run_demo("--config", str(cfg_file), timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: profiler config: 'warmup' must be an int, got NoneType: None"
    )


@pytest.mark.subprocess
def test_demo_against_a_dead_address_fails_fast():
    proc = run_demo("--address", "127.0.0.1:9", timeout=60)
    assert proc.returncode != 0
    assert "no Ray cluster answers at 127.0.0.1:9" in proc.stderr


def dockerfile_lines() -> list[str]:
    with open(os.path.join(ROOT, "docker", "Dockerfile")) as f:
        text = f.read().replace("\\\n", " ")
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def test_dockerfile_is_a_users_with_a_public_base_and_nothing_of_this_machine():
    lines = dockerfile_lines()
    assert lines[0] == "ARG BASE=python:3.11-slim" and lines[1] == "FROM ${BASE}"
    text = "\n".join(lines)
    for local in ("ca-certificates", "/wheels", "/opt/", "PIP_FIND_LINKS", "PIP_CERT", "local/"):
        assert local not in text.replace("/opt/venv", ""), local
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in lines
    for ln in lines:
        if ln.startswith("COPY "):
            for src in shlex.split(ln)[1:-1]:
                assert os.path.exists(os.path.join(ROOT, src)), src
    users = [ln for ln in lines if ln.startswith("USER ")]
    assert users == ["USER ray"]  # not root
    cmd = json.loads(lines[-1].removeprefix("CMD "))
    assert cmd[:3] == ["python", "-m", "trainers.demo"]
    parse_args(cmd[3:])  # the real entry point accepts exactly these flags
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        ignored = f.read().split()
    assert ".venv" in ignored and ".git" in ignored


def test_compose_runs_a_head_a_worker_node_and_the_demo_beside_the_head():
    with open(os.path.join(ROOT, "docker", "compose.yaml")) as f:
        compose = yaml.safe_load(f)
    services = compose["services"]
    assert set(services) == {"ray-head", "ray-worker", "demo"}
    head = services["ray-head"]["command"].split()
    assert head[:3] == ["ray", "start", "--head"] and "--port=6379" in head
    assert "--address=ray-head:6379" in services["ray-worker"]["command"].split()
    demo = services["demo"]
    cmd = shlex.split(demo["command"])
    assert cmd[:3] == ["python", "-m", "trainers.demo"]
    args = parse_args(cmd[3:])
    assert args.address == "auto" and args.spread and args.min_nodes == 2
    # a driver needs its own node's raylet: the demo lives in the head's namespaces
    for key in ("network_mode", "pid", "ipc"):
        assert demo[key] == "service:ray-head", key
    assert (
        "ray-tmp:/tmp/ray" in demo["volumes"]
        and "ray-tmp:/tmp/ray" in (services["ray-head"]["volumes"])
    )
    for svc in services.values():
        assert "ports" not in svc  # nothing published on the host
        assert svc["build"]["dockerfile"] == "docker/Dockerfile"
        assert os.path.exists(
            os.path.join(ROOT, "docker", svc["build"]["context"], "pyproject.toml")
        )
