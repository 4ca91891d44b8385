"""The control plane keeps its word: exact capture steps, a stopped run, one run at a time."""

import glob
import json
import random
import threading
import time
import uuid

import pytest

from coordinator import attach_coordinator
from tests.configs import profiler_config
from tests.ray_workers import ToyWorker
from trainers.hooks import ProfilingHooks


def recorded_steps(trace_dir: str) -> list[list[int]]:
    """The ProfilerStep#N numbers in each rank's trace of one window."""
    out = []
    for path in sorted(glob.glob(f"{trace_dir}/rank*.pt.trace.json")):
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        out.append(
            sorted(
                int(e["name"].split("#")[1])
                for e in events
                if e.get("name", "").startswith("ProfilerStep#") and e.get("ph") == "X"
            )
        )
    return out


def wait_until(fn, timeout=60.0, every=0.05):
    deadline = time.monotonic() + timeout
    while not (value := fn()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every)
    return value


@pytest.fixture
def workers(toy_workers):
    return toy_workers(2)


def coordinator_name():
    return f"cp-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def on_demand(ray_session, ray_actors, workers, tmp_path):
    """A coordinator with on-demand profiling only, trainer 't' registered with 2 ranks."""
    coord, _ = attach_coordinator(
        profiler_config(tmp_path, on_demand_only=True),
        name=coordinator_name(),
        namespace="profiler-tests",
    )
    ray_actors.append(coord)
    ray_session.get(coord.register.remote("t", workers))
    return coord


@pytest.mark.parametrize("step_s", [0.01, 0.3], ids=["fast_steps", "slow_steps"])
def test_captures_record_exactly_the_steps_they_promise(
    ray_session, ray_actors, workers, tmp_path, step_s
):
    """20 requests at random moments from another thread while a StepClient trainer steps."""
    ray = ray_session
    cfg = profiler_config(tmp_path, on_demand_only=True)
    hooks = ProfilingHooks.attach(
        cfg, workers, trainer_id="t", name=coordinator_name(), namespace="profiler-tests"
    )
    coord = hooks.coordinator
    ray_actors.append(coord)
    stop = threading.Event()
    failures = []

    def train():
        try:
            with hooks.session(first_step=0):
                k = 0
                while not stop.is_set():
                    ray.get([w.train_step.remote() for w in workers])
                    time.sleep(step_s)
                    hooks.step(k)
                    k += 1
        except BaseException as exc:  # surfaced by the main thread
            failures.append(exc)

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    rng = random.Random(20261201)
    answers = []
    try:
        while len(answers) < 20:
            time.sleep(rng.uniform(0, 3 * step_s))
            a = ray.get(
                coord.request_capture.remote(active=rng.randint(1, 2), warmup=rng.randint(0, 1))
            )
            if a["accepted"]:
                answers.append(a)
            else:
                assert "overlap" in a["reason"], a  # the previous capture is still planned
        last = answers[-1]["window"]

        def all_in():
            st = ray.get(coord.status.remote())
            done = {w["index"]: w for w in st["windows"] if not w["summaries_pending"]}
            return st if last in done else None

        st = wait_until(all_in, timeout=120)
    finally:
        stop.set()
        trainer.join(timeout=60)
    assert not failures and hooks.enabled
    windows = {w["index"]: w for w in st["windows"]}
    for a in answers:
        w = windows[a["window"]]
        first, last_step = a["steps"]
        assert w["steps"] == [first, last_step] and w["kept"] and w["reason"] is None, (a, w)
        assert w["ranks"] == [0, 1]
        promised = list(range(first, last_step + 1))
        assert recorded_steps(w["trace_dir"]) == [promised, promised], a


def test_a_stop_ends_every_pending_capture_with_a_reason(ray_session, on_demand):
    ray, coord = ray_session, on_demand
    early = ray.get(coord.request_capture.remote(active=1))
    assert not early["accepted"] and early["reason"] == (
        "no trainer is running: trainer 't' has not started"
    )
    ray.get(coord.start.remote("t", 0))
    for k in range(3):
        ray.get(coord.step.remote("t", k))
    far = ray.get(coord.request_capture.remote(active=2, start_step=50))
    assert far["accepted"] and far["steps"] == [50, 51]
    ray.get(coord.stop.remote("t"))
    st = ray.get(coord.status.remote())
    (entry,) = st["windows"]
    assert entry["index"] == far["window"] and entry["steps"] is None
    assert entry["kept"] is False and entry["planned"] == [50, 51]
    assert entry["reason"] == "the run stopped at step 2 before the window opened"
    assert st["next_window"] is None and st["run"]["lifecycle"] == "stopped"
    late = ray.get(coord.request_capture.remote(active=1))
    assert (
        not late["accepted"]
        and late["reason"] == "no trainer is running: the run stopped at step 2"
    )


def test_a_capture_waits_for_the_trainers_next_report_and_gives_up_with_a_reason(
    ray_session, on_demand
):
    from coordinator.client.step_client import StepClient

    ray, coord = ray_session, on_demand
    client = StepClient(coord, "t")
    client.start(0)
    client.step(0)  # a report the client did not wait for: the trainer may be anywhere now
    t0 = time.monotonic()
    stuck = ray.get(coord.request_capture.remote(active=1, wait_s=1.0))
    assert not stuck["accepted"] and "reported no step within 1 s" in stuck["reason"]
    assert 0.9 < time.monotonic() - t0 < 10
    pending = coord.request_capture.remote(active=2, warmup=1)
    time.sleep(0.3)
    client.step(1)  # its answer tells the client to wait from the next step on
    time.sleep(0.3)
    client.step(2)  # ...so it waits here, and the capture is planned while it does
    answer = ray.get(pending, timeout=30)
    assert answer["accepted"] and answer["steps"] == [4, 5] and answer["warmup_start"] == 3
    for k in range(3, 7):
        client.step(k)
    client.stop()
    (w,) = ray.get(coord.status.remote())["windows"]
    assert w["steps"] == [4, 5] and w["kept"]


def run_steps(ray, coord, workers, tid, steps):
    for k in steps:
        ray.get([w.train_step.remote() for w in workers])
        ray.get(coord.step.remote(tid, k))


def test_a_second_run_starts_fresh_and_the_first_stays_readable(
    ray_session, ray_actors, workers, tmp_path
):
    ray = ray_session
    name = coordinator_name()
    first = ProfilingHooks.attach(
        profiler_config(tmp_path, run_name="job", wait=1, warmup=1, active=2, repeat=1),
        workers,
        trainer_id="sft",
        name=name,
        namespace="profiler-tests",
    )
    ray_actors.append(first.coordinator)
    coord = first.coordinator
    with first.session(0):
        for k in range(6):
            ray.get([w.train_step.remote() for w in workers])
            first.step(k)
    one = ray.get(coord.status.remote())
    assert one["run"]["name"] == "job" and [w["steps"] for w in one["windows"]] == [[2, 3]]
    # The same job again, another config: a fresh run, never mixed with the first.
    second = ProfilingHooks.attach(
        profiler_config(tmp_path, run_name="job", wait=0, warmup=1, active=1, repeat=1),
        workers,
        trainer_id="sft",
        name=name,
        namespace="profiler-tests",
    )
    assert second.run == "job.2" and second.config_mismatch == []
    assert second.config.active == 1
    with second.session(0):
        for k in range(3):
            ray.get([w.train_step.remote() for w in workers])
            second.step(k)
    two = ray.get(coord.status.remote())
    assert two["run"]["name"] == "job.2" and two["run_dir"] == str(tmp_path / "job.2")
    assert two["config"]["active"] == 1 and two["config"]["wait"] == 0
    assert [(w["index"], w["steps"]) for w in two["windows"]] == [(0, [1, 1])]
    assert ray.get(coord.flush_record.remote(30.0))["pending"] == 0  # (written off the loop)
    assert sorted(p.name for p in (tmp_path / "job.2").iterdir()) == [
        "record", "window_0000_steps_1-1"]  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == [
        "record", "window_0000_steps_2-3"]  # fmt: skip
    (prev,) = two["previous_runs"]
    assert prev["run"]["name"] == "job" and prev["run"]["lifecycle"] == "stopped"
    assert prev["config"]["active"] == 2 and [w["steps"] for w in prev["windows"]] == [[2, 3]]
    old = ray.get(coord.kernel_summary.remote(run="job"))
    assert old["run"] == "job" and old["window"] == 0 and old["ranks"] == [0, 1]
    assert ray.get(coord.kernel_summary.remote())["steps"] == [1, 1]
    with pytest.raises(ValueError, match="no run 'nope'"):
        ray.get(coord.kernel_summary.remote(run="nope"))


def test_a_restarted_driver_resumes_its_run_and_is_told_what_config_differs(
    ray_session, ray_actors, toy_workers, tmp_path
):
    ray = ray_session
    name = coordinator_name()
    cfg = profiler_config(tmp_path, run_name="long", wait=2, warmup=1, active=2, repeat=0)
    old_workers = [ray.remote(num_cpus=0)(ToyWorker).remote() for _ in range(2)]
    hooks = ProfilingHooks.attach(
        cfg, old_workers, trainer_id="rl", name=name, namespace="profiler-tests"
    )
    coord = hooks.coordinator
    ray_actors.extend([coord, *old_workers])
    hooks.start(0)
    run_steps(ray, coord, old_workers, "rl", range(6))  # window 0 records 3-4; no stop: a crash
    for w in old_workers:
        ray.kill(w)
    new_workers = toy_workers(2)
    changed = profiler_config(tmp_path, run_name="long", wait=2, warmup=1, active=3, repeat=0)
    again = ProfilingHooks.attach(
        changed, new_workers, trainer_id="rl", name=name, namespace="profiler-tests"
    )
    assert again.run == "long" and again.config_mismatch == ["active"]
    assert again.config.active == 2  # the running config is kept
    again.start(6)
    run_steps(ray, coord, new_workers, "rl", range(6, 10))
    again.stop()
    st = ray.get(coord.status.remote())
    assert st["run"]["name"] == "long" and st["global_step"] == 9 and st["previous_runs"] == []
    assert [(w["index"], w["steps"]) for w in st["windows"]] == [(0, [3, 4]), (1, [8, 9])]


def test_another_job_with_another_config_is_refused_while_the_run_is_alive(
    ray_session, ray_actors, tmp_path
):
    ray = ray_session
    name = coordinator_name()
    mine = [ray.remote(num_cpus=0)(ToyWorker).remote() for _ in range(2)]
    ray_actors.extend(mine)
    hooks = ProfilingHooks.attach(
        profiler_config(tmp_path, run_name="a", on_demand_only=True),
        mine,
        trainer_id="a",
        name=name,
        namespace="profiler-tests",
    )
    ray_actors.append(hooks.coordinator)
    hooks.start(0)
    hooks.step(0)
    other = profiler_config(tmp_path, run_name="b", active=5)
    with pytest.raises(ValueError) as err:
        attach_coordinator(other, name=name, namespace="profiler-tests", trainer_id="b")
    message = str(err.value)
    assert "serving run 'a'" in message and "stepping trainer 'a'" in message
    assert "its own coordinator" in message and "active" in message
    # Its trainer gone without a stop, the run gives way to the next job.
    for w in mine:
        ray.kill(w)
    time.sleep(1)
    _, info = attach_coordinator(other, name=name, namespace="profiler-tests", trainer_id="b")
    assert info["decision"] == "fresh" and info["run"] == "b"
    st = ray.get(hooks.coordinator.status.remote())
    assert st["previous_runs"][0]["run"]["lifecycle"] == "abandoned"
