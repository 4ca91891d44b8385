"""``engine: kineto`` on a real Ray cluster: two rank actors started with ``kineto_env()``, the
node agent playing libkineto's daemon, windows on the planned steps on both ranks and their
summaries in the cross-rank table."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid

import pytest

from worker_ext import kineto_env

pytestmark = pytest.mark.ray
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def kineto_ranks(ray_session):
    kdir = tempfile.mkdtemp(prefix="kt-", dir="/tmp")
    from tests.ray_workers import ToyWorker

    env = {"env_vars": kineto_env(os.path.join(kdir, "k"))}
    ranks = [ray_session.remote(num_cpus=0, runtime_env=env)(ToyWorker).remote() for _ in range(2)]
    yield ranks
    for h in ranks:
        with contextlib.suppress(Exception):
            ray_session.kill(h)
    shutil.rmtree(kdir, ignore_errors=True)


def test_two_ranks_on_kineto_record_the_planned_steps_into_the_cross_rank_table(
    ray_session, kineto_ranks, tmp_path
):
    from trainers.hooks import ProfilingHooks

    ray = ray_session
    # libkineto's clients poll once a second: a warm-up of 10 steps of 0.25 s is the lead the
    # config needs to reach both ranks before the window's first step.
    cfg = {"enable": True, "save_path": str(tmp_path), "ranks": "all", "engine": "kineto",
           "skip_first": 4, "wait": 2, "warmup": 10, "active": 3, "repeat": 2,
           "export_type": "chrome_trace", "run_name": "kineto-run"}  # fmt: skip
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    hooks = ProfilingHooks.attach(
        cfg, kineto_ranks, trainer_id="sft", name=name, namespace="profiler-tests"
    )
    coord = hooks.coordinator
    try:
        with hooks.session(first_step=0):
            for k in range(36):
                ray.get([w.train_step.remote(1, 0.25) for w in kineto_ranks])
                hooks.step(k)
        planned = [(16, 18), (31, 33)]  # skip 4, wait 2, warm-up 10, 3 recorded
        for i, (first, last) in enumerate(planned):
            done = ray.get(coord.wait_window.remote(i, timeout_s=120))
            assert done["done"], done
            table = ray.get(coord.kernel_summary.remote(i, 100_000, None, False))
            assert table["ranks"] == [0, 1] and table["bad_ranks"] == {}, table["bad_ranks"]
            assert table["steps"] == [first, last] and not table["partial"], table
            addmm = {k["name"]: k for k in table["kernels"]}["aten::addmm"]
            assert (
                addmm["ranks_present"] == 2 and addmm["count"] == 2 * 3 * 2
            )  # 2 ranks, 3 steps, 2 Linear
            for r in (0, 1):
                path = tmp_path / "kineto-run" / f"window_{i:04d}_steps_{first}-{last}"
                with open(path / "policy" / f"rank{r}.pt.trace.json") as f:
                    doc = json.load(f)
                assert doc["rank"] == r and doc["distributedInfo"]["rank"] == r
                steps = {
                    e["name"] for e in doc["traceEvents"] if e["name"].startswith("ProfilerStep#")
                }
                assert {f"ProfilerStep#{s}" for s in range(first, last + 1)} <= steps
        status = ray.get(coord.status.remote())
        assert status["config"]["engine"] == "kineto"
    finally:
        ray.kill(coord)


@pytest.mark.subprocess
def test_the_documented_runtime_env_works_on_a_cold_second_node():
    """Ranks on a second node whose ``<tmp>`` has no daemon directory when they import torch:
    the setup hook ``kineto_env()`` names makes it first, and both windows come whole."""
    got = subprocess.run(
        [sys.executable, "-m", "tests.scripts.kineto_cold_node"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "RAY_AUTH_MODE": "disabled"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [x for x in got.stdout.splitlines() if x.startswith("RESULT ")]
    assert got.returncode == 0 and lines, got.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["cold"] and out["dir_mode"] == "0o700", out
    *windows, placed = out["windows"]
    assert placed == {"nodes": [out["node2"]]}, out
    for w, steps in zip(windows, [[16, 18], [31, 33]], strict=True):
        assert w["done"] and w["ranks"] == [0, 1] and w["bad"] == {}, w
        assert w["steps"] == steps and not w["partial"], w
        assert w["addmm"] == [2, 2 * 3 * 2], w  # 2 ranks, 3 steps, 2 Linear


@pytest.mark.subprocess
def test_kineto_env_never_replaces_the_job_s_own_setup_hook_in_an_actor():
    """A job with a ``worker_process_setup_hook`` of its own: ``kineto_env()`` leaves Ray's
    hook variable out and says the job's hook should call ``kineto_setup()``; the actor ran the
    job's hook (which made the directory on its node) and has libkineto's variables."""
    kdir = tempfile.mkdtemp(prefix="kt-", dir="/tmp")
    try:
        got = subprocess.run(
            [sys.executable, "-m", "tests.scripts.kineto_job_hook", kdir],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT, "RAY_AUTH_MODE": "disabled"},
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        shutil.rmtree(kdir, ignore_errors=True)
    lines = [x for x in got.stdout.splitlines() if x.startswith("RESULT ")]
    assert got.returncode == 0 and lines, got.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR" not in out["env"], out
    assert out["actor"] == {"JOB_HOOK_RAN": "1", "KINETO_USE_DAEMON": "1",
                            "KINETO_IPC_SOCKET_DIR": os.path.join(kdir, "k")}, out  # fmt: skip
    assert out["made"], out  # (by the job's hook, in the actor's process)
    warned = [x for x in got.stderr.splitlines() if "leaves Ray's setup hook variable out" in x]
    assert len(warned) == 1 and "tests.scripts.kineto_job_hook.job_hook" in warned[0], warned
    assert "kineto_setup()" in warned[0], warned
