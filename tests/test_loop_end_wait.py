"""A loop's end and libkineto's traces (issue 54 item 1, a review): only a loop that ended
normally waits for the traces its process still writes, and a Ctrl-C during that wait still
frees the process's session slot."""

from __future__ import annotations

import os

import pytest

from coordinator.core.config import ProfilerConfig
from coordinator.core.schedule import Schedule
from coordinator.core.window_plan import WindowPlan
from worker_ext.rank.rank_profiler import RankProfiler
from worker_ext.rank.rank_session import FINISH_S, RankSession, _claim, _off


def session_with(tmp_path, finish) -> RankSession:
    cfg = ProfilerConfig.from_dict({"enable": True, "save_path": str(tmp_path), "active": 2})
    session = RankSession("t", 1, 2, None)  # (rank 1: no run to end)
    assert _claim(session) is None
    session.config = cfg
    session._profiler = RankProfiler(1, cfg, str(tmp_path / "run"))
    session._profiler.finish = finish  # type: ignore[method-assign]
    session._plan = WindowPlan(Schedule(cfg))
    return session


def test_only_a_loop_that_ended_normally_waits_for_libkineto(tmp_path):
    waits: list[float] = []
    for end_run in (True, False):
        session = session_with(tmp_path, waits.append)
        session.stop(end_run=end_run)
        assert _claim(session) is None  # (freed by stop: claimed again here)
        _off(session, "test", "done")
    assert waits == [FINISH_S, 0.0]  # (a loop that raised: a look, no wait)


def test_a_ctrl_c_during_the_wait_still_frees_the_slot(tmp_path):
    def interrupted(timeout_s: float) -> None:  # the fault: a second Ctrl-C while it waits
        raise KeyboardInterrupt

    session = session_with(tmp_path, interrupted)
    with pytest.raises(KeyboardInterrupt):
        session.stop()
    other = RankSession("t", 0, 1, None)
    assert _claim(other) is None, "the slot stayed taken"
    _off(other, "test", "done")


def test_the_wait_ends_once_the_agent_took_libkineto_s_file(tmp_path):
    # The agent removes the window's end marker right after it copied libkineto's file, which
    # it then unlinks; the hand-off stays pending through the summary and upload (injected
    # here: a summary that takes long), so the end marker is what says the wait is over.
    from worker_ext.agent.kineto_traces import ended_path
    from worker_ext.rank.kineto_rank import KinetoRankProfiler

    cfg = ProfilerConfig.from_dict({"enable": True, "save_path": str(tmp_path), "engine": "kineto"})
    rp = KinetoRankProfiler(0, cfg, str(tmp_path / "run"))
    rp.hand_off.is_pending = lambda index: True  # type: ignore[method-assign]
    log_file = str(tmp_path / ".kineto.policy.rank0.1.0.json")
    with open(ended_path(log_file), "w"):
        pass
    rp._writing = {0: log_file}
    rp.finish(0.2)
    assert rp._writing == {0: log_file}  # not copied yet: waited, and still writing
    os.unlink(ended_path(log_file))  # the agent copied it (and unlinked libkineto's file)
    rp.finish(30)
    assert rp._writing == {}
