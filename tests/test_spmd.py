"""SPMD ranks in a real cluster: plain actors running the loop themselves (torchrun-style) and
Ray Train's ``TorchTrainer``, each rank stepping itself through ``RankSession``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from coordinator.ops.collect import collect_window
from tests.configs import ROOT, profiler_config
from trainers.reference.spmd import SpmdRun, SpmdWorker, run_in_actors, run_ray_train

pytestmark = pytest.mark.ray

# cycle of 5: wait 0-1, warm-up 2, record 3-4 | 8-9 | 13-14
WINDOWS = [[3, 4], [8, 9], [13, 14]]


def _config(tmp_path, **kw):
    cfg = profiler_config(tmp_path, wait=2, warmup=1, active=2, repeat=3, **kw)
    return cfg.to_dict()


def _run(name: str, **kw) -> SpmdRun:
    return SpmdRun(name=name, namespace="profiler-tests", **kw)


def _coordinator(ray, name):
    return ray.get_actor(name, namespace="profiler-tests")


def _settled(ray, coord, windows):
    for i in windows:
        assert ray.get(coord.wait_window.remote(i, timeout_s=60))["done"], i
    return ray.get(coord.status.remote())


@pytest.fixture
def spmd_workers(ray_session):
    made = []

    def take(n):
        made.extend(SpmdWorker.remote() for _ in range(n))
        return made[-n:]

    yield take
    for h in made:
        ray_session.kill(h)


def test_ranks_a_few_steps_apart_record_the_same_steps_and_make_one_table(
    ray_session, ray_actors, spmd_workers, tmp_path
):
    ray = ray_session
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    run = _run(name, steps=17, lag_s=0.03, sync=False)  # rank 1 trails rank 0 by steps
    try:
        losses = run_in_actors(_config(tmp_path), run, 2, spmd_workers(2))
    finally:
        ray_actors.append(_coordinator(ray, name))
    assert len(losses) == 2 and all(len(x) == 17 for x in losses)
    coord = _coordinator(ray, name)
    st = _settled(ray, coord, range(3))
    assert [w["steps"] for w in st["windows"]] == WINDOWS
    assert [w["ranks"] for w in st["windows"]] == [[0, 1]] * 3
    assert not any(w["partial"] for w in st["windows"])
    for i in range(3):
        table = ray.get(coord.kernel_summary.remote(window=i))
        assert table["ranks"] == [0, 1] and table["steps"] == WINDOWS[i] and table["kernels"]
    # Each rank wrote its own trace of each window.
    for i, (a, b) in enumerate(WINDOWS):
        d = tmp_path / "run" / f"window_{i:04d}_steps_{a}-{b}" / "policy"
        assert sorted(p.name.split(".")[0] for p in d.iterdir()) == ["rank0", "rank1"], d
    # Nothing on the step path outside windows: each rank told its status once at attach and
    # once per window it closed; rank 0's reports are few (at most every 0.1 s, and on a
    # window's first and last steps).
    counters = st["counters"]
    assert counters["rank_status"] == 2 * (1 + 3)
    assert counters.get("worker_rpcs", 0) == 0  # the coordinator never called a rank
    trainer = st["trainers"][0]
    assert trainer["spmd"] and trainer["world_size"] == 2 and trainer["advances_step"]
    # Rank 0's regions: phase times of every step.
    phases = ray.get(coord.phase_times.remote(last=100))
    assert [s["step"] for s in phases["steps"]] == list(range(17))
    assert {r["region"] for r in phases["regions"]} == {"train"}
    # collect gets every rank's trace of a window through the node agents, as for actor ranks.
    res = collect_window(coord, 1, str(tmp_path / "collected"))
    assert res["missing"] == {} and sorted(res["files"]) == [0, 1]
    # Each rank's stack, read by its node agent (the ranks' actors, found in Ray's table).
    stacks = ray.get(coord.stacks.remote(trainer_id="sft"))
    read = {e["rank"]: e for e in stacks["entries"] if e["who"] == "rank"}
    assert sorted(read) == [0, 1] and all(e["error"] is None for e in read.values()), read


def test_losses_are_bit_identical_with_profiling_on_and_off(
    ray_session, ray_actors, spmd_workers, tmp_path
):
    ray = ray_session
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    run = _run(name, steps=10)
    try:
        on = run_in_actors(_config(tmp_path), run, 2, spmd_workers(2))
    finally:
        ray_actors.append(_coordinator(ray, name))
    off = run_in_actors({"enable": False}, run, 2, spmd_workers(2))
    assert on == off and on[0] == on[1]  # (all-reduced: every rank the same loss)
    assert on[0][-1] < on[0][0]


def _misuse(config: dict, name: str) -> dict:
    """Inside a rank: no rank information; a second session in one process; a step that goes
    backwards. Each is refused with a clear reason, and the loop goes on."""
    import logging

    from worker_ext.rank.rank_session import RankSession

    said: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("worker_ext.rank.rank_session").addHandler(Catch())
    where = {"name": name, "namespace": "profiler-tests", "trainer_id": "sft"}
    nobody = RankSession.attach(config, **where)
    with nobody.session(0):
        for k in range(3):
            with nobody.region("train"):
                pass
            nobody.step(k)
    first = RankSession.attach(config, rank=0, world_size=1, **where)
    second = RankSession.attach(config, rank=0, world_size=1, **where)
    phases = []
    with first.session(0):
        for k in [0, 1, 2, 1, 3, 4, 5]:
            first.step(k)
            second.step(k)
            phases.append(first.phase)
    return {
        "nobody": nobody.disabled_reason,
        "first": first.disabled_reason,
        "second": second.disabled_reason,
        "said": said,
        "phases": phases,
    }


def test_misuse_in_a_rank_is_refused_with_a_reason_and_training_goes_on(
    ray_session, ray_actors, tmp_path
):
    ray = ray_session
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    cfg = profiler_config(tmp_path, wait=0, warmup=1, active=2, repeat=1).to_dict()
    try:
        out = ray.get(ray.remote(num_cpus=0)(_misuse).remote(cfg, name))
    finally:
        ray_actors.append(_coordinator(ray, name))
    assert out["nobody"].startswith("no rank information: not in a Ray Train worker")
    assert out["first"] is None
    assert out["second"].startswith("a RankSession is already attached in this process")
    assert any("step 1 after step 2: steps must go forward; ignored" in s for s in out["said"])
    # the window (warm-up 0, record 1-2) went on regardless of the step that went back
    assert out["phases"] == ["recording", "recording", "idle", "idle", "idle", "idle", "idle"]
    st = _settled(ray_session, _coordinator(ray, name), [0])
    assert [w["steps"] for w in st["windows"]] == [[1, 2]]


@pytest.mark.parametrize("workers", [2, 4])
def test_a_ray_train_job_is_profiled_on_every_worker(ray_session, ray_actors, tmp_path, workers):
    ray = ray_session
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    run = _run(name, steps=10)
    cfg = _config(tmp_path)
    if workers == 2:  # no save_path: the traces go under Ray Train's storage_path
        cfg = {k: v for k, v in cfg.items() if k != "save_path"}
    try:
        losses = run_ray_train(cfg, run, workers, str(tmp_path / "train"))
    finally:
        ray_actors.append(_coordinator(ray, name))
    assert len(losses) == 10 and losses[-1] < losses[0]
    coord = _coordinator(ray, name)
    st = _settled(ray, coord, range(2))
    assert [w["steps"] for w in st["windows"]] == WINDOWS[:2]
    ranks = list(range(workers))
    assert [w["ranks"] for w in st["windows"]] == [ranks, ranks]
    assert ray.get(coord.kernel_summary.remote(window=1))["ranks"] == ranks
    assert st["counters"].get("worker_rpcs", 0) == 0
    listed = {r["rank"]: r for r in st["ranks"]}
    assert sorted(listed) == ranks and all(r["node_id"] for r in listed.values())
    save = tmp_path / "train" / "sft-train" / "profiler" if workers == 2 else tmp_path
    assert st["run_dir"] == str(save / "run")
    d = save / "run" / "window_0000_steps_3-4" / "policy"
    assert sorted(p.name.split(".")[0] for p in d.iterdir()) == [f"rank{r}" for r in ranks]


def test_the_coordinator_killed_mid_run_comes_back_and_the_ranks_go_on(
    ray_session, ray_actors, spmd_workers, tmp_path
):
    """Ray restarts the coordinator; the ranks' reports and closes wait for it, training never
    does, and the windows after the restart are recorded on every rank."""
    import time

    ray = ray_session
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    cfg = profiler_config(tmp_path, wait=2, warmup=1, active=2, repeat=0).to_dict()
    run = _run(name, steps=80, pace_s=0.05)
    workers = spmd_workers(2)
    host, port = ray.get(workers[0].address.remote())
    refs = [w.run.remote(cfg, run, r, 2, host, port) for r, w in enumerate(workers)]
    deadline = time.monotonic() + 120
    while True:  # until the run is past its third window
        assert time.monotonic() < deadline
        try:
            coord = _coordinator(ray, name)
            if (ray.get(coord.status.remote())["global_step"] or 0) >= 12:
                break
        except ValueError:
            pass  # (not created yet)
        time.sleep(0.1)
    ray_actors.append(coord)
    ray.kill(coord, no_restart=False)
    losses = ray.get(refs, timeout=300)
    assert all(len(x) == 80 for x in losses)
    st = ray.get(coord.status.remote())
    assert st["restarts"] == 1 and st["global_step"] == 79
    # The windows while it was away are the host's business (a restart takes 1-5 s here); from
    # 45 steps after the kill (over 2 s of sleeps alone) every window is on both ranks.
    after = [w for w in st["windows"] if w["steps"] and w["steps"][0] >= 57]
    assert [w["steps"] for w in after] == [[58, 59], [63, 64], [68, 69], [73, 74], [78, 79]]
    st = _settled(ray, coord, [w["index"] for w in after])
    for w in after:
        assert ray.get(coord.kernel_summary.remote(window=w["index"]))["ranks"] == [0, 1]


def test_a_ray_train_worker_lost_mid_window_restarts_and_profiling_resumes_on_the_step(
    ray_session, ray_actors, tmp_path
):
    """FailureConfig(max_failures=1): rank 1 dies inside window 2 (steps 13-14); Ray Train
    restarts the group from its last checkpoint; the new ranks attach to the same run; window 2
    is partial, rank 1 lost with the reason; the windows from the checkpoint's step on are
    profiled again, on both ranks."""
    ray = ray_session
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "failed-once"
    run = _run(name, steps=20, checkpoint_every=5, fail_at=13, fail_marker=str(marker))
    try:
        losses = run_ray_train(_config(tmp_path), run, 2, str(tmp_path / "train"))
    finally:
        ray_actors.append(_coordinator(ray, name))
    assert marker.exists() and len(losses) == 20 and losses[-1] < losses[0]
    coord = _coordinator(ray, name)
    st = ray.get(coord.status.remote())
    st = _settled(ray, coord, [w["index"] for w in st["windows"]])
    assert st["run"]["name"] == "run" and st["global_step"] == 19  # one run, on the step
    windows = {w["index"]: w for w in st["windows"]}
    got = [(i, w["steps"], w["partial"], w["reason"]) for i, w in windows.items()]
    assert [windows[i]["steps"] for i in (0, 1)] == [[3, 4], [8, 9]], got
    # The new group resumed from Ray Train's last checkpoint (step 4 or 9): the schedule's
    # windows from there on (repeat 3: the last records 13-14), numbered on after window 2,
    # each on both ranks.
    again = [windows[i]["steps"] for i in sorted(windows) if i > 2]
    assert again in ([[8, 9], [13, 14]], [[13, 14]]), got
    # Rank 1 never told its close: lost. Rank 0 closed its window when its loop raised
    # (the all-reduce with a dead rank), or was killed first: then it is lost too.
    cut = ray.get(coord.kernel_summary.remote(window=2))
    assert cut["bad_ranks"][1].startswith("lost: rank 1 attached again"), cut["bad_ranks"]
    assert cut["ranks"] == [0] or cut["bad_ranks"][0].startswith("lost: rank 0"), cut
    assert windows[2]["partial"] and windows[2]["reason"].startswith(
        "the trainer started again at step "
    ), windows[2]["reason"]
    for i in [i for i in windows if i > 2]:
        assert ray.get(coord.kernel_summary.remote(window=i))["ranks"] == [0, 1]


SECOND_DRIVER = """
import json, sys, ray
ray.init(address=sys.argv[1], namespace="profiler-tests", log_to_driver=False)
coord = ray.get_actor(sys.argv[2])
print(json.dumps(ray.get(coord.request_capture.remote(active=3, warmup=1))))
"""


def _second_driver_capture(ray, name: str) -> dict:
    """``request_capture`` from another process, a driver of its own on the same cluster."""
    env = {**os.environ, "PYTHONPATH": ROOT, "RAY_AUTH_MODE": "disabled"}
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.run(
        [sys.executable, "-c", SECOND_DRIVER, address, name],
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _running(ray, name: str, step: int, timeout_s: float = 120.0):
    """The coordinator the ranks made, once rank 0 has reported ``step``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            coord = _coordinator(ray, name)
            if (ray.get(coord.status.remote())["global_step"] or -1) >= step:
                return coord
        except ValueError:
            pass  # (not made yet: the first rank to attach makes it)
        assert time.monotonic() < deadline, "the SPMD loop did not reach its step"
        time.sleep(0.2)


def _start_loop(ray, config: dict, run: SpmdRun, workers: list) -> list:
    host, port = ray.get(workers[0].address.remote())
    return [w.run.remote(config, run, r, len(workers), host, port) for r, w in enumerate(workers)]


@pytest.mark.subprocess
def test_a_capture_from_a_second_driver_lands_on_the_same_steps_on_every_rank(
    ray_session, ray_actors, spmd_workers, tmp_path
):
    """Two ranks a step apart, stepping themselves; scheduled windows every 40 steps. Another
    driver asks for a capture mid-run: the reply, once both ranks acknowledged the plan, names
    steps neither had reached; both record exactly those steps, under the reply's window
    index, and every window around it keeps one number on both ranks and the coordinator."""
    ray = ray_session
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    cfg = profiler_config(tmp_path, wait=37, warmup=1, active=2, repeat=0).to_dict()
    run = _run(name, steps=420, pace_s=0.01, lag_s=0.01)  # rank 1 a step behind (all-reduce)
    refs = _start_loop(ray, cfg, run, spmd_workers(2))
    try:
        _running(ray, name, 30)
        reply = _second_driver_capture(ray, name)
        losses = ray.get(refs, timeout=600)
    finally:
        ray_actors.append(_coordinator(ray, name))
    assert all(len(x) == 420 for x in losses)
    assert reply["accepted"], reply
    assert reply["missed"] == [] and reply["ranks"] == [0, 1], reply
    a, b = reply["steps"]
    assert b - a == 2 and a > 30, reply
    coord = _coordinator(ray, name)
    st = ray.get(coord.status.remote())
    st = _settled(ray, coord, [w["index"] for w in st["windows"]])
    windows = {w["index"]: w for w in st["windows"]}
    cap = windows[reply["window"]]
    assert cap["steps"] == [a, b] and cap["kind"] == "capture" and not cap["partial"], cap
    assert sorted(windows) == list(range(len(windows)))  # one numbering, no gap
    for i, w in windows.items():  # every window: both ranks, their traces under its name
        assert w["ranks"] == [0, 1] and not w["partial"], w
        x, y = w["steps"]
        d = tmp_path / "run" / f"window_{i:04d}_steps_{x}-{y}" / "policy"
        assert sorted(p.name.split(".")[0] for p in d.iterdir()) == ["rank0", "rank1"], d
    table = ray.get(coord.kernel_summary.remote(window=reply["window"]))
    assert table["ranks"] == [0, 1] and table["steps"] == [a, b] and table["kernels"]
    assert st["counters"].get("worker_rpcs", 0) == 0  # (through the node agent only)


@pytest.mark.subprocess
def test_a_capture_names_a_dead_rank_lost_and_the_window_is_partial_for_it(
    ray_session, ray_actors, spmd_workers, tmp_path
):
    ray = ray_session
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    cfg = profiler_config(tmp_path, wait=1000, warmup=1, active=2, repeat=1).to_dict()
    run = _run(name, steps=500, pace_s=0.01, sync=False)  # (rank 0 trains on alone)
    workers = spmd_workers(2)
    refs = _start_loop(ray, cfg, run, workers)
    try:
        coord = _running(ray, name, 20)
        ray.kill(workers[1])
        reply = ray.get(coord.request_capture.remote(active=2, warmup=0, wait_s=20))
        losses = ray.get(refs[0], timeout=600)
    finally:
        ray_actors.append(_coordinator(ray, name))
    assert len(losses) == 500 and reply["accepted"], reply
    assert [m["rank"] for m in reply["missed"]] == [1], reply
    assert reply["missed"][0]["reason"].startswith("lost: rank 1's process"), reply
    st = _settled(ray, coord, [reply["window"]])
    w = next(w for w in st["windows"] if w["index"] == reply["window"])
    assert w["steps"] == reply["steps"] and w["partial"], w
    table = ray.get(coord.kernel_summary.remote(window=reply["window"]))
    assert table["ranks"] == [0] and table["bad_ranks"][1].startswith("lost: rank 1"), table


def test_a_slowdown_of_spmd_ranks_is_profiled_by_itself_on_every_rank(
    ray_session, ray_actors, spmd_workers, tmp_path
):
    """Steps of about 20 ms that slow down by 40 ms from step 150: the coordinator's auto
    capture reaches both ranks through their node agent and records the slow steps on both."""
    ray = ray_session
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    auto = {"enable": True, "after_steps": 10, "cooldown_steps": 1000, "max_per_run": 1,
            "ignore_first": 20, "baseline_steps": 1000, "active": 2, "warmup": 1}  # fmt: skip
    cfg = profiler_config(tmp_path, on_demand_only=True, auto_capture=auto).to_dict()
    run = _run(name, steps=300, pace_s=0.02, slow_from=150, slow_s=0.04)
    try:
        run_in_actors(cfg, run, 2, spmd_workers(2))
    finally:
        ray_actors.append(_coordinator(ray, name))
    coord = _coordinator(ray, name)
    st = ray.get(coord.status.remote())
    st = _settled(ray, coord, [w["index"] for w in st["windows"]])
    auto_windows = [w for w in st["windows"] if w["kind"] == "auto"]
    assert len(auto_windows) == 1, st["windows"]
    w = auto_windows[0]
    assert w["steps"][0] >= 150 and w["ranks"] == [0, 1] and not w["partial"], w
    assert w["trigger"]["ratio"] >= 1.5, w["trigger"]
    table = ray.get(coord.kernel_summary.remote(window=w["index"]))
    assert table["ranks"] == [0, 1] and table["kernels"]


def test_a_status_from_a_rank_s_earlier_process_is_refused_and_moves_nothing(
    ray_session, ray_actors, tmp_path
):
    """A Ray Train restart: rank 1 attached again (generation 2); its earlier process's close,
    arriving late, would move the new group's plan to its old step. It is refused."""
    from coordinator.client.connect import attach_coordinator

    ray = ray_session
    cfg = _config(tmp_path)
    coord, _ = attach_coordinator(cfg, name=f"profiler-{uuid.uuid4().hex[:8]}",
                                  namespace="profiler-tests")  # fmt: skip
    ray_actors.append(coord)
    for rank in (0, 1, 1):
        reply = ray.get(coord.attach_rank.remote(cfg, "sft", rank, 2))
    assert reply["generation"] == 2
    ray.get(coord.rank_start.remote("sft", 0, 1, 0))
    status = {"state": "ok", "closed": None, "summaries_pending": []}
    ray.get(coord.rank_status.remote("sft", 1, 12, status, 1))  # (the earlier process)
    st = ray.get(coord.status.remote())
    assert st["global_step"] in (None, -1) and st["counters"]["refused_rank_status"] == 1
    ray.get(coord.rank_status.remote("sft", 1, 12, status, 2))
    st = ray.get(coord.status.remote())
    assert st["global_step"] == 12 and st["counters"]["rank_status"] == 1


def test_a_capture_from_the_web_view_reaches_spmd_ranks(
    ray_session, ray_actors, spmd_workers, tmp_path
):
    """The web view's capture button (``POST /api/captures``) on a running SPMD loop: the answer
    comes once both ranks hold the plan, and both record its steps."""
    from coordinator.ops.web.server import CoordinatorLink
    from tests.test_web import TOKEN, ServerThread

    ray = ray_session
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    cfg = profiler_config(tmp_path, on_demand_only=True).to_dict()
    run = _run(name, steps=400, pace_s=0.01, lag_s=0.01)
    refs = _start_loop(ray, cfg, run, spmd_workers(2))
    web = None
    try:
        coord = _running(ray, name, 20)
        web = ServerThread(CoordinatorLink(name, "profiler-tests", coord))
        status, reply = web.http("POST", "/api/captures", {"active": 2, "warmup": 1}, token=TOKEN)
        ray.get(refs, timeout=600)
    finally:
        if web is not None:
            web.close()
        ray_actors.append(_coordinator(ray, name))
    assert status == 200 and reply["accepted"] and reply["missed"] == [], reply
    st = _settled(ray, coord, [reply["window"]])
    w = next(w for w in st["windows"] if w["index"] == reply["window"])
    assert w["steps"] == reply["steps"] and w["ranks"] == [0, 1] and not w["partial"], w
