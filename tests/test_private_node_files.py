"""The node-local files of one user (issue 53, item 2), in one process: every folder in the
user's own private directory (uid in its name, each component made 0700 and checked), each
file opened never through a link and only when it is the user's own, each pipe checked to be
one, and a refusal that says why instead of losing a note in silence. The two-user runs are in
``test_two_users_node_files.py``."""

from __future__ import annotations

import errno
import faulthandler
import json
import os
import stat
import tempfile
import threading
import time
from pathlib import Path

import pytest

from coordinator.core.config import ProfilerConfig
from coordinator.core.memory_config import MemorySnapshot
from coordinator.protocol import node_dir, plan_board
from coordinator.protocol.node_files import append_line, make_pipe, open_own, write_pipe
from worker_ext.agent import memory_sampler, stack_reader
from worker_ext.agent.memory_sampler import MemorySampler, ask_for_snapshot, note_snapshot
from worker_ext.rank import torch_session

OTHER_UID = 65534  # (nobody: a directory root gives away)


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    """The user's node directory, moved under this test's tmp (made by the code under test)."""
    where = tmp_path / "node"
    monkeypatch.setenv(node_dir.NODE_DIR_ENV, str(where))
    for env in ("RAY_PROFILER_PLANS_DIR", "RAY_PROFILER_STACKS_DIR", "RAY_PROFILER_STAGING"):
        monkeypatch.delenv(env, raising=False)
    return where


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _staging(tmp: str = "s3://bucket/runs/run_1") -> Path:
    cfg = ProfilerConfig(enable=True, save_path="s3://bucket/runs")
    return Path(torch_session.staging_dir(cfg, tmp)).parent


FOLDERS = {  # each node-local folder: how the code finds it, its part, its own variable
    "plans": (plan_board.plans_dir, "RAY_PROFILER_PLANS_DIR"),
    "stacks": (stack_reader.stacks_dir, "RAY_PROFILER_STACKS_DIR"),
    "memory": (memory_sampler.memory_dir, node_dir.NODE_DIR_ENV),
    "staging": (_staging, "RAY_PROFILER_STAGING"),
}


def test_the_default_directory_has_the_uid_in_its_own_name(monkeypatch, tmp_path):
    monkeypatch.delenv(node_dir.NODE_DIR_ENV, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert node_dir.user_root() == tmp_path / f"ray-profiler-{os.getuid()}"


@pytest.mark.parametrize("part", sorted(FOLDERS))
def test_every_folder_is_in_the_user_s_private_directory_made_0700(root, part):
    find, _ = FOLDERS[part]
    assert find() == root / part
    assert [_mode(p) for p in (root, root / part)] == [0o700, 0o700]
    assert os.lstat(root / part).st_uid == os.getuid()


@pytest.mark.parametrize("part", sorted(FOLDERS))
def test_a_folder_open_to_others_is_refused_with_what_to_do(root, part):
    find, env = FOLDERS[part]
    root.mkdir(mode=0o700)
    (root / part).mkdir(mode=0o700)
    (root / part).chmod(0o777)
    with pytest.raises(PermissionError, match=f"has mode 0777, open to others.*set {env}"):
        find()


@pytest.mark.parametrize("part", sorted(FOLDERS))
def test_a_folder_that_is_a_link_is_refused(root, part, tmp_path):
    find, _ = FOLDERS[part]
    root.mkdir(mode=0o700)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (root / part).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PermissionError, match="is a link or not a directory"):
        find()


@pytest.mark.parametrize("part", sorted(FOLDERS))
def test_a_folder_of_another_user_is_refused(root, part):
    if os.getuid() != 0:
        pytest.skip("only root can give a directory to another user here")
    find, _ = FOLDERS[part]
    root.mkdir(mode=0o700)
    (root / part).mkdir(mode=0o700)
    os.chown(root / part, OTHER_UID, -1)
    with pytest.raises(PermissionError, match=f"belongs to uid {OTHER_UID}"):
        find()


def test_a_root_made_first_by_another_user_is_refused(root):
    if os.getuid() != 0:
        pytest.skip("only root can give a directory to another user here")
    root.mkdir(mode=0o700)
    os.chown(root, OTHER_UID, -1)
    with pytest.raises(PermissionError, match=f"the memory folder {root} belongs to uid"):
        memory_sampler.memory_dir()


@pytest.mark.parametrize("part", ["plans", "stacks", "staging"])
def test_a_folder_a_variable_names_has_each_component_it_made_private(
    root, part, tmp_path, monkeypatch
):
    find, env = FOLDERS[part]
    chosen = tmp_path / "mine" / "deep" / part
    monkeypatch.setenv(env, str(chosen))
    assert find() == chosen
    assert [_mode(p) for p in (chosen.parent.parent, chosen.parent, chosen)] == [0o700] * 3


# ---------------------------------------------------------------- opening files and pipes


def test_a_note_is_never_appended_through_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    victim.chmod(0o600)
    (tmp_path / "note").symlink_to(victim)
    with pytest.raises(OSError) as got:
        append_line(tmp_path / "note", "forged")
    assert got.value.errno == errno.ELOOP and victim.read_text() == "precious"


def test_a_note_is_made_0600_and_appended(tmp_path):
    append_line(tmp_path / "note", "a")
    append_line(tmp_path / "note", "b")
    assert (tmp_path / "note").read_text() == "a\nb\n" and _mode(tmp_path / "note") == 0o600


def test_a_file_of_another_user_is_refused(tmp_path):
    if os.getuid() != 0:
        pytest.skip("only root can give a file to another user here")
    (tmp_path / "note").write_text('{"on": "oom"}\n')
    os.chown(tmp_path / "note", OTHER_UID, -1)
    with pytest.raises(PermissionError, match="is not a file of this user's"):
        open_own(tmp_path / "note", os.O_RDONLY)
    with pytest.raises(PermissionError):
        append_line(tmp_path / "note", "x")
    assert (tmp_path / "note").read_text() == '{"on": "oom"}\n'


def test_a_pipe_planted_at_a_file_s_name_is_refused_without_hanging(tmp_path):
    os.mkfifo(tmp_path / "note")
    with pytest.raises(PermissionError, match="is not a file"):
        open_own(tmp_path / "note", os.O_RDONLY)


def test_a_plain_file_at_a_pipe_s_name_is_never_written(tmp_path):
    (tmp_path / "x.mem").write_text("precious")
    with pytest.raises(PermissionError, match="is not a named pipe of this user's"):
        write_pipe(tmp_path / "x.mem", b"/a.memory.pickle\n")
    assert (tmp_path / "x.mem").read_text() == "precious"


def test_a_link_to_a_pipe_is_never_followed(tmp_path):
    fd = make_pipe(tmp_path / "real.mem")
    try:
        (tmp_path / "x.mem").symlink_to(tmp_path / "real.mem")
        with pytest.raises(OSError) as got:
            write_pipe(tmp_path / "x.mem", b"x\n")
        assert got.value.errno == errno.ELOOP
    finally:
        os.close(fd)


def test_a_pipe_with_no_reader_is_said_and_one_with_a_reader_is_written(tmp_path):
    os.mkfifo(tmp_path / "gone.mem", 0o600)
    with pytest.raises(OSError) as got:
        write_pipe(tmp_path / "gone.mem", b"x\n")
    assert got.value.errno == errno.ENXIO
    (tmp_path / "x.mem").write_text("planted")  # (make_pipe replaces what was there)
    fd = make_pipe(tmp_path / "x.mem")
    try:
        assert _mode(tmp_path / "x.mem") == 0o600
        write_pipe(tmp_path / "x.mem", b"/a.memory.pickle\n")
        assert os.read(fd, 100) == b"/a.memory.pickle\n"
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the memory folder's users


def test_a_refused_memory_folder_is_said_by_the_rank_and_the_agent(root, tmp_path):
    memory = root / "memory"
    root.mkdir(mode=0o700)
    memory.mkdir(mode=0o700)
    memory.chmod(0o777)
    why = note_snapshot("oom", "/x.memory.pickle", None)
    assert why is not None and "the memory folder" in why and "open to others" in why
    assert list(memory.iterdir()) == []  # nothing written there
    asked = ask_for_snapshot(os.getpid(), "/x.memory.pickle")
    assert asked is not None and asked.startswith("the memory folder cannot be had")
    assert "not a CUDA rank" not in asked


def test_a_cuda_rank_whose_memory_folder_is_refused_says_why(root, monkeypatch):
    from worker_ext.rank import memory_snapshot

    monkeypatch.setattr(memory_snapshot, "_cuda_memory", lambda: _NoHistory())
    monkeypatch.setattr(memory_snapshot, "_state", {})
    root.mkdir(mode=0o700)
    (root / "memory").mkdir(mode=0o700)
    (root / "memory").chmod(0o775)
    cfg = MemorySnapshot(on=["window", "demand"]).validate()
    snaps = memory_snapshot.MemorySnapshots(cfg, "cuda", 0, None)
    assert snaps.problem is not None and "has mode 0775" in snaps.problem
    assert "pipe" not in memory_snapshot._state


class _NoHistory:
    """torch.cuda.memory's history switch (this machine has no GPU): the only stand-in."""

    def _record_memory_history(self, enabled: object = "all", **kw: object) -> None:
        return None


def test_the_agent_never_reads_a_note_that_is_a_link(root, tmp_path):
    forged = tmp_path / "forged.jsonl"
    forged.write_text(json.dumps({"on": "oom", "path": "/forged", "error": None, "at": 1.0}) + "\n")
    folder = memory_sampler.memory_dir()
    (folder / f"{os.getpid()}.snapshots.jsonl").symlink_to(forged)
    sampler = MemorySampler("node-a")
    try:
        got = sampler.watch({"targets": [{"pid": os.getpid()}], "sample_s": 1.0})
        assert got["snapshots"] == []
    finally:
        sampler.close()


def test_the_agent_never_reads_a_note_of_another_user(root):
    if os.getuid() != 0:
        pytest.skip("only root can give a file to another user here")
    note = memory_sampler.memory_dir() / f"{os.getpid()}.snapshots.jsonl"
    note.write_text(json.dumps({"on": "oom", "path": "/forged", "error": None, "at": 1.0}) + "\n")
    os.chown(note, OTHER_UID, -1)
    sampler = MemorySampler("node-a")
    try:
        assert (
            sampler.watch({"targets": [{"pid": os.getpid()}], "sample_s": 1.0})["snapshots"] == []
        )
        os.chown(note, os.getuid(), -1)  # (the same note, the user's own: read)
        (got,) = sampler.watch({"targets": [{"pid": os.getpid()}], "sample_s": 1.0})["snapshots"]
        assert got["path"] == "/forged"
    finally:
        sampler.close()


# ---------------------------------------------------------------- stacks


@pytest.fixture
def stack_dump(monkeypatch):
    """``worker_ext.rank.stack_dump`` with a state of the test's own; afterwards the test's
    registration is gone and this process's own (a driver of an earlier test registered
    faulthandler on SIGUSR2 for life) is as it was: a later test's agent signals this process
    for its stacks, and SIGUSR2 with no handler would kill the whole test run."""
    from worker_ext.rank import stack_dump

    real = stack_dump._state
    monkeypatch.setattr(stack_dump, "_state", {})
    yield stack_dump
    stack_dump._remove_files()
    if real.get("file") is not None:
        faulthandler.register(stack_dump.STACK_SIGNAL, file=real["file"], all_threads=True)


def test_a_faulthandler_dump_is_never_opened_through_a_link(root, tmp_path, stack_dump):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (stack_reader.stacks_dir() / f"{os.getpid()}.txt").symlink_to(victim)
    dump = stack_dump._enable(cuda=False)
    assert dump["path"] is None and "faulthandler not registered" in str(dump["note"])
    assert victim.read_text() == "precious"


def test_a_faulthandler_dump_is_made_0600_in_the_private_stacks_folder(root, stack_dump):
    dump = stack_dump._enable(cuda=False)
    stack_dump._state["dump"] = dump  # (removed with its file when the test ends)
    assert dump["path"] == str(root / "stacks" / f"{os.getpid()}.txt")
    assert _mode(Path(dump["path"])) == 0o600


def test_a_faulthandler_dump_that_is_a_link_is_never_read(root, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text('Thread 0x1 (most recent call first):\n  File "x", line 1 in f\n')
    path = stack_reader.stacks_dir() / f"{os.getpid()}.txt"
    path.symlink_to(secret)
    dump = {"signal": 12, "path": str(path), "main_thread": None, "note": None,
            "flight_recorder": None, "flight_recorder_note": None}  # fmt: skip
    with pytest.raises(OSError) as got:
        stack_reader.read_with_faulthandler(os.getpid(), dump, 1.0)  # type: ignore[arg-type]
    assert got.value.errno == errno.ELOOP


def test_a_flight_recorder_pipe_that_is_a_plain_file_is_never_written(root, tmp_path):
    fr = stack_reader.stacks_dir() / f"{os.getpid()}.fr"
    fr.write_text("precious")
    dump = {"flight_recorder": str(fr)}
    got = stack_reader.request_flight_recorder(os.getpid(), dump, str(tmp_path), 1.0)  # type: ignore[arg-type]
    assert got["path"] is None and "is not a named pipe" in str(got["reason"])
    assert fr.read_text() == "precious"


# ---------------------------------------------------------------- the sampler's thread


def test_close_stops_the_sampler_thread_at_once_even_between_slow_samples(root):
    sampler = MemorySampler("node-a")
    sampler.watch({"targets": [{"pid": os.getpid()}], "sample_s": 3600.0})
    thread = sampler._thread
    assert thread is not None and thread.is_alive()
    deadline = time.monotonic() + 30
    while sampler._sampled == 0 and time.monotonic() < deadline:  # (asleep after its sample)
        time.sleep(0.01)
    t0 = time.monotonic()
    sampler.close(timeout_s=5.0)
    assert not thread.is_alive() and time.monotonic() - t0 < 5.0


def test_close_says_when_the_thread_does_not_stop(root, monkeypatch):
    sampler = MemorySampler("node-a")
    inside, stuck = threading.Event(), threading.Event()

    def hangs() -> None:  # a sample that hangs (an injected fault)
        inside.set()
        stuck.wait(30)

    monkeypatch.setattr(sampler, "sample_once", hangs)
    sampler.watch({"targets": [{"pid": os.getpid()}], "sample_s": 0.1})
    try:
        assert inside.wait(30)
        with pytest.raises(RuntimeError, match="did not stop in 0.2 s"):
            sampler.close(timeout_s=0.2)
    finally:
        stuck.set()
        sampler.close()


# ---------------------------------------------------------------- NVML in a container


def test_nvml_pids_of_another_pid_namespace_are_said():
    why = memory_sampler.foreign_pids({912345, 912346}, {41, 42}, here=set())
    assert why is not None and "pid namespace" in why and "--pid=host" in why


@pytest.mark.parametrize(
    ("nvml", "watched", "here"),
    [(set(), {41}, set()), ({41, 7}, {41}, set()), ({7}, {41}, {7}), ({7}, set(), set())],
)
def test_nvml_pids_that_are_this_namespace_s_are_no_problem(nvml, watched, here):
    assert memory_sampler.foreign_pids(nvml, watched, here) is None


# ---------------------------------------------------------------- the staging directory


def test_a_rank_whose_staging_directory_is_refused_is_disabled_and_says_why(
    root, tmp_path, monkeypatch
):
    from worker_ext.rank.rank_profiler import RankProfiler

    staging = tmp_path / "staging"
    staging.mkdir()
    staging.chmod(0o777)
    monkeypatch.setenv("RAY_PROFILER_STAGING", str(staging))
    cfg = ProfilerConfig(enable=True, save_path="s3://bucket/runs").validate()
    rp = RankProfiler(0, cfg, "s3://bucket/runs/run_1", warm_up=False)
    reply = rp.status()
    assert reply["state"] == "disabled" and reply["reason"] is not None
    assert "the staging directory" in reply["reason"]["message"]
    assert "open to others" in reply["reason"]["message"]
    assert list(staging.iterdir()) == []


def test_the_sampler_says_when_nvml_names_only_pids_of_another_namespace(root, monkeypatch):
    """NVML's answer in a container without the host's pid namespace (the fault, injected):
    GPU processes under host pids that are no process here."""
    sampler = MemorySampler("node-a")
    gpu = memory_sampler.GpuMemory()
    gpu.problem, gpu._devices = None, [object()]  # (a device, as a GPU node has)

    def by_pid() -> dict[int, int]:
        gpu.pids = {2**22 + 17, 2**22 + 18}  # above this machine's pid_max: none here
        return {2**22 + 17: 1 << 30, 2**22 + 18: 1 << 30}

    monkeypatch.setattr(gpu, "by_pid", by_pid)
    sampler._gpu = gpu
    watch = {"targets": [{"pid": os.getpid()}], "sample_s": 3600.0}
    sampler.watch(watch)
    try:
        sampler.sample_once()
        why = sampler.watch(watch)["gpu"]
        assert why is not None and "pid namespace" in why
    finally:
        sampler.close()


@pytest.mark.subprocess  # (the rank's node agent is a spawned child here)
def test_a_rank_says_in_its_note_why_its_memory_folder_is_refused(root, tmp_path, monkeypatch):
    from worker_ext.rank import memory_snapshot
    from worker_ext.rank.rank_profiler import RankProfiler

    def as_cuda(cls, rp):  # what a CUDA rank's would be (this machine has no GPU)
        return memory_snapshot.MemorySnapshots(
            rp.config.memory_snapshot, "cuda", rp.rank, rp.run_directory, rp.role
        )

    monkeypatch.setattr(memory_snapshot, "_cuda_memory", lambda: _NoHistory())
    monkeypatch.setattr(memory_snapshot, "_state", {})
    monkeypatch.setattr(memory_snapshot.MemorySnapshots, "of", classmethod(as_cuda))
    root.mkdir(mode=0o700)
    (root / "memory").mkdir(mode=0o700)
    (root / "memory").chmod(0o777)
    cfg = ProfilerConfig(
        enable=True, save_path=str(tmp_path), memory_snapshot={"on": ["window"]}
    ).validate()
    rp = RankProfiler(0, cfg, str(tmp_path / "run"), warm_up=False)
    note = rp.status()["note"]
    assert note is not None and "the memory folder" in note and "open to others" in note
