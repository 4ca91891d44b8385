"""Jobs we did not write, run unchanged: TRL's GRPOTrainer, a Hugging Face Trainer, a Lightning
Trainer (each on 2 Ray Train workers) and a single controller with two policy actors. Only the
job's ``runtime_env`` names the setup hook. Each job runs twice on one private cluster, with and
without it: the losses are bit-identical, and with it a scheduled window and an operator's
capture land on the same optimizer steps on both ranks, with a trace per rank and the
cross-rank table; every rank's stack is read while it runs; the web view serves the ranks and
the tables; and the single controller's coordinator is killed mid-run, restarted by Ray."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.test_cluster import ray_head

pytestmark = pytest.mark.subprocess
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Window 0 records optimizer steps 5-7 (warm-up at 4); the operator's capture comes later.
SCHEDULE = "skip_first: 4, warmup: 1, active: 3, repeat: 1, ranks: all, activities: [cpu]"
ACTOR = {"hf": "RayTrainWorker", "lightning": "RayTrainWorker", "trl": "RayTrainWorker",
         "single": "PolicyWorker"}  # fmt: skip
NEEDS = {"hf": "transformers", "lightning": "lightning", "trl": "trl", "single": "torch"}


@pytest.fixture(scope="module")
def head():
    with ray_head(dashboard=True) as h:  # (Ray's job server, for `ray job submit`)
        yield h


def _run(head, args, tmp_path, config=None, timeout=500, **extra):
    env = {**head["env"], "PYTHONPATH": ROOT, "PACE_S": "0.1", **extra}
    if config is not None:
        env["RAY_PROFILER_CONFIG"] = config
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


@pytest.mark.parametrize("job", ["trl", "hf", "lightning", "single"])
def test_an_unchanged_job_is_profiled_on_the_same_optimizer_steps_on_every_rank(
    head, tmp_path, job
):
    pytest.importorskip(NEEDS[job])
    name = f"attach-{job}"
    config = f"{{enable: true, save_path: {tmp_path / 'p'}, {SCHEDULE}, attach: {{name: {name}}}}}"
    restart = ["--restart"] if job == "single" else []
    longer = {"GLOBAL_STEPS": "60"} if restart else {}  # (room for the restart, then a capture)
    _run(head, ["tests.scripts.attach_job", job, str(tmp_path / "plain")], tmp_path, **longer)
    _run(head, ["tests.scripts.attach_operator", job, str(tmp_path / "hook"), name, *restart],
         tmp_path, config, **longer)  # fmt: skip
    report = json.loads((tmp_path / "hook" / "operator.json").read_text())
    st, cap = report["status"], report["capture"]
    assert cap["accepted"], cap
    windows = {w["index"]: w for w in st["windows"]}
    assert [w["steps"] for w in st["windows"] if w["kind"] == "scheduled"] == [[5, 7]]
    assert windows[cap["window"]]["steps"] == cap["steps"] and cap["steps"][0] > 8
    for w in st["windows"]:
        assert (w["rank_count"], w["partial"], w["reason"]) == (2, False, None), w
        for rank in ("0", "1"):
            assert os.path.getsize(w["traces"][rank]["path"]) > 0
    for table in report["tables"].values():
        assert table["ranks"] == [0, 1] and table["kernels"], table
    stacks = report["stacks"]  # (read while the job ran)
    read = sorted(e["rank"] for e in stacks["entries"] if e["who"] == "rank" and e["stack"])
    assert read == [0, 1], stacks["unreadable"]
    web, last = report["web"], st["windows"][-1]["index"]
    assert {r["attached"]["actor_class"] for r in web["/api/status"]["ranks"]} == {ACTOR[job]}
    assert web[f"/api/windows/{last}/kernels?top_k=5"]["ranks"] == [0, 1]
    assert st["restarts"] == (1 if restart else 0)
    assert st["attach_problems"] == []
    for r in st["ranks"]:
        a = r["attached"]
        assert a["actor_class"] == ACTOR[job] and a["job_id"] and a["node_id"] and a["pid"] > 0
        assert a["source"] == ("actor" if job == "single" else "torch.distributed")
    plain = json.loads((tmp_path / "plain" / "losses.json").read_text())
    hooked = json.loads((tmp_path / "hook" / "losses.json").read_text())
    assert len(plain) >= 20 and hooked == plain


def test_two_optimizers_a_stray_thread_and_a_fork_are_said_and_training_goes_on(head, tmp_path):
    config = f"{{enable: true, save_path: {tmp_path / 'p'}, {SCHEDULE}, attach: {{name: faults}}}}"
    _run(head, ["tests.scripts.attach_faults", "faults", str(tmp_path), "faults"], tmp_path,
         config)  # fmt: skip
    report = json.loads((tmp_path / "faults.json").read_text())
    st = report["status"]
    assert report["child"] == 0 and len(report["losses"]) == 17  # the forked child exited well
    # The windows count the first optimizer's steps: the second's and the stray thread's are
    # not steps (the window would be [3, 4] if every optimizer step counted).
    assert [(w["steps"], w["rank_count"], w["partial"]) for w in st["windows"]] == [
        ([5, 7], 1, False)
    ]
    problems = [(p["trainer_id"], p["rank"], p["problem"]) for p in st["attach_problems"]]
    assert sorted(problems) == [
        ("attached.TwoOptimizers", 0, "a second optimizer (SGD) steps in this process: the "
         "windows count the steps of the first one (Adam) only"),
        ("attached.TwoOptimizers", 0, "an optimizer (Adam) stepped on another thread than the "
         "training thread: its steps are not counted and never touch the profiler"),
    ]  # fmt: skip


def test_a_bad_config_is_in_status_and_the_job_trains_unprofiled(head, tmp_path):
    _run(head, ["tests.scripts.attach_faults", "bad-config", str(tmp_path), "profiler"],
         tmp_path, "{enable: true, warmup: [")  # fmt: skip
    report = json.loads((tmp_path / "faults.json").read_text())
    st = report["status"]
    assert len(report["losses"]) == 17 and st["ranks"] == []
    (problem,) = st["attach_problems"]
    assert "RAY_PROFILER_CONFIG (YAML text) is not valid YAML" in problem["problem"]
    assert problem["actor_class"] == "TwoOptimizers" and problem["pid"] > 0


def promised(module: str) -> None:
    """Skip without ``module``, saying so, unless ``make test`` promised it: the Makefile
    installs SkyRL in the venv and sets ``$RAY_PROFILER_EXTRAS_PROMISED``, and then a missing
    module fails the test instead of hiding it among the skips."""
    try:
        __import__(module)
    except ImportError as exc:
        if os.environ.get("RAY_PROFILER_EXTRAS_PROMISED"):
            pytest.fail(f"{module} is not installed, though `make test` installs it ({exc})")
        pytest.skip(f"{module} is not installed (`make venv` installs it)")


def test_skyrl_own_profiler_calls_drive_the_coordinator_with_the_switch(head, tmp_path):
    promised("skyrl")
    _run(head, ["tests.scripts.skyrl_job", str(tmp_path / "plain")], tmp_path)
    _run(head, ["tests.scripts.skyrl_job", str(tmp_path / "hook"), "--hook", "skyrl-attach"],
         tmp_path)  # fmt: skip
    plain = json.loads((tmp_path / "plain" / "skyrl.json").read_text())
    hooked = json.loads((tmp_path / "hook" / "skyrl.json").read_text())
    # Without the hook SkyRL is as shipped: its own torch.profiler wrote one window per rank.
    assert plain["profiler"] == "skyrl.backends.skyrl_train.utils.profiler.Profiler"
    assert [s["window_count"] for s in plain["summaries"]] == [1, 1]
    assert hooked["profiler"] == "worker_ext.rank.skyrl_profiler.SkyRLProfiler"
    st = hooked["status"]
    # SkyRL's schedule (skip 2, warm-up 1, record 2), counted in its global steps from 0;
    # each global step ran two optimizer steps: the window and its table say both.
    assert [(w["steps"], w["rank_count"], w["partial"]) for w in st["windows"]] == [
        ([3, 4], 2, False)
    ]
    (part,) = st["windows"][0]["roles"].values()
    assert part["optimizer_steps"] == [7, 10] and hooked["table"]["optimizer_steps"] == [7, 10]
    assert {(r["trainer_id"], r["attached"]["source"]) for r in st["ranks"]} == {
        ("skyrl.PolicyStandIn", "torch.distributed")
    }
    for summary in hooked["summaries"]:  # SkyRL's shape, from the coordinator's table
        assert summary["window_count"] == 1
        names = {name for name, us in summary["pairs"] if us > 0}
        assert "Optimizer.step#SGD.step" in names and "aten::addmm" in names, summary
    assert hooked["losses"] == plain["losses"] and len(plain["losses"]) == 16


SETTLED = """
import json, sys, ray
ray.init(address="auto", log_to_driver=False)
coord = ray.get_actor(sys.argv[1], namespace="profiler")
for w in ray.get(coord.status.remote())["windows"]:
    ray.get(coord.wait_window.remote(w["index"], timeout_s=60))
st = ray.get(coord.status.remote())
st["phase_times"] = ray.get(coord.phase_times.remote(last=100))
json.dump(st, open(sys.argv[2], "w"), default=str)
ray.kill(coord)
"""


def test_a_ray_train_group_restarted_from_its_checkpoint_counts_on_from_its_optimizer(
    head, tmp_path
):
    """A plain DDP job with AdamW loses rank 1 after optimizer step 20; Ray Train restarts the
    group from its last checkpoint, which restores the optimizer's state. The new processes
    count on from the optimizer's own step count: the schedule's windows land on the same
    optimizer steps as in a run with no failure, on both ranks, and the run ends on step 40."""
    name = "attach-resume"
    schedule = "skip_first: 4, wait: 4, warmup: 1, active: 2, repeat: 0, ranks: all"
    config = f"{{enable: true, save_path: {tmp_path / 'p'}, {schedule}, activities: [cpu], " \
             f"attach: {{name: {name}}}}}"  # fmt: skip
    out = tmp_path / "job"
    _run(head, ["tests.scripts.attach_job", "resume", str(out), "--hook"], tmp_path, config,
         FAIL_AT="20")  # fmt: skip
    assert (out / "failed-once").exists()  # (rank 1 was lost once)
    proc = subprocess.run([sys.executable, "-c", SETTLED, name, str(tmp_path / "status.json")],
                          cwd=ROOT, env=head["env"], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    st = json.loads((tmp_path / "status.json").read_text())
    got = [(w["steps"], w["rank_count"], w["partial"]) for w in st["windows"]]
    assert all((n, partial) == (2, False) for _, n, partial in got), got
    # Resumed from step 10, the group ran steps 11-20 again, window [16, 17] included; from
    # step 15 or 20, the next window is [23, 24]. Counted from 1, [9, 10] would come again.
    before, again = [[9, 10], [16, 17]], [[16, 17]] if len(got) == 6 else []
    assert [w[0] for w in got] == before + again + [[23, 24], [30, 31], [37, 38]], got
    assert st["global_step"] == 40 and st["attach_problems"] == []
    # Rank 0's wall time of each step (a compact run of them a report), from its second
    # optimizer step on; the first step after the restart attached again (untimed), and the
    # steps the new group ran again were timed already.
    steps = [s["step"] for s in st["phase_times"]["steps"]]
    assert steps == sorted(set(steps)) and (steps[0], steps[-1]) == (2, 40) and len(steps) >= 38
    assert sorted(r["rank"] for r in st["ranks"]) == [0, 1]


MISSING = """
import ray
ray.init(address="auto", log_to_driver=True, runtime_env={
    "worker_process_setup_hook": "worker_ext_not_installed.attach.setup"})
@ray.remote(max_retries=0)
def f():
    return 1
try:
    ray.get(f.remote(), timeout=120)
except Exception as exc:
    print("RAISED", type(exc).__name__, exc)
"""


def test_a_hook_module_the_workers_cannot_import_fails_as_the_docs_say(head, tmp_path):
    """What docs/attach.md tells a user whose workers cannot import the hook's module (the
    project is installed in this venv, so a module that does not exist stands for it)."""
    proc = subprocess.run([sys.executable, "-c", MISSING], cwd=tmp_path, env=head["env"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert "RAISED WorkerCrashedError" in out and "The worker died unexpectedly" in out, out[-3000:]
    assert "ModuleNotFoundError: No module named 'worker_ext_not_installed'" in out
    assert "load_and_execute_setup_hook_module" in out


SUBMITTED = """
import json, sys
import ray
from trainers.reference.unchanged import single_controller  # (imports nothing of the project)
ray.init()
json.dump(single_controller(12), open(sys.argv[1], "w"))
print("JOB-DONE")
"""


ENDED = """
import json, sys, time, ray
ray.init(address="auto", log_to_driver=False)
coord = ray.get_actor(sys.argv[1], namespace="profiler")
deadline = time.monotonic() + 90
while True:
    st = ray.get(coord.status.remote())
    if st["run"]["lifecycle"] == "stopped" or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps({"run": st["run"], "stalls": st["stalls"]}, default=str))
"""


def test_ray_job_submit_with_the_runtime_env_json_attaches_and_the_cli_reads_it(head, tmp_path):
    """``ray job submit --runtime-env-json '{"worker_process_setup_hook": ...}' -- python ...``;
    once the job has ended, its run ends (no stall is taken on its gone processes); then an
    operator's ``ray-profiler status`` and ``collect`` of the window, from the CLI."""
    name = "attach-submit"
    config = f"{{enable: true, save_path: {tmp_path / 'p'}, {SCHEDULE}, stall_min_s: 5, " \
             f"attach: {{name: {name}}}}}"  # fmt: skip
    runtime_env = {"worker_process_setup_hook": "worker_ext.attach.setup",
                   "env_vars": {"RAY_PROFILER_CONFIG": config, "PYTHONPATH": ROOT,
                                "RAY_AUTH_MODE": "disabled"}}  # fmt: skip
    submit = ["ray.scripts.scripts", "job", "submit", "--address", head["dashboard"],
              "--runtime-env-json", json.dumps(runtime_env), "--", sys.executable, "-c",
              SUBMITTED, str(tmp_path / "losses.json")]  # fmt: skip
    out = _run(head, submit, tmp_path).stdout
    assert "JOB-DONE" in out and len(json.loads((tmp_path / "losses.json").read_text())) == 24
    proc = subprocess.run([sys.executable, "-c", ENDED, name], cwd=ROOT, env=head["env"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ended = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ended["run"]["lifecycle"] == "stopped" and ended["stalls"] == [], ended
    assert re.fullmatch(r"the job of attached\.PolicyWorker ended after step \d+",
                        ended["run"]["ended_reason"]), ended  # fmt: skip
    cli = ["coordinator", "--name", name]
    st = json.loads(_run(head, [*cli, "status", "--json"], tmp_path).stdout)
    assert [(w["steps"], w["rank_count"]) for w in st["windows"]] == [([5, 7], 2)]
    assert {r["attached"]["actor_class"] for r in st["ranks"]} == {"PolicyWorker"}
    _run(head, [*cli, "collect", "--window", "0", "--to", str(tmp_path / "w0")], tmp_path)
    got = sorted(p.name for p in (tmp_path / "w0").rglob("rank*"))
    assert got == ["rank0.pt.trace.json.gz", "rank1.pt.trace.json.gz"], got
    kill = f"import ray; ray.init(); ray.kill(ray.get_actor({name!r}, namespace='profiler'))"
    subprocess.run([sys.executable, "-c", kill], env=head["env"], timeout=120, check=True)


def test_an_attached_job_that_slows_down_is_captured_by_itself_on_every_rank(head, tmp_path):
    """Auto capture on attached ranks: 20 ms optimizer steps, 100 ms from step 60 on."""
    name = "attach-auto"
    auto = ("{enable: true, after_steps: 5, cooldown_steps: 1000, max_per_run: 1, "
            "ignore_first: 4, baseline_steps: 20}")  # fmt: skip
    config = (f"{{enable: true, save_path: {tmp_path / 'p'}, on_demand_only: true, ranks: all, "
              f"activities: [cpu], auto_capture: {auto}, attach: {{name: {name}}}}}")  # fmt: skip
    _run(head, ["tests.scripts.attach_job", "single", str(tmp_path / "job"), "--hook"], tmp_path,
         config, PACE_S="0.02", GLOBAL_STEPS="90", SLOW_FROM="60", SLOW_S="0.08")  # fmt: skip
    cli = ["coordinator", "--name", name]
    st = json.loads(_run(head, [*cli, "status", "--json"], tmp_path).stdout)
    (w,) = [w for w in st["windows"] if w["kind"] == "auto"]
    assert (w["rank_count"], w["partial"]) == (2, False) and w["steps"][0] > 60, st["windows"]
    assert w["trigger"]["ratio"] > 1.5 and w["trigger"]["step"] >= 60, w["trigger"]
    kill = f"import ray; ray.init(); ray.kill(ray.get_actor({name!r}, namespace='profiler'))"
    subprocess.run([sys.executable, "-c", kill], env=head["env"], timeout=120, check=True)


LAST = """
import json, subprocess, sys, time, ray
ray.init(address="auto", log_to_driver=False)
coord = ray.get_actor(sys.argv[1], namespace="profiler")
t0, deadline = time.monotonic(), time.monotonic() + 120
while ray.get(coord.status.remote())["run"]["lifecycle"] == "running":
    assert time.monotonic() < deadline, "the run did not end with its job"
    time.sleep(0.2)
ended_s = time.monotonic() - t0
st = ray.get(coord.status.remote())
seen = ray.get(coord.phase_times.remote(last=1000))["steps_seen"]
record = ray.get(coord.flush_record.remote(30.0))
ray.kill(coord)
cli = [sys.executable, "-m", "coordinator", "status", "--from", record["dir"], "--json"]
recorded = json.loads(subprocess.run(cli, capture_output=True, text=True, check=True).stdout)
print(json.dumps({"status": st, "seen": seen, "recorded": recorded, "ended_s": ended_s},
                 default=str))
"""


def test_an_attached_job_s_last_steps_and_end_reach_its_run_and_its_record(head, tmp_path):
    """16 global steps of 2 optimizer steps as fast as they go; the driver kills its actors
    (``ray.kill``: nothing runs in them) and exits. Rank 0's node agent reports the steps it
    had not reported, and the run ends with the job, in seconds (the stall threshold, 300 s,
    plays no part), in ``status()`` and in the record."""
    name = "attach-last"
    config = f"{{enable: true, save_path: {tmp_path / 'p'}, {SCHEDULE}, stall_min_s: 300, " \
             f"attach: {{name: {name}}}}}"  # fmt: skip
    _run(head, ["tests.scripts.attach_job", "single", str(tmp_path / "job"), "--hook"], tmp_path,
         config, PACE_S="0", GLOBAL_STEPS="16")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", LAST, name], cwd=ROOT, env=head["env"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    st, recorded = got["status"], got["recorded"]
    why = "the job of attached.PolicyWorker ended after step 32"
    assert (st["global_step"], st["run"]["lifecycle"], st["run"]["ended_reason"]) == (
        32, "stopped", why), st["run"]  # fmt: skip
    assert got["seen"] == 31  # (every optimizer step's wall time but the first, spent attaching)
    assert got["ended_s"] < 60, got["ended_s"]
    assert (recorded["global_step"], recorded["run"]["lifecycle"]) == (32, "stopped")
    assert recorded["run"]["ended_reason"] == why and recorded["record"]["steps"] == 31
    assert st["stalls"] == []
