"""The coordinator survives its own death: Ray restarts it and it picks its state up again."""

import os
import signal
import time
import uuid

from coordinator.service.record_reader import open_record
from tests.configs import profiler_config
from trainers.hooks import ProfilingHooks


def kill_hard(ray, coord, wait_back=True):
    """SIGKILL the coordinator's process, as an OOM killer or a lost node would; with
    ``wait_back``, return once Ray has restarted it (a trainer whose steps are long)."""
    pid = ray.get(coord.status.remote())["process"]["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while wait_back:
        try:
            ray.get(coord.ping.remote(), timeout=5)
            break
        except ray.exceptions.RayError:
            assert time.monotonic() < deadline, "the coordinator did not come back"
            time.sleep(0.2)
    return pid


def attach(ray_actors, workers, tmp_path, **schedule):
    """Hooks on a fresh coordinator for 2 ranks; the coordinator is killed after the test."""
    cfg = profiler_config(tmp_path, **schedule)
    hooks = ProfilingHooks.attach(
        cfg, workers, trainer_id="t", name=f"rs-{uuid.uuid4().hex[:8]}", namespace="profiler-tests"
    )
    ray_actors.append(hooks.coordinator)
    return hooks


def test_sigkill_outside_and_inside_a_window_loses_nothing(
    ray_session, ray_actors, toy_workers, tmp_path
):
    ray = ray_session
    workers = toy_workers(2)
    # cycle of 5: wait 0-1, warm-up 2, record 3-4 | 8-9 | 13-14 | 18-19
    hooks = attach(ray_actors, workers, tmp_path, wait=2, warmup=1, active=2, repeat=0)
    coord = hooks.coordinator
    pids, before = [], None
    with hooks.session(first_step=0):
        for k in range(22):
            ray.get([w.train_step.remote() for w in workers])
            hooks.step(k)
            if k == 5:  # outside a window, once window 0's summaries are in
                deadline = time.monotonic() + 60
                while ray.get(coord.kernel_summary.remote(window=0))["ranks"] != [0, 1]:
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
                time.sleep(1.5)  # past the checkpoint interval: the summaries are saved too
                before = ray.get(coord.kernel_summary.remote(window=0, top_k=10))
                pids.append(kill_hard(ray, coord))
            if k == 13:  # inside window 2, which records steps 13-14
                pids.append(kill_hard(ray, coord))
    assert hooks.enabled, hooks.disabled_reason
    st = ray.get(coord.status.remote())
    assert st["restarts"] == 2 and st["last_restart"] is not None
    assert st["process"]["pid"] not in pids and st["global_step"] == 21
    windows = {w["index"]: w for w in st["windows"]}
    assert (windows[0]["steps"], windows[0]["ranks"], windows[0]["kept"]) == ([3, 4], [0, 1], True)
    after = ray.get(coord.kernel_summary.remote(window=0, top_k=10))
    for key in ("kernels", "rank_totals", "breakdown", "stragglers", "steps", "ranks"):
        assert after[key] == before[key], key
    assert (windows[1]["steps"], windows[1]["ranks"]) == ([8, 9], [0, 1])
    cut = windows[2]
    assert cut["partial"] and not cut["kept"] and cut["steps"] == [13, 13]
    assert "the coordinator restarted inside the window" in cut["reason"]
    assert (windows[3]["steps"], windows[3]["ranks"], windows[3]["kept"]) == (
        [18, 19],
        [0, 1],
        True,
    )
    assert ray.get(coord.kernel_summary.remote(window=3))["ranks"] == [0, 1]
    # The run's record went on through both restarts: each window once, and the phase times of
    # the steps before the first (the phase log a restart loses comes back from the record).
    for i in windows:
        assert ray.get(coord.wait_window.remote(i, timeout_s=60))["done"]
    entry = ray.get(coord.flush_record.remote(30.0))
    assert entry["error"] is None and entry["pending"] == 0, entry
    rec = open_record(entry["dir"])
    assert rec.file.windows == sorted(windows) and not rec.problems, rec.problems
    steps = [s for s, _, _ in rec.phases.exact]
    assert steps == sorted(set(steps)) and steps[0] == 0 and steps[-1] == 21
    assert set(range(6)) <= set(steps)
    # No rank is left with a profiler running.
    for w in workers:
        assert ray.get(w.dump_profiler_summary.remote())["phase"] == "idle"
        assert not ray.get(
            w.__ray_call__.remote(lambda self: __import__("torch")._C._autograd._profiler_enabled())
        )


def test_a_dead_coordinator_costs_one_bounded_wait_then_nothing(
    ray_session, ray_actors, toy_workers, tmp_path
):
    ray = ray_session
    workers = toy_workers(2)
    hooks = attach(
        ray_actors, workers, tmp_path, wait=0, warmup=1, active=30, repeat=1, worker_timeout_s=2.0
    )
    costs = []
    with hooks.session(first_step=0):
        for k in range(12):
            ray.get([w.train_step.remote() for w in workers])
            if k == 3:  # inside the window, where every report waits
                ray.kill(hooks.coordinator)  # gone for good: no restart
            t0 = time.perf_counter()
            hooks.step(k)
            costs.append(time.perf_counter() - t0)
    assert not hooks.enabled and "step" in hooks.disabled_reason
    assert max(costs[3:]) < 2.0 + 5.0 + 1.0  # one wait: worker_timeout_s + REPORT_MARGIN_S
    assert sum(c > 0.5 for c in costs[3:]) <= 1  # ...once; then the steps skip cheaply


def test_the_hooks_reconnect_by_themselves_after_a_restart(
    ray_session, ray_actors, toy_workers, tmp_path
):
    ray = ray_session
    workers = toy_workers(2)
    # cycle of 6: wait 0-2, warm-up 3, record 4-5 | 10-11 | 16-17 | ...
    hooks = attach(
        ray_actors, workers, tmp_path, wait=3, warmup=1, active=2, repeat=0, worker_timeout_s=5.0
    )
    coord = hooks.coordinator
    down_seen = False
    with hooks.session(first_step=0):
        for k in range(40):
            ray.get([w.train_step.remote() for w in workers])
            hooks.step(k)
            down_seen = down_seen or not hooks.enabled
            if k == 6:
                kill_hard(ray, coord, wait_back=False)  # the trainer steps on at once
            time.sleep(0.15)  # steps of 0.15 s: the restart and the probe take a few
    assert down_seen and hooks.enabled, hooks.disabled_reason
    st = ray.get(coord.status.remote())
    assert st["restarts"] == 1 and st["global_step"] == 39
    closed = [w for w in st["windows"] if w["steps"]]
    assert closed[0]["steps"] == [4, 5]  # before the kill
    later = [w for w in closed if w["steps"][0] > 20]
    assert later and all(w["ranks"] == [0, 1] for w in later)  # captured again after it


def test_steps_outside_windows_save_only_the_step_counters(
    ray_session, ray_actors, toy_workers, tmp_path
):
    from coordinator.service import state_store

    ray = ray_session
    hooks = attach(ray_actors, toy_workers(2), tmp_path, wait=1000, warmup=1, active=1, repeat=0)
    coord = hooks.coordinator
    assert ray.get(coord.start.remote("t", 0))["applied"]
    time.sleep(1.5)  # past the checkpoint interval: nothing is left to flush
    saved = ray.get(coord.status.remote())["checkpoint"]
    for k in range(30):
        assert ray.get(coord.step.remote("t", k))["applied"]
    time.sleep(1.5)
    st = ray.get(coord.status.remote())
    assert st["checkpoint"] == saved  # the whole run was not written again for idle steps
    progress = state_store.load_progress(st["namespace"], st["name"])
    assert (progress.run, progress.last_step, progress.global_step) == (st["run"]["name"], 29, 29)
    kill_hard(ray, coord)
    st = ray.get(coord.status.remote())
    assert st["restarts"] == 1 and st["global_step"] == 29
    assert ray.get(coord.step.remote("t", 29))["ignored"] == "duplicate"
    assert ray.get(coord.step.remote("t", 30))["applied"]
    assert ray.get(coord.stop.remote("t"))["applied"]


def _trainers_key(st):
    from coordinator.service import state_store

    store = state_store.run_store(st["namespace"], st["name"], st["run"]["name"])
    return store, "trainers.msgpack"


def test_a_stored_handle_ray_would_choke_on_is_a_problem_in_status_never_a_crash_loop(
    ray_session, ray_actors, toy_workers, tmp_path
):
    """``trainers.msgpack`` as the old format kept a rank's handle (Ray's own serialized bytes),
    here with an actor id of 3 bytes: Ray's decoder aborts the process that reads it, and a
    coordinator restored from it would crash at every restart. Now the stored bytes never
    reach Ray: the coordinator comes back once and says what it could not restore in
    ``status()``."""
    import msgspec
    from ray.core.generated import core_worker_pb2

    ray = ray_session
    hooks = attach(ray_actors, toy_workers(2), tmp_path, wait=1000, warmup=1, active=1, repeat=0)
    coord = hooks.coordinator
    assert ray.get(coord.start.remote("t", 0))["applied"]
    st = ray.get(coord.status.remote())
    store, rel = _trainers_key(st)
    deadline = time.monotonic() + 60
    while not store.exists(rel):  # (the registration's save)
        assert time.monotonic() < deadline
        time.sleep(0.1)
    stored = msgspec.msgpack.decode(store.get(rel, 1 << 30))
    bad = core_worker_pb2.ActorHandle(actor_id=b"\x01\x02\x03").SerializeToString()
    for t in stored["trainers"]:
        t["handles"] = {r: msgspec.msgpack.encode([bad, False]) for r in t["handles"]}
    store.put(rel, msgspec.msgpack.encode(stored))
    kill_hard(ray, coord)
    st = ray.get(coord.status.remote(ranks="all"))
    assert st["restarts"] == 1
    problems = st["checkpoint"]["restore_problems"]
    assert any("trainers.msgpack" in p and "Expected `str`, got `bytes`" in p for p in problems), (
        problems
    )
    assert ray.get(coord.ping.remote(), timeout=30) is not None  # (alive, not restarting)
    assert ray.get(coord.status.remote())["restarts"] == 1
