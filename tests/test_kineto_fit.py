"""Whether a schedule leaves libkineto the time it needs (``coordinator.core.kineto_fit``)."""

from __future__ import annotations

from coordinator.core.config import ProfilerConfig
from coordinator.core.kineto_fit import kineto_schedule_problems


def config(engine: str = "kineto", **schedule: int) -> ProfilerConfig:
    return ProfilerConfig.from_dict(
        {"enable": True, "save_path": "/tmp/p", "engine": engine, **schedule}
    )


def test_the_issue_s_schedule_at_15_ms_a_step_is_too_tight_on_both_counts():
    cfg = config(skip_first=30, wait=40, warmup=1, active=20, repeat=3)
    late, lost = kineto_schedule_problems(cfg, 0.015)
    assert "first window may start late" in late and "warmup >= 67" in late, late
    assert "windows after the first may be lost" in lost and "wait + warmup >= 200" in lost, lost
    assert "41 x 15 ms a step = 0.61 s" in lost, lost


def test_a_schedule_with_room_another_engine_or_no_step_time_says_nothing():
    roomy = config(skip_first=30, wait=300, warmup=100, active=20, repeat=3)
    assert kineto_schedule_problems(roomy, 0.015) == []
    tight = config(skip_first=30, wait=40, warmup=1, active=20, repeat=3)
    assert kineto_schedule_problems(config("torch", wait=0, warmup=1), 0.015) == []
    assert kineto_schedule_problems(tight, None) == []
    one = config(skip_first=30, wait=0, warmup=100, active=20, repeat=1)
    assert kineto_schedule_problems(one, 0.015) == []  # one window: no gap to leave
    # the gap's edge: 3 s exactly is enough, a step less is not
    edge = config(wait=199, warmup=101, active=5, repeat=2)
    assert kineto_schedule_problems(edge, 0.01) == []
    short = config(wait=198, warmup=101, active=5, repeat=2)
    assert len(kineto_schedule_problems(short, 0.01)) == 1
