"""The incremental checkpoint against Ray's real key-value store: a settled window is written
once, an open one at each save (in pieces, in later turns, when it is large), and a load puts
everything back."""

from coordinator.core.config import ProfilerConfig
from coordinator.core.records import TrainerRecord
from coordinator.core.run import new_run
from coordinator.core.schedule import Window
from coordinator.protocol.summary_codec import KernelRow, RankSummary, encode_summary
from coordinator.service import checkpoint


def run_with_windows(settled: int):
    run = new_run(ProfilerConfig(max_windows=4), set())
    st = run.state
    keys = st.register(TrainerRecord("t", "policy", [0, 1], {}, None), None, lambda r: True)
    for i in range(settled + 1):
        rec = st.open_window(Window(i, 10 * i, 10 * i + 1, 10 * i + 2), keys)
        for key in keys:
            kernels = [KernelRow("aten::mm", 5.0 + i, 1, 0)]
            st.ingest_summary(
                key, encode_summary(RankSummary(key[1], i, (1, 2), False, "cpu", kernels))
            )
        if i < settled:
            st.close_window(rec)
    return run


def stored(ckpt):
    from ray.experimental import internal_kv

    prefix = f"{ckpt.namespace}/{ckpt.name}".encode()
    return sorted(internal_kv._internal_kv_list(prefix, namespace=checkpoint.KV_NAMESPACE))


def test_settled_windows_are_written_once_and_come_back(ray_session):
    ckpt = checkpoint.Checkpointer("tests", "ckpt-once")
    run = run_with_windows(settled=3)
    ckpt.save_runs(run, [], {"throttled": False, "restarts": 0})
    ckpt.flush()
    first = ckpt.stats["bytes"]
    keys = stored(ckpt)
    assert [k for k in keys if b"/window/" in k] == [
        f"tests/ckpt-once/window/{run.name}/{i}".encode() for i in range(4)
    ]
    ckpt.save_runs(run, [], {"throttled": False, "restarts": 0})  # only the open one again
    ckpt.flush()
    assert ckpt.stats["bytes"] < first and ckpt.stats["error"] is None
    runs, extra = checkpoint.load_runs("tests", "ckpt-once")
    (back,) = runs
    assert list(back.state.windows) == [0, 1, 2, 3] and extra["restarts"] == 0
    assert back.state.windows[1].aggregates["t"].top(1)[0]["total_us"] == 12.0
    assert not back.state.windows[3].closed
    checkpoint.delete("tests", "ckpt-once")
    assert stored(ckpt) == []


def test_a_window_dropped_from_the_history_is_deleted_from_the_store(ray_session):
    ckpt = checkpoint.Checkpointer("tests", "ckpt-drop")
    run = run_with_windows(settled=2)
    ckpt.save_runs(run, [], {})
    ckpt.flush()
    del run.state.windows[0]
    ckpt.save_runs(run, [], {})
    ckpt.flush()
    windows = [k for k in stored(ckpt) if b"/window/" in k]
    assert windows == [f"tests/ckpt-drop/window/{run.name}/{i}".encode() for i in (1, 2)]
    checkpoint.delete("tests", "ckpt-drop")


async def test_rank_records_go_in_chunks_in_later_turns_and_come_back(ray_session):
    """A rank record that changed is written in chunks of ``RANK_CHUNK`` records, one per turn
    of the event loop, after the call that saved; a registration writes its records at once
    (they must match the trainers on a load)."""
    import asyncio

    ckpt = checkpoint.Checkpointer("tests", "ckpt-chunks")
    run = new_run(ProfilerConfig(max_windows=4), set())
    st = run.state
    n = 2 * checkpoint.RANK_CHUNK + 5
    keys = st.register(TrainerRecord("t", "policy", list(range(n)), {}, None), None, bool)
    ckpt.save_runs(run, [], {})  # a registration: the records now
    assert not ckpt._ranks_due and ckpt.rank_chunks[run.name] == 3
    st.rank_failed(keys[-1], "lost", {"where": "ray", "type": "Died", "message": "gone"})
    ckpt.save_runs(run, [], {})  # a changed record: in later turns
    assert run.name in ckpt._ranks_due
    turns = 0
    while ckpt._ranks_due and turns < 100:
        await asyncio.sleep(0)
        turns += 1
    assert 3 <= turns < 100
    ckpt.flush()
    (back,), _ = checkpoint.load_runs("tests", "ckpt-chunks")
    assert len(back.state.ranks) == n and back.state.ranks[keys[-1]].state == "lost"
    # Fewer ranks (a trainer registered again, smaller): the chunks beyond are deleted.
    st.register(TrainerRecord("t", "policy", list(range(10)), {}, None), None, bool)
    ckpt.save_runs(run, [], {})
    ckpt.flush()
    chunks = [k for k in stored(ckpt) if f"/ranks/{run.name}/".encode() in k]
    assert chunks == [f"tests/ckpt-chunks/ranks/{run.name}/0".encode()]
    (back,), _ = checkpoint.load_runs("tests", "ckpt-chunks")
    assert sorted(back.state.ranks) == [("t", r) for r in range(10)]
    checkpoint.delete("tests", "ckpt-chunks")
    assert stored(ckpt) == []


async def test_a_large_window_is_pickled_in_later_turns_as_it_was_at_the_save(ray_session):
    """A window of more than ``PIECE`` ranks is copied in the save's turn and pickled in pieces
    in the next turns; what a later call changes meanwhile is not in it, and the runs' record
    is written after it."""
    import asyncio

    from coordinator.service.window_pieces import PIECE

    ckpt = checkpoint.Checkpointer("tests", "ckpt-pieces")
    run = new_run(ProfilerConfig(max_windows=4), set())
    st = run.state
    n = 2 * PIECE + 5
    keys = st.register(TrainerRecord("t", "policy", list(range(n)), {}, None), None, lambda r: True)
    rec = st.open_window(Window(0, 1, 2, 3), keys)
    kernels = [KernelRow("aten::mm", 5.0, 1, 0)]
    for key in keys[:-1]:
        st.ingest_summary(
            key, encode_summary(RankSummary(key[1], 0, (2, 3), False, "cpu", kernels))
        )
    ckpt.flush()  # (the registration's rank records)
    ckpt.save_runs(run, [], {})
    assert len(ckpt._saves) == 1  # the window: in pieces, in later turns
    last = keys[-1]  # a summary folded in after the save: not in what it stores
    st.ingest_summary(last, encode_summary(RankSummary(last[1], 0, (2, 3), False, "cpu", kernels)))
    turns = 0
    while ckpt._saves and turns < 100:
        await asyncio.sleep(0)
        turns += 1
    assert 5 <= turns < 100  # (three sets and dicts of n entries at least, three pieces each)
    ckpt.flush()
    (back,), _ = checkpoint.load_runs("tests", "ckpt-pieces")
    got = back.state.windows[0]
    assert got.participants == rec.participants and len(got.participants) == n
    agg = got.aggregates["t"]
    assert (
        last[1] not in agg.rank_totals
        and len(agg.rank_totals) == n - 1
        and agg.top(1)[0]["total_us"] == 5.0 * (n - 1)
    )
    assert len(rec.aggregates["t"].rank_totals) == n  # (the live window has it)
    checkpoint.delete("tests", "ckpt-pieces")
    assert stored(ckpt) == []
