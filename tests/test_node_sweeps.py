"""What a node keeps of runs that are over: plan boards and their acknowledgements, merged
timeline pieces (issue 46 item 12). Real files, real processes (one that lives, one gone)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from coordinator.protocol import plan_board
from worker_ext.agent import node_agent
from worker_ext.agent.plan_posts import STALE_S, sweep_boards
from worker_ext.agent.timeline_pieces import KEEP_S, PREFIX, PieceStore, sweep_left

OLD, NEW = "a" * 32, "b" * 32


def _gone_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _ack(bid: str, rank: int, pid: int, age_s: float = 0.0) -> None:
    path = plan_board.ack_path(bid, rank)
    plan_board.write_private(path, plan_board.encode_ack(plan_board.PlanAck(pid, 3, 1, [], [])))
    _age(path, age_s)


def _age(path: os.PathLike[str] | str, age_s: float) -> None:
    then = time.time() - age_s
    os.utime(path, (then, then))


def _board(bid: str, age_s: float) -> None:
    path = plan_board.board_path(bid)
    plan_board.write_private(path, plan_board.encode_board(plan_board.Board("r", "t", 1, [])))
    _age(path, age_s)


@pytest.mark.subprocess  # (a real process that has ended)
def test_a_board_of_a_run_that_is_over_goes_with_its_acknowledgements(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_PROFILER_PLANS_DIR", str(tmp_path / "plans"))
    gone = _gone_pid()
    _board(OLD, STALE_S * 2)  # old, and its ranks are gone: swept
    _ack(OLD, 0, gone)
    _ack(OLD, 1, gone)
    _board(NEW, STALE_S * 2)  # old, but one of its ranks lives: kept
    _ack(NEW, 0, gone)
    _ack(NEW, 1, os.getpid())
    _board("c" * 32, 1.0)  # its ranks gone, but written a second ago: kept
    _ack("d" * 32, 0, gone)  # no board, its process gone: swept
    _ack("e" * 32, 0, os.getpid())  # no board yet, its process lives: kept
    plans = plan_board.board_path(OLD).parent
    cut = plans / f".{OLD}.plan.x1y2.tmp"  # a write cut off long ago: swept
    cut.write_bytes(b"half")
    _age(cut, STALE_S * 2)
    fresh_cut = plans / f".{NEW}.plan.z3.tmp"  # (one being written now: kept)
    fresh_cut.write_bytes(b"half")
    removed = sweep_boards()
    assert sorted(removed) == sorted(
        [f"{OLD}.plan", f"{OLD}.0.ack", f"{OLD}.1.ack", f"{'d' * 32}.0.ack", cut.name]
    )
    assert sorted(p.name for p in plans.iterdir()) == sorted([
        f"{NEW}.plan", f"{NEW}.0.ack", f"{NEW}.1.ack", f"{'c' * 32}.plan",
        f"{'e' * 32}.0.ack", fresh_cut.name,
    ])  # fmt: skip
    assert sweep_boards() == []


def test_a_plans_directory_open_to_others_is_never_swept(tmp_path, monkeypatch):
    plans = tmp_path / "plans"
    plans.mkdir(mode=0o777)
    plans.chmod(0o777)
    (plans / f"{OLD}.plan").write_bytes(b"x")
    _age(plans / f"{OLD}.plan", STALE_S * 2)
    monkeypatch.setenv("RAY_PROFILER_PLANS_DIR", str(plans))
    assert sweep_boards() == [] and (plans / f"{OLD}.plan").exists()


def test_pieces_go_when_their_caller_never_came_back_and_when_the_agent_leaves(tmp_path):
    store = PieceStore()
    for name, made in (("late", time.monotonic() - KEEP_S - 1), ("now", time.monotonic())):
        d = tmp_path / name
        d.mkdir()
        store._pieces[name] = (str(d), made)
    store.sweep()  # (the agent runs it after each trace job, not only on the next merge)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["now"]
    store.drop_all()
    assert list(tmp_path.iterdir()) == [] and store._pieces == {}


def test_pieces_an_agent_killed_outright_left_are_removed_by_the_next(tmp_path):
    old, young, other = tmp_path / f"{PREFIX}old", tmp_path / f"{PREFIX}young", tmp_path / "x"
    for d in (old, young, other):
        d.mkdir()
        (d / "piece.json.gz").write_bytes(b"")
    for d in (old, other):
        _age(d, KEEP_S * 2)
    (tmp_path / f"{PREFIX}link").symlink_to(other)  # (a link is never followed)
    then = time.time() - KEEP_S * 2
    os.utime(tmp_path / f"{PREFIX}link", (then, then), follow_symlinks=False)
    assert sweep_left(str(tmp_path)) == [old.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [young.name, other.name, f"{PREFIX}link"]
    )
    assert (other / "piece.json.gz").exists()


def test_the_agent_sweeps_boards_and_pieces_with_the_stack_dumps(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_PROFILER_PLANS_DIR", str(tmp_path / "plans"))
    _board(OLD, STALE_S * 2)
    seen = []
    monkeypatch.setattr(node_agent, "sweep_left", lambda: seen.append("pieces"))
    monkeypatch.setattr(node_agent, "sweep_dumps", lambda: seen.append("dumps"))
    node_agent._sweep_node()
    assert seen == ["dumps", "pieces"] and not plan_board.board_path(OLD).exists()
