from coordinator.config import ProfilerConfig
from coordinator.schedule import Schedule, Window
from coordinator.window_driver import Begin, End, Ignored, Step, WindowDriver
from tests.plan_sim import recorded_steps


def driver(**kw):
    base = {"skip_first": 0, "wait": 2, "warmup": 1, "active": 2, "repeat": 0}
    base.update(kw)
    return WindowDriver(Schedule(ProfilerConfig(**base)))


def test_commands_only_inside_windows():
    d = driver()  # cycle: wait 0-1, warmup 2, record 3-4; wait 5-6, warmup 7, record 8-9
    assert d.start(0) == []
    assert d.step(0) == []
    assert d.step(1) == [Begin(Window(0, 2, 3, 4), 2)]
    assert d.step(2) == [Step(2, False)]
    assert d.step(3) == [Step(3, False)]
    assert d.step(4) == [Step(4, True)]
    assert d.step(5) == []
    assert d.step(6) == [Begin(Window(1, 7, 8, 9), 7)]


def test_same_step_twice_is_a_noop_and_lower_steps_are_ignored():
    d = driver()
    d.start(0)
    d.step(0)
    d.step(1)
    assert d.step(1) == Ignored(1, "duplicate")
    assert d.step(0) == Ignored(0, "out_of_order")
    assert d.step(2) == [Step(2, False)]


def test_window_in_a_gap_starts_at_the_next_step():
    d = driver(wait=5, warmup=1, active=2, repeat=1)  # warmup 5, record 6-7
    d.start(0)
    # The trainer jumps from step 1 to step 9: the whole window fell in the gap.
    d.step(1)
    assert d.step(9) == [Begin(Window(0, 10, 11, 12), 10)]
    assert d.step(10) == [Step(10, False)]


def test_gap_over_warmup_only_keeps_the_scheduled_record_steps():
    d = driver(wait=5, warmup=3, active=2, repeat=1)  # warmup 5-7, record 8-9
    d.start(0)
    d.step(1)
    assert d.step(6) == [Begin(Window(0, 5, 8, 9), 7)]


def test_back_to_back_windows_close_and_begin_on_one_step():
    d = driver(wait=0, warmup=1, active=1, repeat=2)
    assert d.start(0) == [Begin(Window(0, 0, 1, 1), 0)]
    assert d.step(0) == [Step(0, False)]
    assert d.step(1) == [Step(1, True), Begin(Window(1, 2, 3, 3), 2)]


def test_stop_closes_an_open_window_once():
    d = driver(wait=0)
    d.start(0)
    d.step(0)
    assert d.stop() == [End()]
    assert d.stop() == []


def test_stop_without_start_does_nothing():
    assert driver().stop() == []


def test_step_without_start_starts_after_that_step():
    d = driver(wait=0, warmup=1, active=2)
    # As a resume at step 5: the window recording steps 4-5 records step 5.
    assert d.step(4) == [Begin(Window(0, 3, 4, 5), 5)]


def test_resume_inside_a_recording_window_records_the_rest_of_it():
    d = driver(wait=2, warmup=1, active=3, repeat=1)  # warmup 2, record 3-5
    assert d.start(4) == [Begin(Window(0, 2, 3, 5), 4)]
    plan = recorded_steps(driver(wait=2, warmup=1, active=3, repeat=1), 4, [4, 5, 6])
    assert plan == {0: [4, 5]}


def test_start_again_closes_the_open_window():
    d = driver(wait=0)
    d.start(0)
    cmds = d.start(0)
    assert cmds[0] == End() and isinstance(cmds[1], Begin) and cmds[1].window.index == 1


def test_next_window_is_reported_with_the_index_it_would_get():
    d = driver()
    d.start(0)
    assert d.next_window() == Window(0, 2, 3, 4)
    d.step(0)
    d.step(1)
    assert d.next_window() == Window(1, 7, 8, 9)


def test_stopping_mid_window_records_up_to_the_last_finished_step():
    plan = recorded_steps(driver(wait=0, warmup=1, active=5, repeat=1), 0, [0, 1, 2])
    assert plan == {0: [1, 2]}
