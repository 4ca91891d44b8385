"""Slow steps profiled by themselves, on a real trainer: 2 ranks on Ray whose steps of about
20 ms (+-30%) slow down by 40 ms from step 300. Only the ranks' sleeps change."""

import random
import uuid

import pytest

from coordinator.ops.tables import render_status, trigger_text
from tests.configs import profiler_config
from trainers.hooks import ProfilingHooks

SLOW_FROM = 300


def auto_config(tmp_path, **auto):
    settings = {
        "enable": True,
        "after_steps": 10,
        "cooldown_steps": 60,
        "max_per_run": 2,
        "ignore_first": 20,
        "baseline_steps": 1000,
        "active": 2,
        "warmup": 1,
    }
    settings.update(auto)
    return profiler_config(tmp_path, on_demand_only=True, auto_capture=settings)


def train(ray, hooks, workers, steps, slow_from=SLOW_FROM, on_step=None, seed=0):
    """``steps`` global steps: ~20 ms with 30% jitter, 40 ms more on every rank from
    ``slow_from``. ``on_step(k)`` runs before step k."""
    rng = random.Random(seed)
    with hooks.session(first_step=0):
        for k in range(steps):
            if on_step:
                on_step(k)
            sleep_s = 0.02 * rng.uniform(0.7, 1.3) + (0.04 if k >= slow_from else 0.0)
            with hooks.region("train"):
                ray.get([w.train_step.remote(1, sleep_s) for w in workers])
            hooks.step(k)


def attach(ray_actors, workers, tmp_path, **auto):
    hooks = ProfilingHooks.attach(
        auto_config(tmp_path, **auto),
        workers=workers,
        trainer_id="t",
        name=f"auto-{uuid.uuid4().hex[:8]}",
        namespace="profiler-tests",
    )
    ray_actors.append(hooks.coordinator)
    return hooks


def auto_windows(ray, coord):
    st = ray.get(coord.status.remote())
    return st, [w for w in st["windows"] if w["kind"] == "auto"]


@pytest.fixture
def workers(toy_workers):
    return toy_workers(2)


def test_a_slowdown_is_profiled_by_itself_and_cooldown_and_maximum_hold(
    ray_session, ray_actors, workers, tmp_path
):
    ray = ray_session
    hooks = attach(ray_actors, workers, tmp_path)
    train(ray, hooks, workers, steps=SLOW_FROM + 260)
    st, auto = auto_windows(ray, hooks.coordinator)
    assert len(auto) == 2, st["windows"]  # the per-run maximum
    first, second = auto
    # Recorded steps start within 20 steps of the slowdown, on every selected rank.
    assert SLOW_FROM <= first["steps"][0] <= SLOW_FROM + 20, first
    assert first["ranks"] == [0, 1] and first["kept"] and first["summaries_pending"] == []
    t1, t2 = first["trigger"], second["trigger"]
    # (slow steps are known to a report's resolution: one interval, 0.1 s, may straddle 300)
    assert t1["ratio"] >= 1.5 and SLOW_FROM - 10 <= t1["slow_steps"][0] <= SLOW_FROM + 10
    assert 10 < t1["baseline_ms"] < 40 and t1["recent_ms"] > 1.5 * t1["baseline_ms"]
    assert t1["region"] == "train"  # from the phase times: the region whose time grew
    assert t2["step"] - t1["step"] >= 60  # the cooldown
    assert "_auto_steps_" in first["trace_dir"]
    assert "x the baseline" in trigger_text(t1) and "why: steps" in render_status(st)
    assert st["auto_capture"]["captures"] == 2 and st["counters"]["auto_captures"] == 2
    ks = ray.get(hooks.coordinator.kernel_summary.remote(window=first["index"]))
    assert ks["ranks"] == [0, 1] and ks["kernels"]
    assert st["metrics"]["values"]["profiler_auto_captures"] == 2.0


def test_switching_auto_capture_off_at_run_time_stops_it_and_on_resumes_it(
    ray_session, ray_actors, workers, tmp_path
):
    ray = ray_session
    hooks = attach(ray_actors, workers, tmp_path, max_per_run=5)
    coord = hooks.coordinator
    switched = {}

    # (Before step 100 auto capture is on: a host busy enough to slow ten steps in a row may
    # rightly trigger a capture there; what is judged is from the switch on.)
    def since_off():
        return [w for w in auto_windows(ray, coord)[1] if w["planned"][0] >= 100]

    def operator(k):
        if k == 100:
            switched["off"] = ray.get(coord.set_auto_capture.remote(False))
        if k == 190:
            assert since_off() == []  # slow for 40 steps, but off: nothing
            switched["on"] = ray.get(coord.set_auto_capture.remote(True))

    train(ray, hooks, workers, steps=260, slow_from=150, on_step=operator)
    off, on = switched["off"], switched["on"]
    assert off["applied"] and not off["auto_capture"]["enabled"]
    assert off["auto_capture"]["source"] == "operator"
    assert on["applied"] and on["auto_capture"]["enabled"]
    auto = since_off()
    assert auto and 190 <= auto[0]["steps"][0] <= 210, auto  # back on: at once
    assert all(w["steps"][0] >= 190 for w in auto)  # and never while it was off
    no = ray.get(coord.set_auto_capture.remote("yes"))
    assert not no["applied"] and "enable must be True or False" in no["reason"]
