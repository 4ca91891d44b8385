"""Captures at run time for SPMD ranks, the pure parts: a rank that learns of a capture late (but
before its warm-up) numbers and places every window as the coordinator does; a rank that learns
too late leaves its index as a gap; the board's wire format; the node agent's wait for the
ranks' acknowledgements (real files, real processes)."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from coordinator.core.config import ProfilerConfig
from coordinator.core.schedule import Schedule, Window
from coordinator.core.spmd_plan import Capture, earliest_step, take_captures
from coordinator.core.window_plan import Ignored, Start, Step, WindowPlan, replay
from coordinator.protocol import plan_board
from worker_ext.agent.plan_posts import BoardWriter, post_problem
from worker_ext.rank.board_reader import BoardReader


def _cfg(**kw: object) -> ProfilerConfig:
    base = {"enable": True, "save_path": "/nonexistent", "ranks": "all", "wait": 3, "warmup": 1,
            "active": 2, "repeat": 0}  # fmt: skip
    return ProfilerConfig.from_dict({**base, **kw}, check_paths=False)


def _starts(commands) -> list[Window]:
    return [c.window for c in commands if isinstance(c, Start)]


@pytest.mark.parametrize("seed", range(30))
def test_ranks_ahead_of_the_coordinator_number_and_place_captures_as_it_does(seed):
    """The coordinator's plan lags (rank 0 reports now and then); it plans captures at
    ``earliest_step`` and numbers them by their steps; each rank runs ahead of it by up to a
    few steps and takes the board at its own step before the capture's warm-up. Every rank
    opens the same windows, with the same indices and steps, as the coordinator."""
    rng = random.Random(seed)
    cfg = _cfg(skip_first=rng.randrange(0, 4), wait=rng.randrange(0, 5), active=rng.randrange(1, 4))
    coord = WindowPlan(Schedule(cfg))
    ranks = [WindowPlan(Schedule(cfg)) for _ in range(3)]
    boards: list[tuple[int, list[Capture]]] = []  # (the coordinator's step when posted, board)
    told, ran = _starts(coord.start(0)), [_starts(r.start(0)) for r in ranks]
    seen = [set() for _ in ranks], [set() for _ in ranks]
    pos = [0, 0, 0]  # the next step each rank runs
    step_s = 0.01  # rank 0 reports at most every 0.1 s: every 10 steps or sooner
    for k in range(400):
        if rng.random() < 0.2 or k - coord.next_boundary >= 9:
            got = replay(coord, k)
            assert not isinstance(got, Ignored)
            told += _starts(got)
        if rng.random() < 0.05:  # an operator asks; the lead covers where any rank can be
            since = (k - coord.next_boundary) * step_s
            lead_s = rng.uniform(0.02, 0.3)
            lead = earliest_step(coord.next_boundary, step_s, since, lead_s=lead_s)
            start = None if rng.random() < 0.5 else lead + rng.randrange(0, 30)
            w = coord.request_capture(rng.randrange(0, 3), rng.randrange(1, 4), start,
                                      earliest=lead, by_steps=True)  # fmt: skip
            if isinstance(w, Window):
                caps = [Capture(c, None) for c in coord.captures]
                boards.append((coord.next_boundary, caps))
        for i, plan in enumerate(ranks):  # each rank: at most a few steps ahead of step k
            while pos[i] <= k + rng.randrange(0, 4):
                for _, caps in boards:  # the board reaches each rank before its warm-ups
                    taken = take_captures(plan, caps, i, pos[i] + 1, seen[0][i], seen[1][i])
                    assert taken.late == [] and taken.off is None
                ran[i] += _starts(plan.step(pos[i]))  # type: ignore[arg-type]
                pos[i] += 1
    last = min(pos) - 1
    if coord.next_boundary <= last:
        told += _starts(replay(coord, last))  # type: ignore[arg-type]
    due = any(c.window.warmup_start <= last for _, caps in boards for c in caps)
    assert any(w.kind == "capture" for w in told) == due
    for i in range(3):
        upto = [w for w in ran[i] if w.warmup_start <= last]
        assert upto == [w for w in told if w.warmup_start <= last], f"rank {i}"


def test_a_rank_that_reads_the_board_after_the_warm_up_leaves_a_gap_and_keeps_the_numbers():
    cfg = _cfg(wait=5, warmup=0, active=1, repeat=0)  # scheduled windows at 5, 11, 17, ...
    coord, late = WindowPlan(Schedule(cfg)), WindowPlan(Schedule(cfg))
    coord.start(0), late.start(0)
    replay(coord, 2)
    cap = coord.request_capture(0, 2, 7, earliest=3, by_steps=True)
    assert isinstance(cap, Window) and cap.index == 1  # after the scheduled window at step 5
    told = _starts(replay(coord, 30))  # type: ignore[arg-type]
    ran = []
    for k in range(9):
        ran += _starts(late.step(k))  # type: ignore[arg-type]
    taken = take_captures(late, [Capture(cap, None)], 0, 9, set(), set())
    assert taken.late == [cap.index] and taken.held == [] and taken.off is None
    for k in range(9, 31):
        ran += _starts(late.step(k))  # type: ignore[arg-type]
    assert [w.index for w in told] == [0, 1, 2, 3, 4, 5]
    assert ran == [w for w in told if w.index != cap.index]


def test_a_rank_whose_windows_took_the_capture_s_number_stops_following_the_plan():
    cfg = _cfg(wait=2, warmup=0, active=1, repeat=0)  # windows at 2, 5, 8, ...
    coord, behind = WindowPlan(Schedule(cfg)), WindowPlan(Schedule(cfg))
    coord.start(0), behind.start(0)
    cap = coord.request_capture(0, 1, 3, earliest=3, by_steps=True)
    assert isinstance(cap, Window)
    for k in range(12):
        behind.step(k)
    taken = take_captures(behind, [Capture(cap, None)], 0, 12, set(), set())
    assert taken.off is not None and "numbered later windows" in taken.off


def test_a_capture_of_other_ranks_is_held_for_its_number_and_not_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_PROFILER_PLANS_DIR", str(tmp_path / "plans"))
    cfg = _cfg(wait=50, warmup=0, active=1, repeat=0)
    plan = WindowPlan(Schedule(cfg))
    plan.start(0)
    bid = plan_board.board_id("ns", "profiler", "run", "sft")
    cap = plan_board.BoardEntry(0, 3, 4, 5, "capture", [1])  # rank 1's only
    board = plan_board.Board("run", "sft", 7, [cap])
    plan_board.write_private(plan_board.board_path(bid), plan_board.encode_board(board))
    reader = BoardReader(bid, 0, "run", "sft", max_steps=1000)
    taken = reader.look(plan, 1)
    assert taken is not None and taken.held == [0] and reader.not_mine == {0}
    assert reader.look(plan, 2) is None  # (unchanged: one stat)
    ack = plan_board.decode_ack(plan_board.ack_path(bid, 0).read_bytes())
    assert (ack.pid, ack.step, ack.version, ack.held, ack.late) == (os.getpid(), 0, 7, [0], [])
    kept = [c for k in range(1, 8) for c in plan.step(k) if not reader.skips(c)]  # type: ignore[union-attr]
    assert kept == [] and plan.next_index == 1  # held, numbered, skipped
    assert [type(c) for k in range(8, 60) for c in plan.step(k)] == [Start, Step]  # type: ignore[union-attr]


def test_the_board_and_the_acknowledgement_are_decoded_strictly():
    entry = plan_board.BoardEntry(3, 10, 11, 12, "capture", None)
    board = plan_board.Board("r", "t", 1, [entry])
    assert plan_board.decode_board(plan_board.encode_board(board)) == board
    for bad in (b"", b"\x93\x01\x02\x03", b"x" * (plan_board.MAX_BOARD_BYTES + 1)):
        with pytest.raises(ValueError):
            plan_board.decode_board(bad)
    backwards = plan_board.Board("r", "t", 1, [plan_board.BoardEntry(3, 12, 11, 10, "x", None)])
    with pytest.raises(ValueError, match="bad steps"):
        plan_board.decode_board(plan_board.encode_board(backwards))
    with pytest.raises(ValueError):
        plan_board.decode_ack(plan_board.encode_board(board))
    with pytest.raises(ValueError):
        plan_board.board_path("../../etc/passwd")


def test_earliest_step_grows_with_the_lead_and_the_time_since_rank_0_reported():
    assert earliest_step(100, 0.5, 0.2) == 100 + 4 + 5
    assert earliest_step(100, None, None) == 100 + 4 + 2000  # (no pace yet: a short step)
    assert earliest_step(100, 0.01, 60.0) == earliest_step(100, 0.01, 1.0)  # (capped)


def _post(bid: str, window: int | None, ranks, timeout_s: float, version: int = 1):
    board = plan_board.Board(
        "run", "sft", version, [plan_board.BoardEntry(0, 5, 5, 6, "capture", None)]
    )
    return {"board": bid, "blob": plan_board.encode_board(board), "version": version,
            "window": window, "ranks": ranks, "timeout_s": timeout_s}  # fmt: skip


@pytest.mark.subprocess
@pytest.mark.asyncio
async def test_the_agent_writes_the_board_and_names_each_rank_by_its_answer(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_PROFILER_PLANS_DIR", str(tmp_path / "plans"))
    bid = plan_board.board_id("ns", "profiler", "run", "sft")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    writer = BoardWriter("node-1")
    for rank, held, late in ((0, [0], []), (1, [], [0])):
        ack = plan_board.PlanAck(os.getpid(), 3, 1, held, late)
        plan_board.write_private(plan_board.ack_path(bid, rank), plan_board.encode_ack(ack))
    stale = plan_board.PlanAck(gone.pid, 3, 1, [0], [])  # (a dead process's acknowledgement)
    plan_board.write_private(plan_board.ack_path(bid, 2), plan_board.encode_ack(stale))
    ranks = [(0, os.getpid()), (1, os.getpid()), (2, gone.pid), (3, os.getpid())]
    answer = await writer.post(_post(bid, 0, ranks, 0.3))
    assert answer["held"] == [(0, 3)] and answer["late"] == [(1, 3)]
    assert answer["lost"] == [2] and answer["silent"] == [3]
    assert plan_board.decode_board(plan_board.board_path(bid).read_bytes()).version == 1
    await writer.post(_post(bid, None, [], 0.0, version=0))  # an older board is not written
    assert plan_board.decode_board(plan_board.board_path(bid).read_bytes()).version == 1
    assert post_problem({**_post(bid, 0, [], 1.0), "board": "../x"}) is not None
    with pytest.raises(ValueError):
        await writer.post({**_post(bid, 0, [], 1.0), "ranks": [("a", 1)]})  # type: ignore[typeddict-item]


def test_an_spmd_capture_without_a_start_takes_the_first_free_steps_past_other_windows():
    cfg = _cfg(wait=3, warmup=1, active=2, repeat=0)  # warm-up 3, record 4-5; 9, 10-11; ...
    plan = WindowPlan(Schedule(cfg))
    plan.start(0)
    w = plan.request_capture(1, 2, None, earliest=4, by_steps=True)  # (3 steps: the wait 6-8)
    assert isinstance(w, Window) and (w.warmup_start, w.first, w.last) == (6, 7, 8)
    assert w.index == 1  # (after the scheduled window at 3-5)
    w = plan.request_capture(1, 3, None, earliest=4, by_steps=True)  # (4 steps fit no wait)
    assert isinstance(w, str) and "overlap" in w
    assert isinstance(plan.request_capture(1, 1, 5, earliest=6, by_steps=True), str)  # (early)
    assert isinstance(plan.request_capture(1, 2, None), str)  # (actor ranks: refused as before)


def test_a_silent_rank_that_hears_of_a_capture_after_it_opened_keeps_the_run_s_numbers():
    """Rank 1 was silent (a long step) past a capture's warm-up; the board it reads later still
    lists the capture (opened, without rank 1): it keeps the number free and records nothing
    under it. A restarted rank, before its loop, leaves opened captures to rank_start."""
    cfg = _cfg(wait=5, warmup=0, active=1, repeat=0)  # scheduled windows at 5, 11, 17, ...
    coord, silent = WindowPlan(Schedule(cfg)), WindowPlan(Schedule(cfg))
    coord.start(0), silent.start(0)
    replay(coord, 1)
    cap = coord.request_capture(0, 2, 7, earliest=3, by_steps=True)
    assert isinstance(cap, Window)
    told = _starts(replay(coord, 40))  # type: ignore[arg-type]
    ran = _starts([c for k in range(10) for c in silent.step(k)])  # type: ignore[union-attr]
    board = [Capture(cap, (0,), opened=True)]  # (rank 1 named late: left out of its ranks)
    taken = take_captures(silent, board, 1, 10, set(), set())
    assert taken.late == [cap.index] and taken.off is None
    ran += _starts([c for k in range(10, 41) for c in silent.step(k)])  # type: ignore[union-attr]
    assert ran == [w for w in told if w.index != cap.index]
    restarted = WindowPlan(Schedule(cfg))
    restarted.next_index = coord.next_index  # (rank_start's index_base)
    taken = take_captures(restarted, board, 1, None, set(), set())
    assert taken.held == [cap.index] and not restarted.captures and not restarted.gaps


def test_a_rank_behind_its_steps_records_an_opened_capture_it_is_one_of():
    cfg = _cfg(wait=50, warmup=0, active=1, repeat=0)
    behind = WindowPlan(Schedule(cfg))
    behind.start(0)
    cap = Window(0, 20, 20, 21, "capture")
    taken = take_captures(behind, [Capture(cap, (0, 1), opened=True)], 1, 10, set(), set())
    assert taken.held == [0]
    assert _starts([c for k in range(10, 30) for c in behind.step(k)]) == [cap]  # type: ignore[union-attr]
