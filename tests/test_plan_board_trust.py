"""The plan boards on a node shared with other users (issue 46, items 1 and 2): a directory
private to its user, writes that never follow a planted link, and a rank that trusts nothing on
a board its own run did not say."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coordinator.core.config import ProfilerConfig
from coordinator.core.schedule import Schedule
from coordinator.core.window_plan import WindowPlan
from coordinator.protocol import plan_board
from worker_ext.rank.board_reader import BoardReader

BID = plan_board.board_id("ns", "profiler", "run", "sft")


@pytest.fixture
def plans(tmp_path, monkeypatch) -> Path:
    where = tmp_path / "plans"  # (made by the code under test, mode 0700)
    monkeypatch.setenv("RAY_PROFILER_PLANS_DIR", str(where))
    return where


def _plan() -> WindowPlan:
    cfg = ProfilerConfig.from_dict({"enable": True, "save_path": "/tmp", "wait": 50, "warmup": 0,
                                    "active": 1, "repeat": 0})  # fmt: skip
    plan = WindowPlan(Schedule(cfg))
    plan.start(0)
    return plan


def _post(board: plan_board.Board) -> None:
    plan_board.write_private(plan_board.board_path(BID), plan_board.encode_board(board))


def test_the_plans_directory_is_made_private_to_its_user(plans):
    assert plan_board.board_path(BID).parent == plans
    assert (plans.stat().st_mode & 0o777, plans.stat().st_uid) == (0o700, os.getuid())


def test_a_plans_directory_open_to_others_is_refused(plans):
    plans.mkdir(mode=0o700)
    plans.chmod(0o777)
    with pytest.raises(PermissionError, match="has mode 0777, open to others.*mode 0700"):
        plan_board.board_path(BID)


def test_a_plans_directory_that_is_a_link_is_refused(plans, tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    plans.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PermissionError, match="is a link or not a directory"):
        plan_board.board_path(BID)


def test_another_users_plans_directory_is_refused(plans):
    if os.getuid() != 0:
        pytest.skip("only root can give a directory to another user here")
    plans.mkdir(mode=0o700)
    os.chown(plans, 65534, -1)
    with pytest.raises(PermissionError, match="belongs to uid 65534"):
        plan_board.board_path(BID)


def test_a_write_never_follows_a_link_planted_at_its_temporary_name(plans, tmp_path):
    plans.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    target = plan_board.board_path(BID)
    # The names a writer could be predicted to use (the old one: .{name}.{pid}.tmp).
    for pid in range(os.getpid() - 2, os.getpid() + 3):
        (plans / f".{target.name}.{pid}.tmp").symlink_to(victim)
    target.symlink_to(victim)  # and the board's own name
    plan_board.write_private(target, b"board")
    assert victim.read_bytes() == b"precious"
    assert not target.is_symlink() and target.read_bytes() == b"board"


def test_a_board_read_never_follows_a_link(plans, tmp_path):
    plans.mkdir(mode=0o700)
    (tmp_path / "other").write_bytes(b"x")
    plan_board.board_path(BID).symlink_to(tmp_path / "other")
    with pytest.raises(OSError):
        plan_board.read_capped(plan_board.board_path(BID))


def test_a_board_naming_another_run_or_trainer_is_ignored_and_counted(plans):
    plan = _plan()
    reader = BoardReader(BID, 0, "run", "sft", max_steps=1000)
    for run, trainer in (("someone-elses-run", "sft"), ("run", "grpo")):
        entry = plan_board.BoardEntry(0, 3, 4, 5, "capture", None)
        _post(plan_board.Board(run, trainer, 1 + reader.ignored.total(), [entry]))
        assert reader.look(plan, 1) is None
    assert reader.ignored["other run"] == 2 and plan.captures == []
    assert not plan_board.ack_path(BID, 0).exists()  # (nothing acknowledged for it either)


def test_a_capture_of_unknown_kind_or_too_long_is_ignored_and_counted(plans):
    plan = _plan()
    reader = BoardReader(BID, 0, "run", "sft", max_steps=1000)
    endless = plan_board.BoardEntry(0, 3, 4, 10**12, "capture", None)
    odd = plan_board.BoardEntry(1, 3, 4, 5, "rootkit", None)
    fine = plan_board.BoardEntry(2, 3, 4, 1002, "capture", None)  # 1000 steps: allowed
    _post(plan_board.Board("run", "sft", 1, [endless, odd, fine]))
    taken = reader.look(plan, 1)
    assert taken is not None and taken.held == [2]
    assert dict(reader.ignored) == {"too long": 1, "unknown kind": 1}


def test_a_rank_whose_plans_directory_is_refused_takes_nothing_and_never_raises(plans):
    plans.mkdir(mode=0o700)
    plans.chmod(0o755)
    reader = BoardReader(BID, 0, "run", "sft", max_steps=1000)
    assert reader.refused is not None and "has mode 0755" in reader.refused
    assert reader.look(_plan(), 1) is None
