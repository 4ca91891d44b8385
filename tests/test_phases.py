"""Per-step phase times: kept for every step, bounded, checked as they arrive, shown. Pure."""

from __future__ import annotations

import array
import asyncio

import pytest

from coordinator.client.phase_buffer import PhaseBuffer
from coordinator.client.phase_clock import PhaseClock, Region
from coordinator.client.rank_reports import StepReports
from coordinator.client.step_client import StepClient
from coordinator.core.phases import (
    BUCKET_STEPS,
    EXACT_STEPS,
    MAX_REGIONS,
    PhaseLog,
    check_records,
    check_walls,
    walls_records,
)
from coordinator.ops import notebook as nb
from coordinator.ops.tables import render_phases


def test_every_step_is_kept_exactly_then_in_buckets_and_nothing_is_lost():
    log = PhaseLog()
    n = EXACT_STEPS + 25 * BUCKET_STEPS + 50
    for k in range(0, n, 50):  # reports carry many records
        log.add([[s, 0.1 + s * 1e-6, {"train": 0.06, "generate": 0.03}] for s in range(k, k + 50)])
    r = log.reply(last=EXACT_STEPS, buckets=10_000)
    assert log.steps_seen == n and r["exact_steps"] == EXACT_STEPS
    assert r["steps"][-1]["step"] == log.steps_seen - 1
    folded = sum(b["steps"] for b in r["buckets"])
    assert folded + EXACT_STEPS == log.steps_seen  # every step, exact or in a bucket
    b = r["buckets"][0]
    assert (b["first"], b["last"], b["steps"]) == (0, BUCKET_STEPS - 1, BUCKET_STEPS)
    assert b["mean_ms"] == {"train": 60.0, "generate": 30.0}
    assert b["slowest_step"] == BUCKET_STEPS - 1
    assert r["slowest"][0]["step"] == log.steps_seen - 1  # the longest wall time
    shares = {g["region"]: g["share"] for g in r["regions"]}
    wall = sum(x["wall_ms"] for x in r["steps"])
    assert shares["train"] == pytest.approx(60.0 * EXACT_STEPS / wall, abs=1e-4)


def test_old_or_repeated_steps_and_regions_beyond_the_cap_are_counted_not_kept():
    log = PhaseLog()
    assert log.add([[5, 1.0, {"a": 0.5}], [5, 1.0, {"a": 0.5}], [4, 1.0, {}]]) == 1
    many = {f"r{i}": 0.001 for i in range(MAX_REGIONS + 3)}
    assert log.add([[6, 1.0, many]]) == 1
    assert len(log.names) == MAX_REGIONS and log.ignored == 2 + 4  # "a" took one name
    assert log.reply(last=0)["steps"] == []


@pytest.mark.parametrize(
    "records",
    [
        "x",
        [[1, 2]],
        [[-1, 0.1, {}]],
        [[True, 0.1, {}]],
        [[1, float("nan"), {}]],
        [[1, -0.1, {}]],
        [[1, 0.1, {"": 0.1}]],
        [[1, 0.1, {"a" * 65: 0.1}]],
        [[1, 0.1, {"a": "slow"}]],
        [[1, 0.1, {f"r{i}": 0.0 for i in range(MAX_REGIONS + 1)}]],
        [[1, 0.1, {}]] * 20_001,
    ],
)
def test_malformed_phase_records_are_refused_with_a_reason(records):
    assert check_records(records)


@pytest.mark.parametrize(
    "walls",
    [
        "x",
        (1,),
        (-1, [0.1]),
        (True, [0.1]),
        (2**62, [0.1]),
        (1, "0.1"),
        (1, [0.1, float("nan")]),
        (1, [0.1, -0.1]),
        (1, [0.1, "slow"]),
        (1, array.array("d", [float("inf")])),
        (1, [0.1] * 20_001),
    ],
)
def test_malformed_walls_are_refused_with_a_reason(walls):
    assert check_walls(walls)


def test_a_compact_run_of_walls_is_kept_as_a_record_a_step_after_the_records():
    """Rank 0's report: records (a step with regions), then the steps after it as wall times."""
    walls = (3, array.array("d", [0.5, 0.25]))
    assert check_walls(walls) is None and check_walls((0, [])) is None
    log = PhaseLog()
    assert log.add([[2, 1.0, {"train": 0.5}], *walls_records(walls)]) == 3
    got = log.reply(last=10)["steps"]
    assert [(s["step"], s["wall_ms"]) for s in got] == [(2, 1000.0), (3, 500.0), (4, 250.0)]


def _recording(sent: list) -> type:
    """A stand-in coordinator handle whose ``step.remote`` notes its arguments in ``sent``."""

    class Coordinator:
        class step:  # noqa: N801 (an actor method's handle)
            @staticmethod
            def remote(*args):
                sent.append(args)

    return Coordinator


def test_rank_0_sends_steps_with_no_region_as_walls_and_keeps_their_order():
    sent, tick = [], 1 / 64  # (clock readings exact in binary)
    now = iter([8.0, 8.5, *(8.5 + tick * i for i in range(1, 6))])

    Coordinator = _recording(sent)

    reports = StepReports(Coordinator, "t", now=lambda: next(now))
    reports.clock.begin_step()
    reports.step(0, now=False)  # (the first report goes at once)
    reports.step(1, now=False)
    with Region(reports.clock, "train"):
        pass
    reports.step(2, now=False)
    reports.step(4, now=False)  # (step 3 skipped)
    reports.step(5, now=True)  # (a window's first or last step: sent at once)
    reports.step(6, now=False)  # (a tick after the last report: not sent yet)
    assert reports.unreported == 6
    reports.flush()
    got = [
        (step, [(r[0], r[1], list(r[2])) for r in records or ()], walls and (walls[0], [*walls[1]]))
        for _, step, waiting, records, walls in sent
    ]
    assert got == [
        (0, [], (0, [0.5])),
        (5, [(1, tick, []), (2, tick, ["train"])], (4, [tick, tick])),
        (6, [], (6, [tick])),
    ]
    assert reports.unreported is None and not any(waiting for _, _, waiting, _, _ in sent)


def test_rank_0_times_a_step_on_the_reading_its_session_took():
    """``RankSession.step`` reads the clock once a step (for the board's look too) and hands
    the reading on: the step's wall time is taken from it, and the reporter's own clock is not
    read again (a step with regions still reads it, for its record)."""
    sent, readings = [], iter([1.0])

    Coordinator = _recording(sent)

    reports = StepReports(Coordinator, "t", now=lambda: next(readings))
    reports.clock.begin_step()  # (1.0: the only reading of its own clock)
    reports.step(0, now=False, reading=1.25)
    reports.step(1, now=True, reading=1.75)
    assert [(walls[0], list(walls[1])) for *_, walls in sent] == [(0, [0.25]), (1, [0.5])]
    assert reports.clock.lapped == 1.75


def test_one_buffer_for_both_reporters_keeps_the_newest_steps_in_order():
    """The single controller's ``StepClient`` and rank 0's ``StepReports`` hold their records in
    one ``PhaseBuffer``: at most ``limit`` steps while the coordinator is away, the oldest
    half dropped past it, and the records before the compact run, in step order."""
    assert isinstance(StepClient(None, "t").phases, PhaseBuffer)
    assert isinstance(StepReports(None, "t").phases, PhaseBuffer)
    buf = PhaseBuffer(limit=10)
    for k in range(25):
        buf.add([k, 0.1, {"train": 0.05}])
    records, walls = buf.take()
    assert walls is None and [r[0] for r in records] == list(range(15, 25))
    assert buf.dropped == 15 and buf.take() == (None, None)
    for k in range(30, 55):
        buf.add_wall(k, 0.25)
    buf.add([55, 0.5, {"train": 0.25}])
    buf.add_wall(56, 0.125)
    buf.add_wall(58, 0.125)  # (57 skipped: the run so far becomes records)
    records, (first, seconds) = buf.take()
    kept = [r[0] for r in records] + [first + i for i in range(len(seconds))]
    assert kept == sorted(kept) and kept[-4:] == [54, 55, 56, 58] and len(kept) <= 10
    assert buf.dropped == 15 + 25 + 3 - len(kept)


def test_regions_add_up_within_a_step_in_with_and_async_with():
    clock = PhaseClock()
    clock.begin_step()

    async def generate():
        async with Region(clock, "generate"):
            await asyncio.sleep(0.01)

    asyncio.run(generate())
    with Region(clock, "train"):
        pass
    with Region(clock, "generate"):
        pass
    step, wall, regions = clock.close_step(3)
    assert step == 3 and set(regions) == {"generate", "train"}
    assert 0.01 <= regions["generate"] <= wall and sum(regions.values()) <= wall
    assert clock.close_step(4)[2] == {}  # the next step starts empty
    assert Region(None, "off").__enter__() is not None  # hooks off: still a context manager


def test_the_table_and_the_frame_show_each_region_and_the_time_in_none():
    log = PhaseLog()
    log.add([[k, 0.1, {"generate": 0.05, "train": 0.04}] for k in range(10)])
    log.add([[10, 0.5, {"generate": 0.45, "train": 0.04}]])
    pt = log.reply(last=100, run="run_x", trainer_id="rl")
    text = render_phases(pt)
    assert "the last 11 steps (0-10)" in text and "step 10: 500.0 ms" in text
    assert text.splitlines()[3].split() == ["generate", "86.4", "63.3%", "450.0"]
    frame = nb.phases_frame(pt)
    assert list(frame.columns) == ["generate", "train", "other"]
    assert frame.sum(axis=1).round(6).tolist() == [100.0] * 10 + [500.0]
    assert render_phases(PhaseLog().reply(run="r")).endswith("marks a step's regions)")


def test_the_region_that_grew_names_an_auto_capture_s_slow_steps():
    log = PhaseLog()
    log.add([[k, 0.10, {"generate": 0.05, "train": 0.04}] for k in range(20)])
    log.add([[k, 0.20, {"generate": 0.14, "train": 0.04}] for k in range(20, 23)])
    assert log.grown_region(20, 22) == "generate"
    log.add([[k, 0.30, {"generate": 0.05, "train": 0.04}] for k in range(23, 26)])
    assert log.grown_region(23, 25) is None  # the time in no region grew: not a region's doing
    assert log.grown_region(0, 3) is None  # nothing before to compare with
    assert PhaseLog().grown_region(5, 9) is None
