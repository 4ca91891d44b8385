import glob
import json
import os
import time
import uuid

import pytest

from coordinator import connect, get_or_create_coordinator
from coordinator.protocol.names import agent_name
from tests.configs import profiler_config
from tests.ray_workers import FaultyWorker, ToyWorker


@pytest.fixture
def make(ray_session, ray_actors, toy_workers, tmp_path):
    """make(n, cls=ToyWorker, fresh=False, **config) -> (coordinator, workers).

    ToyWorkers come from the session's pool unless ``fresh`` (a test that kills them).
    """
    ray = ray_session

    def _make(n, cls=ToyWorker, fresh=False, **kw):
        base = dict(skip_first=0, wait=1, warmup=1, active=2, repeat=2, worker_timeout_s=20.0)
        cfg = profiler_config(tmp_path, **{**base, **kw})
        name = f"profiler-{uuid.uuid4().hex[:8]}"
        coord = get_or_create_coordinator(cfg, name=name, namespace="profiler-tests")
        ray_actors.append(coord)
        if cls is ToyWorker and not fresh:
            return coord, toy_workers(n)
        workers = [ray.remote(num_cpus=0)(cls).remote() for _ in range(n)]
        ray_actors.extend(workers)
        return coord, workers

    return _make


def train(ray, coord, workers, steps, first_step=0, tid="t", stop=True):
    replies = [ray.get(coord.start.remote(tid, first_step))]
    for k in range(first_step, first_step + steps):
        ray.get([w.train_step.remote() for w in workers])
        replies.append(ray.get(coord.step.remote(tid, k)))
    if stop:
        replies.append(ray.get(coord.stop.remote(tid)))
    return replies


def test_end_to_end_windows_traces_and_aggregates(ray_session, make, tmp_path):
    ray = ray_session
    coord, workers = make(3)
    reg = ray.get(coord.register.remote("t", workers))
    assert reg["selected_ranks"] == [0, 1, 2] and reg["advances_step"] is True
    replies = train(ray, coord, workers, steps=9)
    # cycle of 4: wait 0, warmup 1, record 2-3 (window 0); wait 4, warmup 5, record 6-7 (window 1)
    phases = [r["phase"] for r in replies[1:-1]]
    assert phases == [
        "warmup",
        "recording",
        "recording",
        "idle",
        "warmup",
        "recording",
        "recording",
        "idle",
        "idle",
    ]
    ray.get(coord.flush_record.remote(30.0))  # (the record is written off the loop)
    dirs = sorted(os.listdir(tmp_path / "run"))
    assert dirs.pop(0) == "record"  # the run's record, beside its windows
    assert dirs == ["window_0000_steps_2-3", "window_0001_steps_6-7"]
    for d in dirs:
        assert os.listdir(tmp_path / "run" / d) == ["policy"]  # one directory per role
        assert sorted(os.listdir(tmp_path / "run" / d / "policy")) == [
            f"rank{r}.pt.trace.json" for r in range(3)
        ]
    st = ray.get(coord.status.remote())
    json.dumps(st)  # JSON-serialisable
    assert st["global_step"] == 8 and st["phase"] == "idle"
    assert [(w["index"], w["steps"], w["partial"], w["ranks"]) for w in st["windows"]] == [
        (0, [2, 3], False, [0, 1, 2]),
        (1, [6, 7], False, [0, 1, 2]),
    ]
    assert st["windows"][0]["trace_dir"] == str(tmp_path / "run" / dirs[0] / "policy")
    assert {r["state"] for r in st["ranks"]} == {"ok"}
    assert all(r["windows_captured"] == 2 for r in st["ranks"])
    c = st["counters"]
    # RPCs only inside windows: each window is one start + one call per step it spans.
    assert c["worker_rpcs_configure_profiler"] == 3
    assert c["worker_rpcs_start_profile"] == 2 * 3
    assert c["worker_rpcs_profile_step"] == 2 * 3 * 3
    assert c.get("worker_rpcs_stop_profile", 0) == 0
    # Nothing else: ranks push their summaries; only stop() collects what is still pending.
    late = c.get("worker_rpcs_dump_profiler_summary", 0)
    assert c["worker_rpcs"] == 3 + 2 * 3 + 2 * 3 * 3 + late and late <= 3
    assert c["summaries"] == 2 * 3
    assert st["process"]["torch_loaded"] is False
    # The summaries were built by one process per node, neither a rank nor this one, and pushed
    # as one node partial per window; the window commands went through that agent too.
    agents = {(r["agent"]["kind"], r["agent"]["pid"]) for r in st["ranks"]}
    ((kind, agent_pid),) = agents
    assert kind == "node_agent" and c["partials_pushed"] == 2 and c["partials"] == 2
    assert c["summaries"] == 2 * 3 and c.get("summaries_pushed", 0) == 0
    assert st["nodes"]["by_path"] == {"agent": 1} and c["node_commands"] >= 6
    rank_pids = set(ray.get([w.pid.remote() for w in workers]))
    assert agent_pid not in rank_pids | {os.getpid(), st["process"]["pid"]}

    ks = ray.get(coord.kernel_summary.remote(top_k=5))
    brk = ks["breakdown"]["ranks"]
    assert set(brk) == {0, 1, 2} and all(b["compute_share"] > 0 for b in brk.values())
    assert all(
        b["compute_us"] + b["memcpy_us"] + b["other_us"] == pytest.approx(b["window_us"])
        for b in brk.values()
    )
    assert ks["window"] == 1 and ks["steps"] == [6, 7] and ks["ranks"] == [0, 1, 2]
    assert ks["device"] == "cpu" and ks["unit"] == "us" and ks["summaries_pending"] == []
    assert len(ks["kernels"]) == 5 and set(ks["rank_totals"]) == {0, 1, 2}
    for k in ks["kernels"]:
        assert set(k) >= {
            "name",
            "total_us",
            "mean_us",
            "min_us",
            "max_us",
            "std_us",
            "max_rank",
            "count",
            "share",
        }
        assert k["min_us"] <= k["mean_us"] <= k["max_us"]
        assert k["total_us"] == pytest.approx(k["mean_us"] * 3)
        assert 0 < k["share"] <= 1 and k["max_rank"] in (0, 1, 2)
    totals = [k["total_us"] for k in ks["kernels"]]
    assert totals == sorted(totals, reverse=True)
    assert ray.get(coord.kernel_summary.remote(window=0))["steps"] == [2, 3]


def test_all_ranks_record_the_same_steps(ray_session, make, tmp_path):
    ray = ray_session
    coord, workers = make(2, wait=0, warmup=1, active=3, repeat=1)
    ray.get(coord.register.remote("t", workers))
    train(ray, coord, workers, steps=6)
    steps = []
    for path in sorted(glob.glob(str(tmp_path / "run" / "*" / "policy" / "rank*.json"))):
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        steps.append(
            sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#"))
        )
    assert len(steps) == 2 and steps[0] == steps[1]
    assert steps[0][:3] == ["ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]


def test_unselected_ranks_never_get_an_rpc(ray_session, make):
    ray = ray_session
    coord, workers = make(3, ranks=[1])
    ray.get(coord.register.remote("t", workers))
    train(ray, coord, workers, steps=8)
    st = ray.get(coord.status.remote())
    assert [(r["rank"], r["state"]) for r in st["ranks"]] == [
        (0, "not_selected"),
        (1, "ok"),
        (2, "not_selected"),
    ]
    # never configured: the worker was never called by the coordinator
    assert ray.get(workers[0].dump_profiler_summary.remote())["state"] == "not_configured"
    assert ray.get(workers[2].dump_profiler_summary.remote())["state"] == "not_configured"
    assert st["counters"]["worker_rpcs_configure_profiler"] == 1
    assert ray.get(coord.kernel_summary.remote())["ranks"] == [1]


def test_registration_errors(ray_session, make):
    ray = ray_session
    coord, workers = make(2, ranks=[0, 3])
    with pytest.raises(ValueError, match=r"selects policy ranks \[3\] \(ranks\).*its ranks: 0-1"):
        ray.get(coord.register.remote("t", workers))
    with pytest.raises(ValueError, match="workers must be a list"):
        ray.get(coord.register.remote("t", "not-workers"))
    with pytest.raises(ValueError, match="trainer_id"):
        ray.get(coord.register.remote("../x", {0: workers[0], 3: workers[1]}))
    ray.get(coord.register.remote("t", {0: workers[0], 3: workers[1]}))


def test_steps_idempotent_ignored_and_rejected(ray_session, make):
    ray = ray_session
    coord, workers = make(1)
    r = ray.get(coord.step.remote("t", 0))
    assert r["applied"] is False and "no trainer is registered" in r["reason"]
    ray.get(coord.register.remote("a", workers))
    ray.get(coord.register.remote("b", workers, role="critic"))
    ray.get(coord.start.remote("a", 0))
    assert ray.get(coord.step.remote("a", 0))["applied"] is True
    again = ray.get(coord.step.remote("a", 0))
    assert again["applied"] is False and again["ignored"] == "duplicate"
    ray.get(coord.step.remote("a", 1))
    assert ray.get(coord.step.remote("a", 0))["ignored"] == "out_of_order"
    other = ray.get(coord.step.remote("b", 2))
    assert other["applied"] is False and "'b' does not advance the global step" in other["reason"]
    st = ray.get(coord.status.remote())
    assert st["global_step"] == 1
    assert st["counters"]["ignored_steps"] == 2 and st["counters"]["refused_step"] == 2
    assert [(t["trainer_id"], t["advances_step"]) for t in st["trainers"]] == [
        ("a", True),
        ("b", False),
    ]
    # b takes over explicitly
    ray.get(coord.register.remote("b", workers, role="critic", advances_step=True))
    assert ray.get(coord.step.remote("b", 2))["applied"] is True
    ray.get(coord.stop.remote("b"))


def test_stop_closes_an_open_window_as_partial_and_is_safe_to_repeat(ray_session, make, tmp_path):
    ray = ray_session
    coord, workers = make(2, wait=0, warmup=1, active=10, repeat=1)
    assert ray.get(coord.stop.remote("t"))["applied"] is False  # nobody registered: no error
    ray.get(coord.register.remote("t", workers))
    ray.get(coord.stop.remote("t"))  # without start
    train(ray, coord, workers, steps=4)  # warmup 0, recorded 1..3, then stop
    assert ray.get(coord.stop.remote("t"))["applied"] is True
    st = ray.get(coord.status.remote())
    assert [(w["steps"], w["partial"]) for w in st["windows"]] == [([1, 3], True)]
    ray.get(coord.flush_record.remote(30.0))
    assert sorted(os.listdir(tmp_path / "run")) == ["record", "window_0000_steps_1-3"]
    ks = ray.get(coord.kernel_summary.remote())
    assert ks["partial"] is True and ks["ranks"] == [0, 1]  # stop collected the summaries


def test_reregistering_keeps_the_step_and_history(ray_session, toy_workers, make):
    ray = ray_session
    coord, workers = make(2)
    ray.get(coord.register.remote("t", workers))
    train(ray, coord, workers, steps=5, stop=False)
    fresh = toy_workers(2)
    ray.get(coord.register.remote("t", fresh))  # the driver restarted with new workers
    st = ray.get(coord.status.remote())
    assert st["global_step"] == 4 and [w["index"] for w in st["windows"]] == [0]
    for k in range(5, 9):
        ray.get([w.train_step.remote() for w in fresh])
        ray.get(coord.step.remote("t", k))
    st = ray.get(coord.status.remote())
    assert [w["index"] for w in st["windows"]] == [0, 1]
    assert st["windows"][1]["steps"] == [6, 7]


def test_kernel_summary_before_any_window_and_unknown_window(ray_session, make):
    ray = ray_session
    coord, _ = make(1)
    ks = ray.get(coord.kernel_summary.remote())
    assert ks["window"] is None and ks["kernels"] == [] and ks["ranks"] == []
    assert ks["steps"] == [] and ks["rank_totals"] == {}
    with pytest.raises(ValueError, match="no window 7"):
        ray.get(coord.kernel_summary.remote(window=7))


def test_window_history_is_bounded(ray_session, make):
    ray = ray_session
    coord, workers = make(1, wait=0, warmup=0, active=1, repeat=4, max_windows=2)
    ray.get(coord.register.remote("t", workers))
    train(ray, coord, workers, steps=5)
    st = ray.get(coord.status.remote())
    assert [w["index"] for w in st["windows"]] == [2, 3]
    assert st["counters"]["windows_evicted"] == 2
    with pytest.raises(ValueError, match="no window 0"):
        ray.get(coord.kernel_summary.remote(window=0))


def test_connect_and_get_or_create(ray_session, make):
    ray = ray_session
    coord, _ = make(1)
    name = ray.get(coord.status.remote())["name"]
    same = connect(name, namespace="profiler-tests")
    assert ray.get(same.status.remote())["name"] == name
    with pytest.raises(ValueError, match="no profiler coordinator named 'nope'"):
        connect("nope", namespace="profiler-tests")


# ------------------------------------------------------------------ faults


def test_a_failing_rank_is_disabled_and_the_rest_carry_on(ray_session, make, tmp_path):
    ray = ray_session
    coord, workers = make(3, cls=FaultyWorker)
    ray.get(coord.register.remote("t", workers))
    ray.get(workers[1].inject.remote("torch_start"))
    replies = train(ray, coord, workers, steps=9)
    assert all(r["applied"] for r in replies)
    st = ray.get(coord.status.remote())
    states = {r["rank"]: r for r in st["ranks"]}
    assert states[1]["state"] == "disabled"
    assert states[1]["reason"]["type"] == "RuntimeError"
    assert "CUPTI_ERROR_NOT_INITIALIZED" in states[1]["reason"]["message"]
    assert states[0]["state"] == states[2]["state"] == "ok"
    assert [w["ranks"] for w in st["windows"]] == [[0, 2], [0, 2]]
    assert sorted(os.listdir(tmp_path / "run" / "window_0001_steps_6-7" / "policy")) == [
        "rank0.pt.trace.json",
        "rank2.pt.trace.json",
    ]
    # the disabled rank gets no more RPCs after it said so
    assert st["counters"]["worker_rpcs_profile_step"] == 2 * 3 * 2 + 0


def test_a_malformed_summary_marks_only_that_ranks_window_bad(ray_session, make):
    ray = ray_session
    coord, workers = make(2, cls=FaultyWorker, repeat=1)
    ray.get(coord.register.remote("t", workers))
    ray.get(workers[0].inject.remote("garbage_summary"))
    train(ray, coord, workers, steps=5)
    ks = ray.get(coord.kernel_summary.remote())
    assert ks["ranks"] == [1] and list(ks["bad_ranks"]) == [0]
    assert "not valid msgpack" in ks["bad_ranks"][0]
    st = ray.get(coord.status.remote())
    assert st["counters"]["bad_summaries"] == 1
    assert {r["state"] for r in st["ranks"]} == {"ok"}


def test_a_killed_worker_is_lost_and_the_window_closes_on_the_others(ray_session, make):
    ray = ray_session
    coord, workers = make(3, fresh=True, wait=0, warmup=1, active=4, repeat=1)
    ray.get(coord.register.remote("t", workers))
    ray.get(coord.start.remote("t", 0))
    for k in range(6):
        if k == 2:
            ray.kill(workers[2])
        ray.get([w.train_step.remote() for w in workers[: 2 if k >= 2 else 3]])
        assert ray.get(coord.step.remote("t", k))["applied"] is True
    ray.get(coord.stop.remote("t"))
    st = ray.get(coord.status.remote())
    ranks = {r["rank"]: r["state"] for r in st["ranks"]}
    assert ranks == {0: "ok", 1: "ok", 2: "lost"}
    assert [(w["steps"], w["ranks"]) for w in st["windows"]] == [([1, 4], [0, 1])]
    assert ray.get(coord.kernel_summary.remote())["ranks"] == [0, 1]


def test_an_unresponsive_worker_is_marked_and_skipped(ray_session, make):
    ray = ray_session
    coord, workers = make(2, cls=FaultyWorker, worker_timeout_s=3.0, repeat=1)
    ray.get(coord.register.remote("t", workers))
    ray.get(workers[1].inject.remote("slow"))
    replies = train(ray, coord, workers, steps=5)
    assert all(r["applied"] for r in replies)
    st = ray.get(coord.status.remote())
    r1 = [r for r in st["ranks"] if r["rank"] == 1][0]
    assert r1["state"] == "unresponsive" and r1["reason"]["type"] == "Timeout"
    assert st["windows"][0]["ranks"] == [0], (st["windows"], st["ranks"], st["counters"])


def test_step_client_waits_only_when_ranks_act(ray_session, make, tmp_path):
    from coordinator.client.step_client import StepClient

    ray = ray_session
    coord, workers = make(2, wait=3, warmup=1, active=2, repeat=2)
    ray.get(coord.register.remote("t", workers))
    client = StepClient(coord, "t")
    first = client.start(0)
    assert first["next_sync_step"] == 2  # step(2) opens window 0 (warm-up at step 3)
    waited = []
    for k in range(13):
        ray.get([w.train_step.remote() for w in workers])
        if client.step(k) is not None:
            waited.append(k)
    client.stop()
    # waits on the step that opens each window and on every step inside it
    assert waited == [2, 3, 4, 5, 8, 9, 10, 11]
    st = ray.get(coord.status.remote())
    assert st["global_step"] == 12
    assert [w["steps"] for w in st["windows"]] == [[4, 5], [10, 11]]
    assert st["counters"]["worker_rpcs_profile_step"] == 2 * 3 * 2


def test_capture_and_schedule_in_one_run(ray_session, make, tmp_path):
    ray = ray_session
    coord, workers = make(2, skip_first=0, wait=6, warmup=1, active=2, repeat=1)
    # scheduled: warm-up 6, record 7-8
    r = ray.get(coord.request_capture.remote(active=2))
    assert not r["accepted"] and r["reason"] == "no trainer is registered with the coordinator"
    assert r["steps"] is None and r["window"] is None
    ray.get(coord.register.remote("t", workers))
    ray.get(coord.start.remote("t", 0))
    ray.get([w.train_step.remote() for w in workers])
    ray.get(coord.step.remote("t", 0))
    cap = ray.get(coord.request_capture.remote(active=2, warmup=1, ranks=[1]))
    assert cap["accepted"] and cap["steps"] == [3, 4] and cap["ranks"] == [1]
    clash = ray.get(coord.request_capture.remote(active=3, start_step=6))
    assert not clash["accepted"] and "scheduled window recording steps 7-8" in clash["reason"]
    assert ray.get(coord.status.remote())["next_window"]["kind"] == "capture"
    for k in range(1, 10):
        ray.get([w.train_step.remote() for w in workers])
        ray.get(coord.step.remote("t", k))
    ray.get(coord.stop.remote("t"))
    st = ray.get(coord.status.remote())
    assert [(w["kind"], w["steps"], w["ranks"]) for w in st["windows"]] == [
        ("capture", [3, 4], [1]),
        ("scheduled", [7, 8], [0, 1]),
    ]
    ray.get(coord.flush_record.remote(30.0))
    assert sorted(os.listdir(tmp_path / "run")) == [
        "record",
        "window_0000_steps_3-4",
        "window_0001_steps_7-8",
    ]
    assert os.listdir(tmp_path / "run" / "window_0000_steps_3-4" / "policy") == [
        "rank1.pt.trace.json"
    ]
    assert (
        st["counters"]["captures_requested"] == 1 and st["counters"]["refused_capture"] == 2
    )  # no trainer yet; the overlap


def test_a_killed_node_agent_costs_one_window_and_comes_back(ray_session, make):
    ray = ray_session
    coord, workers = make(2, repeat=3)
    ray.get(coord.register.remote("t", workers))
    train(ray, coord, workers, steps=4, stop=False)  # window 0: steps 2-3
    for _ in range(300):  # its summaries first, so that the kill costs window 1 only
        if ray.get(coord.kernel_summary.remote(window=0))["ranks"] == [0, 1]:
            break
        time.sleep(0.1)
    st = ray.get(coord.status.remote())
    agent_pid = st["ranks"][0]["agent"]["pid"]
    node = ray.get(
        workers[0].__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
    )
    agent = ray.get_actor(agent_name(node), namespace="profiler_agents")
    ray.kill(agent)
    for k in range(4, 12):  # windows 1 (6-7) and 2 (10-11); training never notices
        ray.get([w.train_step.remote() for w in workers])
        ray.get(coord.step.remote("t", k))
    ray.get(coord.stop.remote("t"))
    st = ray.get(coord.status.remote())
    assert {r["state"] for r in st["ranks"]} == {"ok"}
    lost = ray.get(coord.kernel_summary.remote(window=1))
    assert lost["ranks"] == [] and sorted(lost["bad_ranks"]) == [0, 1]
    assert all("died or could not be reached" in why for why in lost["bad_ranks"].values())
    assert st["counters"]["lost_summaries"] == 2
    for r in st["ranks"]:
        err = r["last_agent_error"]
        assert err["window"] == 1 and os.path.exists(err["trace_path"])
    assert ray.get(coord.kernel_summary.remote(window=0))["ranks"] == [0, 1]
    assert ray.get(coord.kernel_summary.remote(window=2))["ranks"] == [0, 1]
    assert {r["agent"]["pid"] for r in st["ranks"]} != {agent_pid}


def test_a_node_agent_busy_in_its_default_lane_still_answers_window_commands(ray_session):
    """A relay taking its group's partials (the default lane) must not hold the next window's
    start: commands, pings and stack reads run in the agent's control lane."""
    ray = ray_session
    from worker_ext.rank.agent_link import _node_agent

    agent = _node_agent(ray.get_runtime_context().get_node_id())
    ray.get(agent.ping.remote(), timeout=60)
    busy = agent.__ray_call__.remote(lambda self: time.sleep(8))  # holds the default loop
    time.sleep(1.0)
    cmd = {
        "owner": "profiler-tests/lanes#0",
        "run": "r",
        "relay": "",
        "method": "profile_step",
        "args": [1],
        "timeout_s": 1.0,
        "nodes": {},
        "idle_exit_s": None,
    }
    reply = ray.get(agent.command.remote(cmd), timeout=5)
    assert reply["nodes"] == [] and reply["relay"].startswith("agent-")
    assert ray.get(agent.ping.remote(), timeout=5) > 0
    assert ray.wait([busy], timeout=0)[1] == [busy]  # the default lane was busy all along
    ray.get(busy)


def test_roles_select_their_own_ranks_and_an_unselected_role_gets_no_rpc(ray_session, make):
    ray = ray_session
    coord, workers = make(3, ranks="all", roles={"rollout": {"ranks": [1]}})
    with pytest.raises(ValueError, match=r"selects rollout ranks \[1\] \(roles.rollout.ranks\)"):
        ray.get(coord.register.remote("gen", workers[:1], role="rollout"))
    with pytest.raises(ValueError, match="role must be 1-64 letters"):
        ray.get(coord.register.remote("gen", workers[:1], role="a/b"))
    ray.get(coord.register.remote("t", workers[:1]))
    gen = ray.get(coord.register.remote("gen", workers[1:], role="rollout"))
    assert gen["selected_ranks"] == [1] and gen["advances_step"] is False
    assert gen["run_dir"] == ray.get(coord.status.remote())["run_dir"]  # one directory a window
    critic = ray.get(coord.register.remote("critic", workers[1:], role="critic"))
    assert critic["selected_ranks"] == []  # named nowhere: not profiled
    train(ray, coord, workers[:1], steps=4)
    st = ray.get(coord.status.remote())
    c = st["counters"]
    assert c["worker_rpcs_configure_profiler"] == 2  # t rank 0 and gen rank 1; critic none
    # one start each, and a step each for the warm-up step 1 and the recorded 2-3
    assert c["worker_rpcs_start_profile"] == 2 and c["worker_rpcs_profile_step"] == 2 * 3
    (w,) = st["windows"]
    assert {p["role"]: p["ranks"] for p in w["roles"].values()} == {"policy": [0], "rollout": [1]}
    assert "critic" not in w["roles"]
    states = {(r["trainer_id"], r["rank"]): r["state"] for r in st["ranks"]}
    assert states[("critic", 0)] == states[("critic", 1)] == states[("gen", 0)] == "not_selected"
    assert ray.get(coord.kernel_summary.remote(role="rollout"))["ranks"] == [1]
