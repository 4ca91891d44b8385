"""SPMD ranks, the pure parts: every rank's plan and the coordinator's replayed plan agree; the
coordinator's wait for the ranks' closes; where a rank's identity comes from."""

from __future__ import annotations

import random

import pytest

from coordinator.core.config import ProfilerConfig
from coordinator.core.records import RankRecord, TrainerRecord
from coordinator.core.run import new_run
from coordinator.core.schedule import Schedule
from coordinator.core.window_plan import Ignored, Start, WindowPlan, replay
from coordinator.service.spmd_ranks import SpmdRanks
from worker_ext.rank.rank_session import rank_and_world


def _cfg(**kw: object) -> ProfilerConfig:
    base = {"enable": True, "save_path": "/nonexistent", "ranks": "all", "wait": 3, "warmup": 1,
            "active": 2, "repeat": 0}  # fmt: skip
    return ProfilerConfig.from_dict({**base, **kw}, check_paths=False)


@pytest.mark.parametrize("seed", range(20))
def test_the_replayed_plan_opens_and_closes_the_windows_every_rank_ran(seed):
    """A rank steps every step; rank 0 reports only some of them (at most every 0.1 s, and on a
    window's first and last steps); the coordinator's replay gives the same commands, in order."""
    rng = random.Random(seed)
    first = rng.randrange(0, 30)
    cfg = _cfg(skip_first=rng.randrange(0, 5), wait=rng.randrange(0, 6), active=rng.randrange(1, 4))
    rank, coord = WindowPlan(Schedule(cfg)), WindowPlan(Schedule(cfg))
    ran = list(rank.start(first))
    told = list(coord.start(first))
    for k in range(first, first + 200):
        ran += rank.step(k)  # type: ignore[operator]
        if rng.random() < 0.2 or k == first + 199:
            got = replay(coord, k)
            assert not isinstance(got, Ignored)
            told += got
    assert told == ran and any(isinstance(c, Start) for c in ran)
    assert isinstance(replay(coord, first + 150), Ignored)  # (a report from behind: ignored)


def test_a_replay_past_its_bound_takes_the_steps_as_skipped():
    plan = WindowPlan(Schedule(_cfg(wait=0, warmup=0, active=1, repeat=0)))
    plan.start(0)
    cmds = replay(plan, 10**9)
    assert isinstance(cmds, list) and plan.last_step == 10**9
    assert len(cmds) <= 2 * 100_001  # bounded work, whatever the gap


def _spmd_run(world: int, worker_timeout_s: float = 30.0):
    run = new_run(_cfg(worker_timeout_s=worker_timeout_s), set())
    st = run.state
    t = TrainerRecord("sft", "policy", list(range(world)), {}, None, spmd=True, world=world)
    st.register(t, True, lambda r: True)
    return run


def _close_window(run, index: int, first: int, last: int):
    from coordinator.core.schedule import Window

    rec = run.state.open_window(Window(index, first, first, last), sorted(run.state.ranks))
    run.state.close_window(rec)
    return rec


def test_a_window_waits_for_every_rank_s_close_then_marks_the_late_one():
    run = _spmd_run(3)
    st, spmd = run.state, SpmdRanks(None, None, list)  # type: ignore[arg-type]  # (sweep is pure)
    rec = _close_window(run, 0, 3, 4)
    spmd.sweep(run, now=100.0)
    assert rec.summaries_pending == {("sft", 0), ("sft", 1), ("sft", 2)}
    closed = {"window": 0, "steps": [3, 4], "partial": False, "trace_path": None}
    for r in (0, 1):
        st.apply_reply(("sft", r), {"state": "ok", "closed": closed, "summaries_pending": []})
    spmd.sweep(run, now=110.0)
    assert rec.summaries_pending == {("sft", 2)}  # (ranks 0 and 1: nothing to wait for)
    spmd.sweep(run, now=131.0)  # past worker_timeout_s (30 s) since the coordinator closed it
    assert rec.summaries_pending == set()
    agg = rec.aggregate("sft")
    assert set(agg.bad_ranks) == {2} and agg.bad_ranks[2].startswith("late: rank 2")
    assert st.counters["lost_summaries"] == 1
    spmd.sweep(run, now=500.0)  # marked once
    assert st.counters["lost_summaries"] == 1


def test_a_stop_s_forced_sweep_ends_the_wait_and_actor_ranks_are_never_waited_for():
    run = _spmd_run(2)
    st, spmd = run.state, SpmdRanks(None, None, list)  # type: ignore[arg-type]
    actors = TrainerRecord("gen", "rollout", [0], {}, None)
    st.trainers["gen"] = actors
    st.ranks[("gen", 0)] = RankRecord("gen", 0, True)
    rec = _close_window(run, 0, 1, 1)
    spmd.sweep(run, now=0.0)
    assert rec.summaries_pending == {("sft", 0), ("sft", 1)}
    spmd.sweep(run, now=1.0, force=True)
    assert rec.summaries_pending == set() and set(rec.aggregate("sft").bad_ranks) == {0, 1}
    assert "gen" not in rec.aggregates


def test_a_rank_knows_itself_from_torch_distributed_or_its_arguments_and_says_when_it_cannot():
    assert rank_and_world(1, 4) == (1, 4)
    no = rank_and_world(None, None)
    assert isinstance(no, str) and no.startswith("no rank information")
    assert rank_and_world(4, 4) == "rank 4 is not in 0..3 (world_size 4)"
