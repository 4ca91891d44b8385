"""The four reference trainers, profiled end to end, and unchanged by profiling."""

import asyncio
import json
import os
import uuid

import pytest

from coordinator.core.schedule import Schedule
from coordinator.ops.cli import main as cli_main
from tests.configs import profiler_config
from trainers.hooks import ProfilingHooks
from trainers.reference.loops import (
    RunConfig,
    reset_workers,
    run_fully_async_rl,
    run_one_step_async_rl,
    run_sft,
    run_sync_rl,
)
from trainers.reference.workers import make_policy_group, make_rollouts

STEPS = 9  # windows: warm-up 2, record 3-4; warm-up 6, record 7-8


@pytest.fixture(scope="module")
def actors(ray_session):
    policy = make_policy_group(2)
    rollouts = make_rollouts(2)
    yield policy, rollouts
    for h in policy + rollouts:
        ray_session.kill(h)


def trainer_config(tmp_path):
    return profiler_config(tmp_path, skip_first=1, wait=1, warmup=1, active=2, repeat=2)


def run(kind, hooks, policy, rollouts, rc):
    if kind == "sft":
        return run_sft(hooks, policy, rc)
    if kind == "rl":
        return run_sync_rl(hooks, policy, rollouts[0], rc)
    if kind == "async":
        return asyncio.run(run_one_step_async_rl(hooks, policy, rollouts[0], rc))
    return asyncio.run(run_fully_async_rl(hooks, policy, rollouts, rc))


@pytest.mark.parametrize("kind", ["sft", "rl", "async", "fully-async"])
def test_trainer_is_profiled_end_to_end_and_unchanged(ray_session, actors, tmp_path, kind, capsys):
    ray = ray_session
    policy, rollouts = actors
    rc = RunConfig(steps=STEPS)
    reset_workers(policy, rollouts, seed=0)
    off = run(kind, ProfilingHooks.attach({"enable": False}, policy), policy, rollouts, rc)

    reset_workers(policy, rollouts, seed=0)
    cfg = trainer_config(tmp_path)
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    hooks = ProfilingHooks.attach(
        cfg, policy, trainer_id=kind, name=name, namespace="profiler-tests"
    )
    try:
        on = run(kind, hooks, policy, rollouts, rc)
        assert hooks.enabled, hooks.disabled_reason
        status = ray.get(hooks.coordinator.status.remote())
        tables = [
            ray.get(hooks.coordinator.kernel_summary.remote(window=w["index"]))
            for w in status["windows"]
        ]
        phases = ray.get(hooks.coordinator.phase_times.remote(last=100))
        assert cli_main(["phases", "--name", name, "--namespace", "profiler-tests"]) == 0
        table = capsys.readouterr().out
    finally:
        ray.kill(hooks.coordinator)

    # Training is the same with and without profiling.
    if kind in ("sft", "rl", "async"):
        assert on.values == off.values  # bit for bit: same seeds, same data, same weights
    else:
        # Fully async: which batch lands in which step depends on timing. What is deterministic:
        # every sample generated from the initial weights (keyed by worker and request), the
        # number of updates, and that no batch beyond the staleness limit is trained on.
        v0_on, v0_off = on.extra["version0_rewards"], off.extra["version0_rewards"]
        common = set(v0_on) & set(v0_off)
        assert {"0:0", "1:0"} <= common
        assert all(v0_on[k] == v0_off[k] for k in common)
        for r in (on, off):
            assert r.extra["final_version"] == STEPS and len(r.values) == STEPS
            versions = [v for _, _, v in r.extra["used"]]
            assert all(step - v <= rc.max_staleness for step, v in enumerate(versions))
    # Every step's phase times came with the reports: the regions the trainer marks, adding up
    # to its wall time (the trainer's own work between two reports) within 5%.
    assert [s["step"] for s in phases["steps"]] == list(range(STEPS))
    marked = {"train"} if kind == "sft" else {"generate", "train", "weight_sync"}
    assert {r["region"] for r in phases["regions"]} == marked
    for s in phases["steps"]:
        assert s["other_ms"] <= 0.05 * s["wall_ms"], s
    assert f"the last {STEPS} steps (0-{STEPS - 1})" in table and "\ntrain " in table
    # ... and it learns.
    if kind == "sft":
        assert on.values[-1] < on.values[0] - 1.0
    else:
        assert sum(on.values[-3:]) / 3 > sum(on.values[:3]) / 3 + 0.05

    # The exact trace files, per window, per rank.
    windows = [w for w in Schedule(cfg).windows(limit=10) if w.last < STEPS]
    expected = [f"window_{w.index:04d}_steps_{w.first}-{w.last}" for w in windows]
    assert sorted(os.listdir(tmp_path / "run")) == expected
    for d in expected:
        assert sorted(os.listdir(tmp_path / "run" / d)) == [
            "rank0.pt.trace.json",
            "rank1.pt.trace.json",
        ]
    # The ranks form a gloo group, so each trace names its rank in distributedInfo (for HTA).
    for r in (0, 1):
        with open(tmp_path / "run" / expected[0] / f"rank{r}.pt.trace.json") as f:
            info = json.load(f)["distributedInfo"]
        assert info["rank"] == r and info["world_size"] == 2 and info["backend"] == "gloo"
    # Windows aligned across ranks, summaries aggregated with every rank present.
    assert [(w["steps"], w["ranks"]) for w in status["windows"]] == [
        ([w.first, w.last], [0, 1]) for w in windows
    ]
    for t in tables:
        assert t["ranks"] == [0, 1] and t["kernels"] and not t["bad_ranks"]
    # RPCs to workers only inside windows: one start and one call per warm-up/record step.
    c = status["counters"]
    per_window = 1 + cfg.warmup + cfg.active
    assert c["worker_rpcs_configure_profiler"] == 2
    assert c["worker_rpcs_start_profile"] == 2 * len(windows)
    assert c["worker_rpcs_profile_step"] == 2 * len(windows) * (per_window - 1)
    late = c.get("worker_rpcs_dump_profiler_summary", 0)  # only stop() collects stragglers
    assert c["worker_rpcs"] == 2 + 2 * len(windows) * per_window + late
    assert status["global_step"] == STEPS - 1
    assert {r["state"] for r in status["ranks"]} == {"ok"}
