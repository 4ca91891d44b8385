import os

import pytest

from coordinator.core.schedule import Window
from coordinator.protocol.summary_codec import decode_summary
from tests.configs import profiler_config
from tests.ray_workers import AsyncToyWorker, ToyWorker


def cfg_dict(tmp_path):
    return profiler_config(tmp_path).validate().to_dict()


def drive_one_window(ray, h, tmp_path, rank):
    st = ray.get(h.configure_profiler.remote(rank, cfg_dict(tmp_path), str(tmp_path / "run")))
    assert st["state"] == "ok", st
    statuses = [ray.get(h.start_profile.remote(Window(0, 0, 1, 2).to_dict(), 0))]
    for k in range(3):
        ray.get(h.train_step.remote())
        statuses.append(ray.get(h.profile_step.remote(k)))
    statuses.append(ray.get(h.dump_profiler_summary.remote(30.0)))
    return statuses


@pytest.mark.parametrize("cls", [ToyWorker, AsyncToyWorker], ids=["sync", "async"])
def test_mixin_profiles_a_real_actor(ray_session, ray_actors, tmp_path, cls):
    ray = ray_session
    h = ray.remote(num_cpus=0)(cls).remote()
    ray_actors.append(h)
    statuses = drive_one_window(ray, h, tmp_path, rank=1)
    assert {s["state"] for s in statuses} == {"ok"}
    closed = [s["closed"] for s in statuses if s["closed"]]
    assert closed == [
        {
            "window": 0,
            "steps": [1, 2],
            "partial": False,
            "trace_path": str(
                tmp_path / "run" / "window_0000_steps_1-2" / "policy" / "rank1.pt.trace.json"
            ),
        }
    ]
    assert os.path.isfile(closed[0]["trace_path"])
    (summary,) = [decode_summary(b) for s in statuses for b in s["summaries"]]
    assert summary.rank == 1 and summary.steps == (1, 2)
    assert "aten::addmm" in {k.name for k in summary.kernels}  # ops on the training thread


def test_threaded_actor_is_refused_with_a_reason(ray_session, ray_actors, tmp_path):
    ray = ray_session
    h = ray.remote(num_cpus=0, max_concurrency=4)(ToyWorker).remote()
    ray_actors.append(h)
    st = ray.get(h.configure_profiler.remote(0, cfg_dict(tmp_path), str(tmp_path / "run")))
    assert st["state"] == "disabled"
    assert "threaded actor (max_concurrency=4)" in st["reason"]["message"]
    # One call at a time (the toy model is not thread-safe), on whichever thread Ray picks.
    ray.get(h.start_profile.remote(Window(0, 0, 1, 2).to_dict(), 0))
    for k in range(3):
        ray.get(h.train_step.remote())
        assert ray.get(h.profile_step.remote(k))["state"] == "disabled"
    ray.get(h.stop_profile.remote())  # the actor is alive: no segfault
    assert ray.get(h.pid.remote()) > 0
    assert not (tmp_path / "run").exists()
