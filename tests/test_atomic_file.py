"""The one "temporary file, then rename" (``coordinator.protocol.atomic_file``) and the writers
that use it: a planted link is never written through, a failed write leaves nothing behind.
(Issue 46, items 2 and 17: each writer had its own copy, with a predictable temporary name.)"""

from __future__ import annotations

import os
import stat

import pytest

from coordinator.ops.collect import _writer
from coordinator.protocol.atomic_file import DEFAULT_MODE, atomic_path, write_atomic
from coordinator.service.record_store import RECORD_MODE, RecordStore
from coordinator.service.stall_watchdog import _dump
from worker_ext.agent.trace_jobs import _atomic


def _stall_file(path: str) -> None:
    _dump(path, {"index": 0, "trainer_id": "t", "detected_at": 1.0}, None)  # type: ignore[typeddict-item]


def _trace_job(path: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write("{}")

    _atomic(path, write)


def _collected(path: str) -> None:
    with _writer(path, {}) as f:
        f.write(b"{}")


def _record(path: str) -> None:
    RecordStore(os.path.dirname(path)).put(os.path.basename(path), b"{}")


WRITERS = {"stall": _stall_file, "trace job": _trace_job, "collect": _collected, "record": _record}
MODES = {"record": RECORD_MODE}  # (the others: DEFAULT_MODE, 0600: tests/test_file_modes.py)


@pytest.mark.parametrize("writer", WRITERS)
def test_a_writer_never_follows_a_link_planted_at_a_name_it_could_use(tmp_path, writer):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    final = tmp_path / "out" / "file.json"
    final.parent.mkdir()
    for suffix in (".tmp", ".part", f".{os.getpid()}.tmp"):  # (the names the copies used)
        (final.parent / (final.name + suffix)).symlink_to(victim)
        (final.parent / f".{final.name}{suffix}").symlink_to(victim)
    final.symlink_to(victim)  # and the final name itself: replaced, not written through
    WRITERS[writer](str(final))
    assert victim.read_bytes() == b"precious"
    assert not final.is_symlink() and final.read_bytes() not in (b"", b"precious")
    assert stat.S_IMODE(final.stat().st_mode) == MODES.get(writer, DEFAULT_MODE)
    left = {p.name for p in final.parent.iterdir()} - {final.name}
    assert all(os.path.islink(final.parent / n) for n in left)  # (only the planted links)


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary_one(tmp_path):
    final = tmp_path / "board"
    write_atomic(final, b"old", mode=0o600)
    with pytest.raises(RuntimeError), atomic_path(final) as tmp:
        with open(tmp, "wb") as f:
            f.write(b"half")
        raise RuntimeError("the exporter failed")
    assert final.read_bytes() == b"old" and os.listdir(tmp_path) == ["board"]
    assert stat.S_IMODE(final.stat().st_mode) == 0o600


def test_record_files_are_this_user_s_alone_and_on_disk_before_they_are_named(
    tmp_path, monkeypatch
):
    """Issue 53 items 7 and 12: a record file is 0600 (it was 0644), and it is flushed to disk
    before the rename and its directory after it (a power loss leaves no empty window file)."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    os.umask(old := os.umask(0))  # (as permissive as a umask goes: the mode is not its)
    try:
        RecordStore(str(tmp_path / "record")).put("windows/000003.msgpack", b"w")
    finally:
        os.umask(old)
    final = tmp_path / "record" / "windows" / "000003.msgpack"
    assert stat.S_IMODE(final.stat().st_mode) == 0o600 == RECORD_MODE
    assert len(synced) == 2 and ".000003.msgpack." in synced[0]
    assert synced[1] == str(final.parent)
    # others' whole-file writes (traces, boards) are not flushed: remade, or worthless later
    synced.clear()
    write_atomic(str(tmp_path / "board"), b"b")
    assert synced == []
