import warnings

import pytest
import torch.profiler
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.config import ProfilerConfig
from coordinator.core.schedule import ProfilerAction, Schedule
from coordinator.core.window_plan import WindowPlan
from tests.plan_sim import recorded_steps

configs = st.builds(
    ProfilerConfig,
    skip_first=st.integers(0, 25),
    wait=st.integers(0, 6),
    warmup=st.integers(0, 4),
    active=st.integers(1, 5),
    repeat=st.integers(0, 4),
    skip_first_wait=st.booleans(),
)


def torch_schedule(cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.profiler.schedule(
            skip_first=cfg.skip_first,
            wait=cfg.wait,
            warmup=cfg.warmup,
            active=cfg.active,
            repeat=cfg.repeat,
            skip_first_wait=int(cfg.skip_first_wait),
        )


@settings(max_examples=300, deadline=None)
@given(configs)
def test_action_matches_torch_for_every_step(cfg):
    ours, theirs = Schedule(cfg), torch_schedule(cfg)
    for k in range(250):
        assert ours.action(k).name == theirs(k).name, k


@settings(max_examples=200, deadline=None)
@given(configs)
def test_windows_cover_exactly_the_recorded_steps(cfg):
    s = Schedule(cfg)
    horizon = 250
    recorded = {k for k in range(horizon) if s.action(k).name.startswith("RECORD")}
    warm = {k for k in range(horizon) if s.action(k) is ProfilerAction.WARMUP}
    from_windows, warm_windows = set(), set()
    for i, w in enumerate(s.windows(limit=horizon)):
        assert w.index == i
        assert w.last - w.first + 1 == cfg.active
        assert s.action(w.last) is ProfilerAction.RECORD_AND_SAVE
        from_windows |= set(range(w.first, w.last + 1))
        warm_windows |= set(range(w.warmup_start, w.first))
    assert {k for k in from_windows if k < horizon} == recorded
    assert {k for k in warm_windows if k < horizon} == warm


@settings(max_examples=200, deadline=None)
@given(configs, st.integers(0, 200))
def test_first_window_from_is_the_earliest_unfinished(cfg, step):
    s = Schedule(cfg)
    expected = next((w for w in s.windows(limit=300) if w.last >= step), None)
    assert s.first_window_from(step) == expected


def test_action_is_arithmetic_not_a_scan():
    # A scan would never finish: this only returns because action() is O(1).
    cfg = ProfilerConfig(skip_first=10**15, wait=3, warmup=1, active=2, repeat=0)
    s = Schedule(cfg)
    assert s.action(10**15 - 1) is ProfilerAction.NONE
    assert s.action(10**15 + 3) is ProfilerAction.WARMUP
    assert s.action(10**15 + 5) is ProfilerAction.RECORD_AND_SAVE
    assert s.first_window_from(10**18).first >= 10**18


def test_on_demand_only_has_no_windows():
    s = Schedule(ProfilerConfig(on_demand_only=True, skip_first=0, warmup=0, repeat=0))
    assert all(s.action(k) is ProfilerAction.NONE for k in range(50))
    assert s.first_window_from(0) is None
    assert list(s.windows()) == []


def test_repeat_zero_needs_a_limit_to_enumerate():
    with pytest.raises(ValueError, match="pass a limit"):
        list(Schedule(ProfilerConfig(repeat=0)).windows())


def test_negative_step_is_an_error():
    with pytest.raises(ValueError, match="step must be >= 0"):
        Schedule(ProfilerConfig()).action(-1)


@settings(max_examples=200, deadline=None)
@given(configs)
def test_driver_records_what_torch_records_in_an_uninterrupted_run(cfg):
    horizon = 120
    plan = recorded_steps(WindowPlan(Schedule(cfg)), 0, list(range(horizon)))
    got = sorted(k for steps in plan.values() for k in steps)
    sched = torch_schedule(cfg)
    want = [k for k in range(horizon) if sched(k).name.startswith("RECORD")]
    # A window cut by the end of the run is recorded up to its last finished step.
    assert got == want


@settings(max_examples=200, deadline=None)
@given(configs, st.integers(1, 100))
def test_resumed_run_profiles_the_same_steps_as_an_uninterrupted_one(cfg, resume_at):
    horizon = 140
    full = recorded_steps(WindowPlan(Schedule(cfg)), 0, list(range(horizon)))
    resumed = recorded_steps(WindowPlan(Schedule(cfg)), resume_at, list(range(resume_at, horizon)))
    full_after = sorted(k for s in full.values() for k in s if k >= resume_at)
    assert sorted(k for s in resumed.values() for k in s) == full_after
