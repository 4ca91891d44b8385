"""The four reference trainers, profiled end to end, and unchanged by profiling."""

import asyncio
import json
import os
import uuid

import pytest

from coordinator.client.step_client import wait_for_traces
from coordinator.core.schedule import Schedule
from coordinator.ops import notebook as nb
from coordinator.ops.cli import main as cli_main
from tests.configs import profiler_config
from tests.no_false_alarm import assert_no_false_alarm, from_cli, in_process
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


def trainer_config(tmp_path, kind="sft"):
    """Every policy rank; and for the RL trainers, generation worker 0 (role ``rollout``)."""
    roles = {} if kind == "sft" else {"rollout": {"ranks": [0]}}
    # top_k 200: every op in the summaries, so a small one (the sampling) is never cut
    return profiler_config(
        tmp_path, skip_first=1, wait=1, warmup=1, active=2, repeat=2, roles=roles, top_k=200
    )


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
    cfg = trainer_config(tmp_path, kind)
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    hooks = ProfilingHooks.attach(
        cfg, policy, trainer_id=kind, name=name, namespace="profiler-tests"
    )
    try:
        on = run(kind, hooks, policy, rollouts, rc)
        assert hooks.enabled, hooks.disabled_reason
        status = ray.get(hooks.coordinator.status.remote())
        tables = [
            ray.get(hooks.coordinator.kernel_summary.remote(window=w["index"], top_k=1000))
            for w in status["windows"]
        ]
        gen_tables = [
            ray.get(
                hooks.coordinator.kernel_summary.remote(
                    window=w["index"], role="rollout", top_k=1000
                )
            )
            for w in status["windows"]
            if kind != "sft"
        ]
        where = ["--name", name, "--namespace", "profiler-tests"]
        if kind != "sft":  # the CLI shows a role's own table
            assert cli_main(["top", "--role", "rollout", *where]) == 0
            assert "rollout ranks [0]" in capsys.readouterr().out.splitlines()[0]
        phases = ray.get(hooks.coordinator.phase_times.remote(last=100))
        assert cli_main(["phases", *where]) == 0
        table = capsys.readouterr().out
        ray.get(hooks.coordinator.flush_record.remote(30.0))  # (written off the loop)
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

    # The exact trace files, per window, per role, per rank: the policy's ranks, and the
    # rollout's rank 0 on the same global steps (its worker 1 is not selected).
    windows = [w for w in Schedule(cfg).windows(limit=10) if w.last < STEPS]
    expected = [f"window_{w.index:04d}_steps_{w.first}-{w.last}" for w in windows]
    roles = ["policy"] if kind == "sft" else ["policy", "rollout"]
    assert sorted(os.listdir(tmp_path / "run")) == ["record", *expected]
    for d in expected:
        assert sorted(os.listdir(tmp_path / "run" / d)) == roles
        assert sorted(os.listdir(tmp_path / "run" / d / "policy")) == [
            "rank0.pt.trace.json",
            "rank1.pt.trace.json",
        ]
    # The ranks form a gloo group, so each trace names its rank in distributedInfo (for HTA).
    for r in (0, 1):
        with open(tmp_path / "run" / expected[0] / "policy" / f"rank{r}.pt.trace.json") as f:
            info = json.load(f)["distributedInfo"]
        assert info["rank"] == r and info["world_size"] == 2 and info["backend"] == "gloo"
    # Windows aligned across ranks, summaries aggregated with every rank present.
    assert [(w["steps"], w["ranks"]) for w in status["windows"]] == [
        ([w.first, w.last], [0, 1]) for w in windows
    ]
    for t in tables:
        assert t["ranks"] == [0, 1] and t["kernels"] and not t["bad_ranks"]
        assert t["role"] == "policy" and "aten::multinomial" not in names(t)
    if kind != "sft":
        check_rollout_role(tmp_path / "run", expected, status, gen_tables, kind)
    # RPCs to workers only inside windows: one start and one call per warm-up/record step.
    c = status["counters"]
    per_window = 1 + cfg.warmup + cfg.active
    n = 2 if kind == "sft" else 3  # the policy's two ranks, and rollout rank 0
    assert c["worker_rpcs_configure_profiler"] == n
    assert c["worker_rpcs_start_profile"] == n * len(windows)
    assert c["worker_rpcs_profile_step"] == n * len(windows) * (per_window - 1)
    late = c.get("worker_rpcs_dump_profiler_summary", 0)  # only stop() collects stragglers
    assert c["worker_rpcs"] == n + n * len(windows) * per_window + late
    assert status["global_step"] == STEPS - 1
    states = {(r["trainer_id"], r["rank"]): r["state"] for r in status["ranks"]}
    assert {st for (tid, _), st in states.items() if tid == kind} == {"ok"}
    if kind == "fully-async":  # its second generation worker is registered, not profiled
        assert states[(f"{kind}.rollout", 1)] == "not_selected"
    # No false alarm (issue 57, item 5): each window's findings, each role, from the record.
    record = from_cli(in_process, ["--from", str(tmp_path / "run" / "record")])
    assert_no_false_alarm(record, [w["index"] for w in status["windows"]], roles)


def names(table):
    return {k["name"] for k in table["kernels"]}


def check_rollout_role(run_dir, expected, status, gen_tables, kind):
    """Generation rank 0 was profiled on the policy's steps, in its own directory and table."""
    for d, w in zip(expected, status["windows"], strict=True):
        assert os.listdir(run_dir / d / "rollout") == ["rank0.pt.trace.json"]
        with open(run_dir / d / "rollout" / "rank0.pt.trace.json") as f:
            trace = json.load(f)
        # not in a process group: the rank and role are put in distributedInfo for HTA
        assert trace["distributedInfo"] == {"backend": "none", "rank": 0, "role": "rollout"}
        ops = {e.get("name") for e in trace["traceEvents"]}
        assert "aten::multinomial" in ops, kind  # the sampling ran inside the window
        (gen,) = [p for p in w["roles"].values() if p["role"] == "rollout"]
        assert gen["ranks"] == [0] and gen["trace_dir"] == str(run_dir / d / "rollout")
        assert gen["busy_ms_per_step"] > 0
        assert sorted(gen["step_ms"]) == list(range(w["steps"][0], w["steps"][1] + 1))
    frame = nb.roles_frame(status)  # roles x steps, side by side on the same global steps
    recorded = [s for w in status["windows"] for s in range(w["steps"][0], w["steps"][1] + 1)]
    assert list(frame.index) == ["policy", "rollout"] and list(frame.columns) == recorded
    assert (frame > 0).all().all()
    for t in gen_tables:
        assert t["role"] == "rollout" and t["ranks"] == [0] and not t["bad_ranks"]
        assert "aten::multinomial" in names(t)


@pytest.mark.parametrize("style", ["sglang", "vllm"])
def test_an_engine_with_its_own_profiler_is_a_rank_through_the_adapter(
    ray_session, actors, tmp_path, style
):
    """Sync RL whose generation runs in a small engine with start_profile()/stop_profile():
    the engine writes its own trace, the adapter puts it in the window's rollout directory,
    and the node agent builds the rollout's table from it."""
    from trainers.reference.engine import make_engine_rollouts

    ray = ray_session
    policy, _ = actors
    fixed = str(tmp_path / "engine-traces") if style == "vllm" else None
    (engine,) = make_engine_rollouts(1, fixed)
    reset_workers(policy, [engine], seed=0)
    export = "chrome_trace_gz" if style == "vllm" else "chrome_trace"
    cfg = trainer_config(tmp_path, "rl")
    cfg.export_type = export
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    hooks = ProfilingHooks.attach(
        cfg, policy, trainer_id="eng", name=name, namespace="profiler-tests"
    )
    try:
        with pytest.raises(ValueError, match="role must be 1-64 letters"):
            hooks.add_role("a/b", [engine])
        assert ProfilingHooks.attach(None, workers=[]).add_role("rollout", [engine]) is None
        run_sync_rl(hooks, policy, engine, RunConfig(steps=STEPS))
        assert wait_for_traces(hooks.coordinator, timeout_s=60) == []
        status = ray.get(hooks.coordinator.status.remote())
        table = ray.get(
            hooks.coordinator.kernel_summary.remote(window=1, role="rollout", top_k=1000)
        )
        written = ray.get(engine.traces_written.remote())
    finally:
        ray.kill(hooks.coordinator)
        ray.kill(engine)
    gen = {(r["trainer_id"], r["rank"]): r for r in status["ranks"]}[("eng.rollout", 0)]
    assert gen["state"] == "ok" and gen["device"] == "engine" and gen["windows_captured"] == 2
    assert written == 2  # one engine trace a window, from its first recorded step to its last
    for w in status["windows"]:
        (part,) = [p for p in w["roles"].values() if p["role"] == "rollout"]
        assert part["ranks"] == [0] and part["traces"][0]["error"] is None, part
        # SGLang's gzipped trace is kept as it is; vLLM's plain one is compressed by the agent
        assert os.listdir(part["trace_dir"]) == ["rank0.pt.trace.json.gz"]
        assert part["traces"][0]["path"] == os.path.join(
            part["trace_dir"], "rank0.pt.trace.json.gz"
        )
    assert table["role"] == "rollout" and table["ranks"] == [0] and not table["bad_ranks"]
    assert "aten::multinomial" in names(table) and table["steps"] == status["windows"][1]["steps"]
    if fixed:
        assert os.listdir(fixed) == []  # moved out of the engine's directory, nothing left
