import asyncio
import logging
import uuid

import pytest
import ray as ray_module

from tests.configs import profiler_config
from tests.ray_workers import FaultyWorker
from trainers.hooks import ProfilingHooks


def test_disabled_hooks_make_zero_ray_calls(monkeypatch):
    calls = []

    def counting(name):
        def fn(*a, **kw):
            calls.append(name)
            raise AssertionError(f"ray.{name} called with profiling disabled")

        return fn

    for name in ("init", "get", "wait", "put", "get_actor", "remote", "kill"):
        monkeypatch.setattr(ray_module, name, counting(name))
    monkeypatch.setattr(ray_module.actor.ActorMethod, "remote", counting("ActorMethod.remote"))

    hooks = ProfilingHooks.attach({"enable": False, "active": 2}, workers=[object(), object()])
    assert not hooks.enabled and hooks.coordinator is None
    with hooks.session(first_step=3):
        for k in range(3, 10):
            hooks.step(k)

    async def async_loop():
        async with hooks.session(first_step=0):
            for k in range(5):
                await hooks.astep(k)

    asyncio.run(async_loop())
    assert calls == []
    assert hooks.phase == "off"


def test_bad_config_is_an_error_at_attach():
    with pytest.raises(ValueError, match="did you mean 'active'"):
        ProfilingHooks.attach({"enable": True, "actve": 1}, workers=[])


def make_hooks(ray, tmp_path, workers, **kw):
    cfg = profiler_config(tmp_path, wait=0, warmup=1, active=2, repeat=0, **kw)
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    return ProfilingHooks.attach(
        cfg, workers, trainer_id="t", name=name, namespace="profiler-tests"
    )


def test_coordinator_dying_mid_run_pauses_profiling_with_one_warning(
    ray_session, ray_actors, toy_workers, tmp_path, caplog
):
    ray = ray_session
    workers = toy_workers(2)
    hooks = make_hooks(ray, tmp_path, workers)
    ray_actors.append(hooks.coordinator)
    caplog.set_level(logging.WARNING, logger="trainers.hooks")
    with hooks.session(first_step=0):
        for k in range(8):
            ray.get([w.train_step.remote() for w in workers])
            hooks.step(k)
            if k == 2:
                ray.kill(hooks.coordinator)
    assert not hooks.enabled and "step" in hooks.disabled_reason
    warnings = [r for r in caplog.records if "profiling paused" in r.getMessage()]
    assert len(warnings) == 1 and "training goes on" in warnings[0].getMessage()


def test_unreachable_coordinator_at_attach_switches_profiling_off(tmp_path, caplog, monkeypatch):
    import coordinator.client.connect as connect

    def unreachable(*a, **kw):
        raise ConnectionError("no cluster")

    monkeypatch.setattr(connect, "attach_coordinator", unreachable)
    caplog.set_level(logging.WARNING, logger="trainers.hooks")
    cfg = {"enable": True, "save_path": str(tmp_path), "activities": ["cpu"]}
    hooks = ProfilingHooks.attach(cfg, workers=[])
    assert not hooks.enabled and "ConnectionError" in hooks.disabled_reason
    with hooks.session(0):
        hooks.step(0)
    assert len([r for r in caplog.records if "switched off" in r.getMessage()]) == 1


def test_async_steps_never_block_the_event_loop(ray_session, ray_actors, tmp_path):
    ray = ray_session
    workers = [ray.remote(num_cpus=0)(FaultyWorker).remote() for _ in range(2)]
    ray_actors.extend(workers)
    hooks = make_hooks(ray, tmp_path, workers, worker_timeout_s=30.0)
    ray_actors.append(hooks.coordinator)
    ray.get([w.inject.remote("slow_step_1s") for w in workers])

    async def main():
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.ensure_future(ticker())
        async with hooks.session(first_step=0):
            await hooks.astep(0)  # inside a window: waits ~1 s for the slow ranks
        done.set()
        await t
        return ticks

    ticks = asyncio.run(main())
    assert hooks.enabled
    assert ticks > 30  # the loop kept running while the step was acknowledged
