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


def test_kineto_files_of_two_roles_or_processes_in_one_directory_have_their_own_names():
    import os

    from worker_ext.rank.kineto_rank import log_file_path

    policy, critic = (log_file_path("/r", role, 0, "ahead.9-9") for role in ("policy", "critic"))
    assert policy != critic and os.path.dirname(policy) == "/r", (policy, critic)
    odd = log_file_path("/r", "../x y", 0, "3")
    assert os.path.dirname(odd) == "/r" and f".{os.getpid()}." in odd, odd


def test_a_lost_window_s_reason_asks_for_the_warm_up_the_schedule_check_asks_for():
    from coordinator.core.schedule import Window
    from worker_ext.rank.kineto_rank import _Run, lost_why

    run = _Run(job=None, log_file="/r/x.json")  # type: ignore[arg-type]
    why = lost_why(Window(0, 0, 5, 6), run, None, 0.1)
    cfg = config(skip_first=30, wait=40, warmup=5, active=2, repeat=2)
    late = kineto_schedule_problems(cfg, 0.1)[0]
    assert "needs a window's warm-up (steps of 0.10 s each) to last at least 1 s" in why, why
    assert "up to 1 s after the warm-up begins" in late and "warmup >= 10" in late, late
