from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.config import ProfilerConfig
from coordinator.core.schedule import Schedule, Window
from coordinator.core.window_plan import MAX_STEP, Ignored, Start, Step, Stop, WindowPlan
from tests.plan_sim import recorded_steps


def new_plan(**kw):
    base = {"skip_first": 0, "wait": 2, "warmup": 1, "active": 2, "repeat": 0}
    base.update(kw)
    return WindowPlan(Schedule(ProfilerConfig(**base)))


def test_commands_only_inside_windows():
    d = new_plan()  # cycle: wait 0-1, warmup 2, record 3-4; wait 5-6, warmup 7, record 8-9
    assert d.start(0) == []
    assert d.step(0) == []
    assert d.step(1) == [Start(Window(0, 2, 3, 4), 2)]
    assert d.step(2) == [Step(2, False)]
    assert d.step(3) == [Step(3, False)]
    assert d.step(4) == [Step(4, True)]
    assert d.step(5) == []
    assert d.step(6) == [Start(Window(1, 7, 8, 9), 7)]


def test_same_step_twice_is_a_noop_and_lower_steps_are_ignored():
    d = new_plan()
    d.start(0)
    d.step(0)
    d.step(1)
    assert d.step(1) == Ignored(1, "duplicate")
    assert d.step(0) == Ignored(0, "out_of_order")
    assert d.step(2) == [Step(2, False)]


def test_window_in_a_gap_starts_at_the_next_step():
    d = new_plan(wait=5, warmup=1, active=2, repeat=1)  # warmup 5, record 6-7
    d.start(0)
    # The trainer jumps from step 1 to step 9: the whole window fell in the gap.
    d.step(1)
    assert d.step(9) == [Start(Window(0, 10, 11, 12), 10)]
    assert d.step(10) == [Step(10, False)]


def test_gap_over_warmup_only_keeps_the_scheduled_record_steps():
    d = new_plan(wait=5, warmup=3, active=2, repeat=1)  # warmup 5-7, record 8-9
    d.start(0)
    d.step(1)
    assert d.step(6) == [Start(Window(0, 5, 8, 9), 7)]


def test_back_to_back_windows_close_and_begin_on_one_step():
    d = new_plan(wait=0, warmup=1, active=1, repeat=2)
    assert d.start(0) == [Start(Window(0, 0, 1, 1), 0)]
    assert d.step(0) == [Step(0, False)]
    assert d.step(1) == [Step(1, True), Start(Window(1, 2, 3, 3), 2)]


def test_stop_closes_an_open_window_once():
    d = new_plan(wait=0)
    d.start(0)
    d.step(0)
    assert d.stop() == [Stop()]
    assert d.stop() == []


def test_stop_without_start_does_nothing():
    assert new_plan().stop() == []


def test_step_without_start_starts_after_that_step():
    d = new_plan(wait=0, warmup=1, active=2)
    # As a resume at step 5: the window recording steps 4-5 records step 5.
    assert d.step(4) == [Start(Window(0, 3, 4, 5), 5)]


def test_resume_inside_a_recording_window_records_the_rest_of_it():
    d = new_plan(wait=2, warmup=1, active=3, repeat=1)  # warmup 2, record 3-5
    assert d.start(4) == [Start(Window(0, 2, 3, 5), 4)]
    plan = recorded_steps(new_plan(wait=2, warmup=1, active=3, repeat=1), 4, [4, 5, 6])
    assert plan == {0: [4, 5]}


def test_start_again_closes_the_open_window():
    d = new_plan(wait=0)
    d.start(0)
    cmds = d.start(0)
    assert cmds[0] == Stop() and isinstance(cmds[1], Start) and cmds[1].window.index == 1


def test_next_window_is_reported_with_the_index_it_would_get():
    d = new_plan()
    d.start(0)
    assert d.next_window() == Window(0, 2, 3, 4)
    d.step(0)
    d.step(1)
    assert d.next_window() == Window(1, 7, 8, 9)


def test_stopping_mid_window_records_up_to_the_last_finished_step():
    plan = recorded_steps(new_plan(wait=0, warmup=1, active=5, repeat=1), 0, [0, 1, 2])
    assert plan == {0: [1, 2]}


# ---------------------------------------------------------------- captures


def test_capture_defaults_to_the_earliest_boundary_the_trainer_cannot_have_passed():
    d = new_plan(on_demand_only=True)
    d.start(0)
    for k in range(6):
        assert d.step(k) == []
    w = d.request_capture(warmup=1, active=2, start_step=None)
    # last report: step 5; the trainer may already run step 6, so warm-up starts at 7
    assert w == Window(0, 7, 8, 9, "capture")
    assert d.next_window() == w
    assert d.step(6) == [Start(w, 7)]
    assert d.step(7) == [Step(7, False)]
    assert d.step(8) == [Step(8, False)]
    assert d.step(9) == [Step(9, True)]


def test_a_capture_the_trainer_skipped_past_opens_late_and_keeps_its_promise():
    d = new_plan(on_demand_only=True)
    d.start(0)
    d.step(0)
    w = d.request_capture(warmup=1, active=2, start_step=None)  # warm-up 2, record 3-4
    assert w == Window(0, 2, 3, 4, "capture")
    (begin,) = d.step(5)  # the trainer jumped from step 0 to step 5
    assert begin.window == Window(0, 6, 7, 8, "capture") and begin.planned == w
    assert begin.step == 6


def test_stop_drops_the_captures_that_never_opened():
    d = new_plan(on_demand_only=True)
    d.start(0)
    d.step(0)
    w = d.request_capture(warmup=1, active=1, start_step=10)
    assert d.stop() == [] and d.drop_captures() == [w] and d.next_window() is None


def test_capture_and_schedule_share_one_plan_without_overlap():
    d = new_plan(skip_first=0, wait=6, warmup=1, active=2, repeat=0)  # warm-up 6, record 7-8; 15..
    d.start(0)
    d.step(0)
    cap = d.request_capture(warmup=1, active=2, start_step=3)  # warm-up 2, record 3-4
    assert cap == Window(0, 2, 3, 4, "capture")
    assert "overlap the scheduled window recording steps 7-8" in d.request_capture(1, 2, 7)
    assert "overlap capture 0" in d.request_capture(0, 1, 4)
    assert d.step(1) == [Start(cap, 2)]
    for k in (2, 3):
        d.step(k)
    assert d.step(4) == [Step(4, True)]
    assert d.next_window() == Window(1, 6, 7, 8)  # the scheduled window, numbered after it
    assert d.step(5) == [Start(Window(1, 6, 7, 8), 6)]


def test_capture_overlapping_the_open_window_is_refused_and_cancel_works():
    d = new_plan(wait=0, warmup=1, active=5, repeat=1)
    d.start(0)  # window 0 open: warm-up 0, record 1-5
    assert "overlap scheduled window 0" in d.request_capture(1, 1, 3)
    w = d.request_capture(1, 1, 8)
    assert isinstance(w, Window)
    assert d.cancel_capture(w.index) is None
    assert d.cancel_capture(w.index) == f"no pending capture {w.index}"
    assert "already open" in d.cancel_capture(0)
    assert "too early" in d.request_capture(2, 1, 1)


# Schedules (skip_first, wait, warmup, active, repeat) and capture requests (at step, warmup,
# active, start step) for the property tests.
SCHEDULES = (st.integers(0, 6), st.integers(0, 3), st.integers(0, 3), st.integers(1, 3),
             st.integers(0, 3))  # fmt: skip
REQUESTS = st.lists(
    st.tuples(
        st.integers(0, 40), st.integers(0, 2), st.integers(1, 3), st.none() | st.integers(0, 45)
    ),
    max_size=6,
)


@settings(max_examples=200, deadline=None)
@given(*SCHEDULES, REQUESTS)
def test_opened_windows_never_overlap(skip_first, wait, warmup, active, repeat, requests):
    d = new_plan(skip_first=skip_first, wait=wait, warmup=warmup, active=active, repeat=repeat)
    opened = []
    pending = {}
    d.start(0)
    for k in range(50):
        for at, w_up, act, start in requests:
            if at == k:
                w = d.request_capture(w_up, act, start)
                if isinstance(w, Window):
                    pending[w.index] = w
        out = d.step(k)
        opened += [c.window for c in out if isinstance(c, Start)]
    spans = [(w.warmup_start, w.last) for w in opened]
    assert all(a[1] < b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert len({w.index for w in opened}) == len(opened)
    for w in opened:  # a capture records as many steps as requested
        if w.kind == "capture":
            p = pending[w.index]
            assert w.last - w.first == p.last - p.first


@settings(max_examples=300, deadline=None)
@given(*SCHEDULES, REQUESTS)
def test_a_rank_that_skips_the_quiet_steps_gets_the_same_commands(
    skip_first, wait, warmup, active, repeat, requests
):
    """``quiet_through``: a rank that passes the plan by (only ``last_step`` moves) on every
    step up to it, as ``RankSession.step`` does, runs the same commands on the same steps as
    one that asks the plan each step, captures taken mid-run included."""
    kw = {"skip_first": skip_first, "wait": wait, "warmup": warmup, "active": active}
    every, skipping = new_plan(**kw, repeat=repeat), new_plan(**kw, repeat=repeat)
    assert every.start(0) == skipping.start(0) and skipping.quiet_through() >= -1
    quiet = -1
    for k in range(60):
        for at, w_up, act, start in requests:
            if at == k:
                assert every.request_capture(w_up, act, start) == skipping.request_capture(
                    w_up, act, start
                )
                quiet = -1  # (a capture taken: ask again)
        want = every.step(k)
        if k <= quiet:
            skipping.last_step, got = k, []
        else:
            got = skipping.step(k)
            quiet = skipping.quiet_through()
        assert got == want, k


def test_quiet_through_is_the_step_before_the_next_warm_up_and_none_inside_a_window():
    d = new_plan(skip_first=10, wait=0, warmup=1, active=2, repeat=1)  # warm-up 10, record 11-12
    assert d.quiet_through() == -1  # (not started)
    d.start(0)
    assert d.quiet_through() == 8  # (step(9) opens the window: its warm-up is step 10)
    assert d.step(8) == [] and d.step(9) != [] and d.quiet_through() == -1
    d.step(10), d.step(11), d.step(12)
    assert d.quiet_through() == MAX_STEP  # (no window to come)
    d.request_capture(1, 2, 20)  # (warm-up at 19, records 20-21)
    assert d.quiet_through() == 17
