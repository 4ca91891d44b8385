"""The run's record on a bad disk and from a hostile file (issue 46, items 6, 7, 8, 11, 12):
one failing file never holds the others back, a file the queue refused is never taken as
written, a config this version refuses is said, not replaced by the defaults in silence, a run
file's counts are checked against what is there, and what the recorder keeps is bounded."""

from __future__ import annotations

import asyncio
import os
import time
import types

import pytest

from coordinator.core import record_codec as codec
from coordinator.core.config import ProfilerConfig
from coordinator.core.records import WindowRecord
from coordinator.core.run import new_run
from coordinator.core.schedule import Window
from coordinator.service import record_reader, record_writes
from coordinator.service.phase_store import PhaseStore
from coordinator.service.record_store import RecordStore
from coordinator.service.record_writes import RecordWrites
from coordinator.service.run_recorder import RunRecorder


def failing_put(monkeypatch, failing: str) -> list[str]:
    """``RecordStore.put`` fails for every file whose name starts with ``failing``; returns
    the names of every try."""
    real, tried = RecordStore.put, []

    def put(self, rel, blob):
        tried.append(rel)
        if rel.startswith(failing):
            raise OSError(f"{rel}: the disk refuses it")
        real(self, rel, blob)

    monkeypatch.setattr(RecordStore, "put", put)
    return tried


def test_one_file_that_always_fails_does_not_hold_back_the_others(tmp_path, monkeypatch):
    tried = failing_put(monkeypatch, "windows/000001")
    store, writes = RecordStore(str(tmp_path)), RecordWrites()
    writes.queue(store, "windows/000001.msgpack", lambda: b"bad")  # (first in the queue)
    for n in range(2, 6):
        writes.queue(store, f"windows/{n:06d}.msgpack", lambda: b"good")
    assert not writes.flush(2.5)  # the bad one is still queued
    assert sorted(os.listdir(tmp_path / "windows")) == [f"{n:06d}.msgpack" for n in range(2, 6)]
    stats = writes.stats()
    assert stats["pending"] == 1 and stats["files"] == 4
    assert "000001.msgpack" in stats["error"] and "refuses" in stats["error"]
    # On its back-off (1 s, then 2 s): a few tries in 2.5 s, even through a flush.
    assert 1 <= tried.count("windows/000001.msgpack") <= 3, tried
    assert stats["retry_in_s"] is not None


def test_the_error_clears_once_the_failing_file_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(record_writes, "RETRY_MAX_S", 0.05)
    broken = [True]
    real = RecordStore.put

    def put(self, rel, blob):
        if broken[0]:
            raise OSError("down")
        real(self, rel, blob)

    monkeypatch.setattr(RecordStore, "put", put)
    writes, store = RecordWrites(), RecordStore(str(tmp_path))
    writes.queue(store, "run.msgpack", lambda: b"x")
    assert not writes.flush(0.3) and writes.stats()["error"]
    broken[0] = False
    assert writes.flush(5.0)
    assert writes.stats()["error"] is None and writes.stats()["retry_in_s"] is None


def test_a_full_queue_refuses_a_file_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(record_writes, "MAX_PENDING_FILES", 1)
    failing_put(monkeypatch, "")  # (nothing is written: the queue stays full)
    writes, store = RecordWrites(), RecordStore(str(tmp_path))
    assert writes.queue(store, "a.msgpack", lambda: b"a")
    assert not writes.queue(store, "b.msgpack", lambda: b"b")
    assert writes.queue(store, "a.msgpack", lambda: b"a2")  # (a queued file is replaced)
    assert writes.stats()["dropped"] == 1


# ------------------------------------------------------------------ the recorder


def settled_window(index: int) -> WindowRecord:
    w = Window(index, 10 * index, 10 * index + 1, 10 * index + 2)
    return WindowRecord(window=w, steps=(w.first, w.last), closed=True)


def recorder_of(tmp_path, windows: int = 1) -> tuple[RunRecorder, types.SimpleNamespace]:
    """A ``RunRecorder`` over a stand-in for the coordinator's shell: one run, stopped, with
    ``windows`` settled windows."""
    cfg = ProfilerConfig.from_dict({"enable": True, "save_path": str(tmp_path)})
    run = new_run(cfg, set())
    for i in range(windows):
        run.state.windows[i] = settled_window(i)
    run.lifecycle = "stopped"
    shell = types.SimpleNamespace(
        run=run, previous=[], restored={}, stalls=[], phases=PhaseStore(lambda *a: "", print)
    )

    async def mark(_run):
        return None

    return RunRecorder(shell, mark), shell  # type: ignore[arg-type]


def read_head(tmp_path, run: str) -> codec.RunFile:
    head = codec.decode((tmp_path / run / "record" / "run.msgpack").read_bytes())
    assert isinstance(head, codec.RunFile)
    return head


def test_a_window_file_the_queue_refused_is_not_named_and_is_queued_again(tmp_path, monkeypatch):
    async def go():
        recorder, shell = recorder_of(tmp_path)
        recorder.start()
        monkeypatch.setattr(record_writes, "MAX_PENDING_FILES", 0)  # no room at all
        await recorder.look()
        assert recorder.writes.stats()["dropped"] >= 2  # the window's file and the run's
        monkeypatch.setattr(record_writes, "MAX_PENDING_FILES", 4096)
        assert await recorder.flush(10.0)
        await asyncio.sleep(0.05)  # (the look woken by the window's write)
        assert await recorder.flush(10.0)
        return shell.run.name

    run = asyncio.run(go())
    assert read_head(tmp_path, run).windows == [0]
    got = record_reader.open_record(str(tmp_path / run / "record"))
    assert list(got.run.state.windows) == [0] and got.problems == []


def test_the_run_file_never_names_a_window_whose_file_was_not_written(tmp_path, monkeypatch):
    failing_put(monkeypatch, "windows/")

    async def go():
        recorder, shell = recorder_of(tmp_path, windows=2)
        recorder.start()
        assert not await recorder.flush(1.5)  # the windows fail; the run's file is written
        assert recorder.entry()["windows"] == 0
        return shell.run.name

    run = asyncio.run(go())
    head = read_head(tmp_path, run)
    assert head.windows == []  # (before: [0, 1], two files that do not exist)
    got = record_reader.open_record(str(tmp_path / run / "record"))
    assert got.problems == []


def test_the_recorder_keeps_marks_and_stalls_only_of_what_the_coordinator_keeps(tmp_path):
    async def go():
        recorder, shell = recorder_of(tmp_path, windows=3)
        shell.run.lifecycle = "running"
        stall = {"index": 0, "detected_at": time.time() + 1, "groups": []}
        shell.stalls.append(stall)
        recorder.start()
        await recorder.look()
        rr = recorder._runs[shell.run.name]
        assert set(rr.marks) == {0, 1, 2} and rr.stalls[0]
        del shell.run.state.windows[0]  # (the history's bound dropped it)
        shell.stalls.clear()
        await recorder.look()
        assert set(rr.marks) == {1, 2}
        assert rr.stalls == {0: b""}  # still named in the run's file, its bytes not kept
        assert await recorder.flush(10.0)
        return shell.run.name

    run = asyncio.run(go())
    assert read_head(tmp_path, run).stalls == [0]


# ------------------------------------------------------------------ reading a record


def write_record(tmp_path, **changes) -> str:
    """A record of a stopped run with one window, its run file changed by ``changes``."""
    cfg = ProfilerConfig.from_dict(
        {"enable": True, "straggler_threshold": 3.0, "save_path": str(tmp_path)}
    )
    run = new_run(cfg, set())
    rec = settled_window(0)
    store = RecordStore(str(tmp_path / "rec"))
    store.put("windows/000000.msgpack", codec.encode(codec.window_file(run.name, rec)))
    head = codec.run_file(run, [0], 0, 0, [], time.time())
    for name, value in changes.items():
        setattr(head, name, value)
    store.put("run.msgpack", codec.encode(head))
    return store.url


def test_a_recorded_config_this_version_refuses_is_said_and_the_rest_kept(tmp_path):
    cfg = ProfilerConfig.from_dict(
        {"enable": True, "straggler_threshold": 3.0, "save_path": str(tmp_path)}
    ).public_dict()
    url = write_record(tmp_path, config={**cfg, "a_field_from_later": 1, "wait": None})
    got = record_reader.open_record(url)
    assert got.run.config.straggler_threshold == 3.0  # (before: the default, 1.25)
    assert got.run.config.enable is True
    (problem,) = got.problems
    assert "a_field_from_later" in problem and "wait" in problem


def counted_reads(monkeypatch) -> list[str]:
    """The name of every file ``RecordStore.get`` reads from now on."""
    reads, real = [], RecordStore.get

    def get(self, rel, limit):
        reads.append(rel)
        return real(self, rel, limit)

    monkeypatch.setattr(RecordStore, "get", get)
    return reads


def test_a_run_file_s_counts_are_checked_against_the_files_not_trusted(tmp_path, monkeypatch):
    huge = 250_000
    url = write_record(
        tmp_path, windows=list(range(huge)), phase_chunks=huge, stalls=list(range(huge))
    )
    reads = counted_reads(monkeypatch)
    got = record_reader.open_record(url)
    assert reads == ["run.msgpack", "windows/000000.msgpack"]  # (before: 750,001 look-ups)
    assert list(got.run.state.windows) == [0]
    assert len(got.problems) == 3  # one per directory
    assert all(f"and {huge - 5:d} more, not there" in p for p in got.problems[1:])
    assert f"and {huge - 6:d} more, not there" in got.problems[0]  # (window 0 is there)


def test_problems_past_the_limit_are_counted_in_one_line():
    many = [f"p{i}" for i in range(100)]
    out = record_reader._bounded(many)
    assert len(out) == record_reader.MAX_PROBLEMS + 1 and out[-1].endswith("80 more problems")


@pytest.mark.parametrize("name", ["000001.msgpack", "1.msgpack", ".000001.msgpack.tmp", "x"])
def test_a_listing_s_odd_names_are_passed_over(tmp_path, name):
    store = RecordStore(str(tmp_path))
    store.put(f"windows/{name}", b"x")
    problems: list[str] = []
    found = record_reader._present(store, "windows", [1], problems)
    assert found == ([1] if name in ("000001.msgpack", "1.msgpack") else [])


def test_marks_are_read_for_the_windows_read_and_no_others(tmp_path, monkeypatch):
    url = write_record(tmp_path)
    store = RecordStore(url)
    for index in (0, 7):  # (window 7 was never recorded)
        marks = codec.MarksFile(codec.VERSION, "r", index, {}, counted_slower=True)
        store.put(f"marks/{index:06d}.msgpack", codec.encode(marks))
    reads = counted_reads(monkeypatch)
    got = record_reader.open_record(url)
    assert got.run.state.windows[0].counted_slower is True and got.problems == []
    assert "marks/000000.msgpack" in reads and "marks/000007.msgpack" not in reads
