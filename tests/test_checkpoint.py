"""The coordinator's state in Ray's real key-value store, through the record's one codec, one
writer and one reader: a settled window is written once, an open one at each save (copied in
the save's turn, encoded off the event loop), rank records in chunks, actor handles as Ray
serializes them, and a load puts everything back. No pickle."""

import asyncio

import ray

from coordinator.core.config import ProfilerConfig
from coordinator.core.records import TrainerRecord
from coordinator.core.run import new_run
from coordinator.core.schedule import Window
from coordinator.core.state_codec import RANK_CHUNK
from coordinator.protocol.summary_codec import KernelRow, RankSummary, encode_summary
from coordinator.service import state_store
from coordinator.service.kv_store import KV_NAMESPACE

EXTRA = {"throttled": False, "restarts": 0}


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


def stored(saver, part: str = ""):
    from ray.experimental import internal_kv

    prefix = f"{saver.namespace}/{saver.name}/".encode()
    keys = internal_kv._internal_kv_list(prefix, namespace=KV_NAMESPACE)
    return sorted(k.decode()[len(prefix) :] for k in keys if part.encode() in k)


def loaded(name: str):
    recs, extra = state_store.load_runs("tests", name)
    for rec in recs:
        assert rec.problems == [], rec.problems
    return [rec.run for rec in recs], extra


def test_settled_windows_are_written_once_and_come_back(ray_session):
    saver = state_store.StateSaver("tests", "ckpt-once")
    run = run_with_windows(settled=3)
    saver.save_runs(run, [], EXTRA)
    assert saver.flush()
    first = saver.writes.stats()["files"]
    assert stored(saver, "/windows/") == [
        f"runs/{run.name}/windows/{i:06d}.msgpack" for i in range(4)
    ]
    saver.save_runs(run, [], EXTRA)  # only the open one again, with the state
    assert saver.flush()
    again = saver.writes.stats()["files"] - first
    assert again == 4 and saver.entry()["error"] is None  # window 3, state, run, coordinator
    runs, extra = loaded("ckpt-once")
    (back,) = runs
    assert list(back.state.windows) == [0, 1, 2, 3] and extra["restarts"] == 0
    assert back.state.windows[1].aggregates["t"].top(1)[0]["total_us"] == 12.0
    assert not back.state.windows[3].closed
    assert back.config.to_dict() == run.config.to_dict()
    assert sorted(back.state.ranks) == [("t", 0), ("t", 1)]
    state_store.delete("tests", "ckpt-once")
    assert stored(saver) == []


def test_a_window_dropped_from_the_history_is_deleted_from_the_store(ray_session):
    saver = state_store.StateSaver("tests", "ckpt-drop")
    run = run_with_windows(settled=2)
    saver.save_runs(run, [], EXTRA)
    saver.flush()
    del run.state.windows[0]
    saver.save_runs(run, [], EXTRA)
    saver.flush()
    assert stored(saver, "/windows/") == [
        f"runs/{run.name}/windows/{i:06d}.msgpack" for i in (1, 2)
    ]
    state_store.delete("tests", "ckpt-drop")


async def test_rank_records_go_in_chunks_in_later_turns_and_come_back(ray_session):
    """A rank record that changed is converted in chunks of ``RANK_CHUNK`` records, one per turn
    of the event loop, after the call that saved; a registration writes its records at once
    (they must match the trainers on a load)."""
    saver = state_store.StateSaver("tests", "ckpt-chunks")
    run = new_run(ProfilerConfig(max_windows=4), set())
    st = run.state
    n = 2 * RANK_CHUNK + 5
    keys = st.register(TrainerRecord("t", "policy", list(range(n)), {}, None), None, bool)
    saver.save_runs(run, [], EXTRA)  # a registration: the records now
    assert not saver._ranks_due and saver.rank_chunks[run.name] == 3
    st.rank_failed(keys[-1], "lost", {"where": "ray", "type": "Died", "message": "gone"})
    saver.save_runs(run, [], EXTRA)  # a changed record: in later turns
    assert run.name in saver._ranks_due
    turns = 0
    while (saver._ranks_due or not saver._ranks_task.done()) and turns < 100:
        await asyncio.sleep(0)
        turns += 1
    assert 3 <= turns < 100
    saver.flush()
    (back,), _ = loaded("ckpt-chunks")
    assert len(back.state.ranks) == n and back.state.ranks[keys[-1]].state == "lost"
    assert back.state.ranks[keys[-1]].reason == {"where": "ray", "type": "Died", "message": "gone"}
    # Fewer ranks (a trainer registered again, smaller): the chunks beyond are deleted.
    st.register(TrainerRecord("t", "policy", list(range(10)), {}, None), None, bool)
    saver.save_runs(run, [], EXTRA)
    saver.flush()
    assert stored(saver, "/ranks/") == [f"runs/{run.name}/ranks/000000.msgpack"]
    (back,), _ = loaded("ckpt-chunks")
    assert sorted(back.state.ranks) == [("t", r) for r in range(10)]
    state_store.delete("tests", "ckpt-chunks")
    assert stored(saver) == []


async def test_an_open_window_is_saved_as_it_was_at_the_save(ray_session):
    """A window is copied in the save's turn and encoded on the writer's thread: what a later
    call changes meanwhile is not in it."""
    saver = state_store.StateSaver("tests", "ckpt-open")
    run = new_run(ProfilerConfig(max_windows=4), set())
    st = run.state
    n = 3000
    keys = st.register(TrainerRecord("t", "policy", list(range(n)), {}, None), None, lambda r: True)
    rec = st.open_window(Window(0, 1, 2, 3), keys)
    kernels = [KernelRow("aten::mm", 5.0, 1, 0)]
    for key in keys[:-1]:
        st.ingest_summary(
            key, encode_summary(RankSummary(key[1], 0, (2, 3), False, "cpu", kernels))
        )
    saver.writes._busy = True  # (the writer's thread holds off: the save only queues)
    saver.save_runs(run, [], EXTRA)
    last = keys[-1]  # a summary folded in after the save: not in what it stores
    st.ingest_summary(last, encode_summary(RankSummary(last[1], 0, (2, 3), False, "cpu", kernels)))
    saver.writes._busy = False
    saver.flush()
    (back,), _ = loaded("ckpt-open")
    got = back.state.windows[0]
    assert got.participants == rec.participants and len(got.participants) == n
    agg = got.aggregates["t"]
    assert len(agg.rank_totals) == n - 1 and last[1] not in agg.rank_totals
    assert agg.top(1)[0]["total_us"] == 5.0 * (n - 1)
    state_store.delete("tests", "ckpt-open")


def test_trainers_come_back_with_handles_that_still_call_their_actors(ray_session):
    @ray.remote(num_cpus=0)
    class Echo:
        def ping(self, x):
            return x

    actor = Echo.remote()
    saver = state_store.StateSaver("tests", "ckpt-handles")
    run = new_run(ProfilerConfig(max_windows=4), set())
    run.state.register(TrainerRecord("t", "policy", [0], {0: actor}, "/x"), None, bool)
    run.plan.start(5)
    saver.save_runs(run, [], EXTRA)
    saver.flush()
    try:
        (back,), _ = loaded("ckpt-handles")
        handle = back.state.trainers["t"].handles[0]
        assert ray.get(handle.ping.remote(7)) == 7
        assert back.plan.last_step == 4 and back.plan.started
        assert back.plan.next_window() == run.plan.next_window()
    finally:
        ray.kill(actor)
        state_store.delete("tests", "ckpt-handles")


def test_nothing_in_the_coordinator_pickles_its_state():
    """One codec for every file it keeps: no pickle, no reflection over private attributes
    (renaming one changes nothing on disk)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "coordinator"
    for path in root.rglob("*.py"):
        text = path.read_text()
        for banned in ("import pickle", "cloudpickle", "from_attributes", "__dict__.update("):
            if banned == "__dict__.update(" and path.name == "aggregate.py":
                continue  # (a snapshot's shallow copy; not a decode)
            assert banned not in text, f"{path.relative_to(root)}: {banned}"
