"""The coordinator's state in Ray's real key-value store, through the record's one codec, one
writer and one reader: a settled window is written once, an open one at each save (copied in
the save's turn, encoded off the event loop), rank records in chunks, actor handles as Ray
serializes them, and a load puts everything back. No pickle."""

import asyncio
import time

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


@ray.remote(num_cpus=0)
class Echo:
    def ping(self, x):
        return x


@ray.remote(num_cpus=0)
class AsyncEcho:
    async def ping(self, x):
        return x


def saved_with(name: str, handles: dict):
    """A run whose trainer ``t`` has ``handles``, saved as coordinator ``name``."""
    saver = state_store.StateSaver("tests", name)
    run = new_run(ProfilerConfig(max_windows=4), set())
    run.state.register(TrainerRecord("t", "policy", sorted(handles), handles, "/x"), None, bool)
    run.plan.start(5)
    saver.save_runs(run, [], EXTRA)
    assert saver.flush()
    return saver, run


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
    actor = Echo.remote()
    _, run = saved_with("ckpt-handles", {0: actor})
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


def _state_of(saver, run):
    from coordinator.core import record_codec as codec

    blob = state_store.run_store(saver.namespace, saver.name, run.name).get("state.msgpack", 1e9)
    return codec.decode(blob) if blob else None


def _refusing(saver, monkeypatch, refused: set[str]):
    """The state's writer with a full queue for the files named in ``refused`` (a fault
    injected: the real queue refuses only when 4,096 files wait)."""
    real = saver.writes.queue

    def queue(store, rel, blob, on_written=None):
        return False if rel in refused else real(store, rel, blob, on_written)

    monkeypatch.setattr(saver.writes, "queue", queue)


def test_a_full_queue_never_marks_unsaved_work_saved_and_it_is_written_later(
    ray_session, monkeypatch
):
    saver = state_store.StateSaver("tests", "ckpt-full")
    run = run_with_windows(settled=1)  # window 0 settled, window 1 open
    refused = {"windows/000000.msgpack", "trainers.msgpack"}
    _refusing(saver, monkeypatch, refused)
    saver.save_runs(run, [], EXTRA)
    assert saver.flush()
    assert stored(saver, "/windows/") == [f"runs/{run.name}/windows/000001.msgpack"]
    assert stored(saver, "trainers") == []
    assert _state_of(saver, run).windows == [1]  # (what is not stored is not named)
    assert (run.name, 0) not in saver.saved_windows
    assert "over their bound" in saver.entry()["error"]
    refused.clear()  # room again: the next save, with nothing new, writes what was refused
    saver.save_runs(run, [], EXTRA)
    assert saver.flush()
    assert stored(saver, "/windows/") == [
        f"runs/{run.name}/windows/{i:06d}.msgpack" for i in (0, 1)
    ]
    assert _state_of(saver, run).windows == [0, 1] and saver.entry()["error"] is None
    (back,), _ = loaded("ckpt-full")
    assert list(back.state.windows) == [0, 1] and sorted(back.state.trainers) == ["t"]
    assert back.state.windows[0].settled
    state_store.delete("tests", "ckpt-full")


def test_a_window_whose_write_fails_is_named_by_the_state_only_once_it_is_written(
    ray_session, monkeypatch
):
    """The writer retries a failed file while it writes those behind it: the state written
    meanwhile does not name the window, and is written again, naming it, once it lands."""
    from coordinator.core import record_codec as codec
    from coordinator.service.kv_store import KVStore

    saver = state_store.StateSaver("tests", "ckpt-late")
    run = run_with_windows(settled=1)
    real, fails, states = KVStore.put, [1], []

    def put(self, rel, blob):
        if rel == "windows/000000.msgpack" and fails[0]:
            fails[0] -= 1
            raise OSError("injected: the GCS did not answer")
        if rel == "state.msgpack":
            states.append(codec.decode(blob).windows)
        real(self, rel, blob)

    monkeypatch.setattr(KVStore, "put", put)
    saver.writes._busy = True  # (the writer's thread holds off: the save only queues)
    saver.save_runs(run, [], EXTRA)
    saver.writes._busy = False
    saver.writes.kick()  # the window fails and waits for its retry; the files behind it go
    deadline = time.monotonic() + 30
    while saver.writes.stats()["pending"] != 1 or saver.writes._busy:
        assert time.monotonic() < deadline, saver.writes.stats()
        time.sleep(0.01)
    assert fails == [0] and states == [[1]]
    assert (run.name, 0) not in saver.saved_windows
    assert saver.flush(30.0)  # the retry lands: the state is written again, naming it
    assert states[-1] == [0, 1], states
    assert (run.name, 0) in saver.saved_windows  # (settled, and now written)
    (back,), _ = loaded("ckpt-late")
    assert list(back.state.windows) == [0, 1]
    state_store.delete("tests", "ckpt-late")


def test_clearing_a_coordinator_s_state_leaves_every_other_name_s(ray_session):
    """A coordinator created anew clears its state: ``x`` never takes ``x-2``'s with it, and no
    two (namespace, name) pairs share a key (``a/b`` + ``c`` is not ``a`` + ``b/c``)."""
    pairs = [("tests", "x"), ("tests", "x-2"), ("tests/x", "y"), ("a/b", "c"), ("a", "b/c")]
    for ns, name in pairs:
        state_store.root(ns, name).put("coordinator.msgpack", f"{ns}|{name}".encode())
    try:
        for ns, name in pairs:
            got = state_store.root(ns, name).get("coordinator.msgpack", 100)
            assert got == f"{ns}|{name}".encode(), (ns, name, got)
        state_store.delete("tests", "x")
        state_store.delete("a", "b/c")
        left = [p for p in pairs if state_store.root(*p).exists("coordinator.msgpack")]
        assert left == [("tests", "x-2"), ("tests/x", "y"), ("a/b", "c")]
        assert state_store.root("a/b", "c").get("coordinator.msgpack", 100) == b"a/b|c"
    finally:
        for ns, name in pairs:
            state_store.delete(ns, name)


def test_restored_handles_are_strong_whether_their_actors_are_named_or_not(ray_session):
    """The trainers' actors are found again by id in Ray's actor table (by name for a named
    one): the handles keep calling after every other handle of this process is dropped (a weak
    one would let Ray end the actors then)."""
    import gc

    actors = {0: Echo.remote(), 1: AsyncEcho.remote(), 2: Echo.options(name="ckpt-echo").remote()}
    _, run = saved_with("ckpt-strong", dict(actors))
    ids = {r: a._actor_id.hex() for r, a in actors.items()}
    try:
        (back,), _ = loaded("ckpt-strong")
        del actors, run
        gc.collect()
        handles = back.state.trainers["t"].handles
        assert {r: h._actor_id.hex() for r, h in handles.items()} == ids
        for k in range(10):  # (over 2 s: Ray ends an actor with no strong handle in ms)
            assert ray.get([h.ping.remote(k) for h in handles.values()], timeout=30) == [k] * 3
            time.sleep(0.2)
    finally:  # (the actors end with the last handle)
        state_store.delete("tests", "ckpt-strong")


def test_a_record_in_save_path_never_applies_live_state_files(ray_session, tmp_path):
    """``state.msgpack`` and ``trainers.msgpack`` are read from Ray's key-value store only: the
    same files in a directory anyone may write (a ``save_path`` record) are not applied, and
    no actor is looked up for them."""
    from coordinator.service.record_reader import open_record
    from coordinator.service.record_store import RecordStore

    actor = Echo.remote()
    _, run = saved_with("ckpt-copied", {0: actor})
    kv = state_store.run_store("tests", "ckpt-copied", run.name)
    copy = RecordStore(str(tmp_path / "record"))
    for rel in ("run.msgpack", "state.msgpack", "trainers.msgpack", "ranks/000000.msgpack"):
        copy.put(rel, kv.get(rel, 1 << 30))
    try:
        assert open_record(kv, live=True).run.state.trainers["t"].handles  # (the KV's: applied)
        got = open_record(str(tmp_path / "record"))
        assert got.run.state.trainers["t"].handles == {} and not got.run.plan.started
        assert got.run.state.ranks == {}
    finally:
        ray.kill(actor)
        state_store.delete("tests", "ckpt-copied")


def test_an_actor_id_that_is_not_one_or_not_alive_leaves_that_rank_lost_with_why(ray_session):
    """Each stored id is checked before Ray sees it (16 bytes of hex) and looked up in Ray's
    actor table: a 3-byte id, or an actor that died, costs that rank only, said in the
    reader's problems and the rank's reason; the other ranks' handles come back."""
    import msgspec

    alive, dead = Echo.remote(), Echo.remote()
    _, run = saved_with("ckpt-ids", {0: alive, 1: dead, 2: alive})
    ray.kill(dead)
    store = state_store.run_store("tests", "ckpt-ids", run.name)
    stored = msgspec.msgpack.decode(store.get("trainers.msgpack", 1 << 30))
    stored["trainers"][0]["handles"][2] = "010203"  # (a 3-byte actor id)
    store.put("trainers.msgpack", msgspec.msgpack.encode(stored))
    try:
        deadline = time.monotonic() + 60
        while ray._private.state.state.actor_table(dead._actor_id.hex())["State"] != "DEAD":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        (rec,), _ = state_store.load_runs("tests", "ckpt-ids")
        st = rec.run.state
        assert list(st.trainers["t"].handles) == [0]
        assert ray.get(st.trainers["t"].handles[0].ping.remote(3)) == 3
        assert [st.ranks[("t", r)].state for r in range(3)] == ["ok", "lost", "lost"]
        assert "DEAD" in st.ranks[("t", 1)].reason["message"]
        assert "not an actor id" in st.ranks[("t", 2)].reason["message"]
        assert len(rec.problems) == 2 and all("trainers.msgpack" in p for p in rec.problems)
    finally:
        ray.kill(alive)
        state_store.delete("tests", "ckpt-ids")


class _Opens:
    """Unpickled, it opens ``path`` for writing: proof that code ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _planted_class(path):
    class Planted:
        __module__ = "coordinator.planted"  # (a module of ours: Ray's class loader unpickles it)
        opened = _Opens(path)

        def ping(self):
            return 1

    return Planted


@ray.remote(num_cpus=0, max_calls=1)
def _restore_in_a_fresh_process(name):
    from coordinator.raylink.handle_stubs import install_handle_stubs

    install_handle_stubs()  # (as the coordinator does)
    recs, _ = state_store.load_runs("tests", name)
    return [p for rec in recs for p in rec.problems]


def test_a_stored_handle_naming_a_module_of_ours_runs_no_code(ray_session, tmp_path):
    """The old ``trainers.msgpack`` kept Ray's own serialized handle; one naming a class under
    ``coordinator.`` made the coordinator's process load that class through Ray's class loader,
    which unpickles it from Ray's key-value store, and so ran what it held. Those bytes are now
    refused as data, in a fresh process as a restarted coordinator's: a problem, no code run."""
    import msgspec

    marker = tmp_path / "code-ran"
    planted = ray.remote(num_cpus=0)(_planted_class(str(marker))).remote()
    assert ray.get(planted.ping.remote()) == 1
    marker.unlink()  # (made when the planted actor's own process loaded its class)
    _, run = saved_with("ckpt-planted", {0: planted})
    store = state_store.run_store("tests", "ckpt-planted", run.name)
    stored = msgspec.msgpack.decode(store.get("trainers.msgpack", 1 << 30))
    old = msgspec.msgpack.encode([bytes(planted._serialization_helper()[0]), False])
    stored["trainers"][0]["handles"] = {0: old}
    store.put("trainers.msgpack", msgspec.msgpack.encode(stored))
    try:
        problems = ray.get(_restore_in_a_fresh_process.remote("ckpt-planted"), timeout=120)
        assert not marker.exists()  # (the old reader ran the planted code here)
        assert any("trainers.msgpack" in p and "Expected `str`" in p for p in problems), problems
    finally:
        ray.kill(planted)
        state_store.delete("tests", "ckpt-planted")
