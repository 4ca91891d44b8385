"""The node agent's memory sampler against real processes, and a rank's CUDA memory snapshots
with torch's CUDA memory functions replaced (this machine has no GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from coordinator.core.memory_config import MemorySnapshot
from worker_ext.agent import memory_sampler
from worker_ext.agent.memory_sampler import (
    MemorySampler,
    ask_for_snapshot,
    check_snapshot_request,
    check_watch,
    memory_dir,
)

MiB = 1 << 20
LEAKER = textwrap.dedent(
    """
    import sys, time
    keep, rate, t0 = [], int(sys.argv[1]), time.monotonic()
    print("ready", flush=True)
    while True:
        time.sleep(0.05)
        due = int(rate * (time.monotonic() - t0)) - sum(len(b) for b in keep)
        if due > 0:
            keep.append(b"x" * due)  # touched: resident, not just reserved
    """
)


@pytest.fixture(autouse=True)
def private_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_PROFILER_NODE_DIR", str(tmp_path / "node"))


def child(rate):
    p = subprocess.Popen([sys.executable, "-c", LEAKER, str(rate)], stdout=subprocess.PIPE)
    assert p.stdout.readline().strip() == b"ready"
    return p


@pytest.mark.subprocess
def test_a_leaking_process_is_sampled_out_of_process_and_its_exit_is_said():
    leak, flat = child(8 * MiB), child(0)
    sampler = MemorySampler("node-a")
    try:
        watch = {"targets": [{"pid": leak.pid}, {"pid": flat.pid}], "sample_s": 0.1}
        first = sampler.watch(watch)
        time.sleep(2.0)
        got = {p["pid"]: p for p in sampler.watch(watch)["processes"]}
        a, b = got[leak.pid]["samples"], got[flat.pid]["samples"]
        assert len(a) >= 8 and len(b) >= 8
        rate = (a[-1][1] - a[0][1]) / (a[-1][0] - a[0][0])
        assert 4 * MiB < rate < 14 * MiB  # the truth: 8 MiB a second
        assert abs(b[-1][1] - b[0][1]) < 2 * MiB
        assert all(s[2] is not None and s[2] <= s[1] for s in a)  # unique <= resident
        assert first["gpu"] is None or "NVML" in first["gpu"]
        leak.kill()
        leak.wait()
        time.sleep(0.5)
        gone = {p["pid"]: p for p in sampler.watch(watch)["processes"]}
        assert "exited" in gone[leak.pid]["gone"] and gone[flat.pid]["gone"] is None
        reply = sampler.watch({"targets": [{"pid": flat.pid}], "sample_s": 0.1})
        assert [p["pid"] for p in reply["processes"]] == [flat.pid]
        assert reply["sampled"] > 16 and reply["cpu_s"] > 0
    finally:
        for p in (leak, flat):
            p.kill()
            p.wait()


@pytest.mark.subprocess
def test_psutil_refused_by_the_os_is_said_and_resident_memory_still_sampled(monkeypatch):
    proc = child(0)
    try:

        def refused(self):
            raise psutil.AccessDenied(self.pid, "injected")

        monkeypatch.setattr(psutil.Process, "memory_full_info", refused)
        sampler = MemorySampler("node-a")
        watch = {"targets": [{"pid": proc.pid}], "sample_s": 0.1}
        sampler.watch(watch)
        time.sleep(0.6)
        (p,) = sampler.watch(watch)["processes"]
        assert p["samples"] and all(s[1] > 0 and s[2] is None for s in p["samples"])
        assert "psutil refused by the OS" in p["error"]
    finally:
        proc.kill()
        proc.wait()


def test_a_pid_that_is_not_there_is_gone_at_once():
    sampler = MemorySampler("node-a")
    dead = 2**22 + 12345  # above pid_max on this machine's default
    (p,) = sampler.watch({"targets": [{"pid": dead}], "sample_s": 1.0})["processes"]
    assert p["samples"] == [] and "NoSuchProcess" in p["gone"]


def test_each_watch_says_the_node_s_memory_as_psutil_reads_it():
    sampler = MemorySampler("node-a")
    reply = sampler.watch({"targets": [{"pid": os.getpid()}], "sample_s": 1.0})
    nm, vm = reply["node_memory"], psutil.virtual_memory()
    assert nm is not None and nm["source"] == "host" and nm["total_bytes"] == vm.total
    assert nm["available_bytes"] == pytest.approx(vm.available, abs=512 * MiB)
    assert abs(nm["at"] - time.time()) < 5


def cgroup(root, limit, usage, cache, v1=False):
    """A cgroup folder's memory files (v2, or v1's names under ``memory/``)."""
    names = (
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat")
        if v1
        else ("memory.max", "memory.current", "memory.stat")
    )
    keys = ("total_inactive_file", "total_active_file") if v1 else ("inactive_file", "active_file")
    for name, text in zip(
        names, (limit, str(usage), f"anon 1\n{keys[0]} {cache}\n{keys[1]} {cache}\n"), strict=True
    ):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return str(root)


@pytest.mark.parametrize("v1", [False, True])
def test_a_container_s_cgroup_limit_under_the_host_s_memory_is_what_is_left(tmp_path, v1):
    """4 GiB limit, 3 GiB used of which 512 MiB page cache: 1.5 GiB left, not the host's."""
    root = cgroup(tmp_path, str(4 << 30), 3 << 30, 256 * MiB, v1)
    nm = memory_sampler.node_memory(root)
    assert nm is not None and nm["source"] == "cgroup"
    assert (nm["total_bytes"], nm["available_bytes"]) == (4 << 30, (1 << 30) + 512 * MiB)
    unlimited = cgroup(tmp_path / "max", "max", 3 << 30, 0, v1)
    host = psutil.virtual_memory()
    for free in (unlimited, str(tmp_path / "none")):  # no limit, or no cgroup files
        nm = memory_sampler.node_memory(free)
        assert nm is not None and nm["source"] == "host" and nm["total_bytes"] == host.total


def test_no_nvml_is_said_not_raised():
    gpu = memory_sampler.GpuMemory()
    assert gpu.by_pid() == {}
    assert gpu.problem is not None and "NVML" in gpu.problem  # this machine has none


@pytest.mark.parametrize(
    "watch",
    [None, {"targets": None, "sample_s": 1}, {"targets": [], "sample_s": 0},
     {"targets": [{"pid": -1}], "sample_s": 1}, {"targets": [{"pid": True}], "sample_s": 1}],
)  # fmt: skip
def test_a_bad_watch_is_refused_by_name(watch):
    with pytest.raises(ValueError):
        check_watch(watch)


@pytest.mark.parametrize(
    "target",
    [(1, "/etc/passwd"), (1, "x/../../y.memory.pickle"), ("1", "/a.memory.pickle"),
     (1, "/a\n.memory.pickle")],
)  # fmt: skip
def test_a_snapshot_request_names_only_snapshot_files(target):
    with pytest.raises(ValueError):
        check_snapshot_request({"targets": [target]})


def test_a_relative_snapshot_path_lands_in_the_user_s_private_memory_folder(tmp_path):
    (got,) = check_snapshot_request({"targets": [(5, "demand-001/policy/rank0.memory.pickle")]})
    assert got == (5, str(memory_dir() / "snapshots" / "demand-001/policy/rank0.memory.pickle"))
    assert memory_dir() == tmp_path / "node" / "memory"
    assert {os.stat(p).st_mode & 0o777 for p in (memory_dir(), memory_dir().parent)} == {0o700}


def test_a_process_with_no_demand_pipe_is_not_asked():
    why = ask_for_snapshot(os.getpid(), "/tmp/x.memory.pickle")
    assert "no demand pipe" in why


# ---------------------------------------------------------------- CUDA snapshots (mocked)


class FakeCudaMemory:
    """torch.cuda.memory's history and snapshot calls, replaced: the only mocking here."""

    def __init__(self, fail_dump=False):
        self.history, self.dumps, self.fail_dump = [], [], fail_dump

    def _record_memory_history(self, enabled="all", **kw):
        self.history.append((enabled, kw))

    def _dump_snapshot(self, path):
        if self.fail_dump:
            raise RuntimeError("injected: disk full")
        with open(path, "wb") as f:
            f.write(b"snapshot")
        self.dumps.append(path)


@pytest.fixture
def cuda(monkeypatch):
    import torch

    from worker_ext.rank import memory_snapshot

    fake = FakeCudaMemory()
    observers = []
    monkeypatch.setattr(memory_snapshot, "_cuda_memory", lambda: fake)
    monkeypatch.setattr(
        torch._C, "_cuda_attach_out_of_memory_observer", observers.append, raising=False
    )
    monkeypatch.setattr(memory_snapshot, "_state", {})
    fake.observers = observers
    yield fake


def notes():
    path = memory_dir() / f"{os.getpid()}.snapshots.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_window_snapshot_is_written_beside_the_trace_and_history_stops_after(cuda, tmp_path):
    from worker_ext.rank.memory_snapshot import MemorySnapshots

    cfg = MemorySnapshot(on=["window"], max_entries=5000, stacks="all").validate()
    snaps = MemorySnapshots(cfg, "cuda", 3, str(tmp_path))
    assert cuda.history == []  # nothing recorded between windows
    snaps.window_started()
    path = snaps.window_ended(str(tmp_path / "window_0000_steps_1-2" / "policy"))
    assert path == str(tmp_path / "window_0000_steps_1-2" / "policy" / "rank3.memory.pickle")
    assert Path(path).read_bytes() == b"snapshot"
    assert os.stat(path).st_mode & 0o777 == 0o600  # (not the umask's 0644: issue 53)
    assert cuda.history == [
        ("all", {"context": "all", "stacks": "all", "max_entries": 5000}),
        (None, {}),
    ]
    assert notes()[-1]["on"] == "window" and notes()[-1]["path"] == path
    assert [n for n in os.listdir(os.path.dirname(path)) if n.endswith(".tmp")] == []


def test_a_cpu_rank_never_touches_cuda_memory(cuda, tmp_path):
    from worker_ext.rank.memory_snapshot import MemorySnapshots

    cfg = MemorySnapshot(on=["window", "oom", "demand"]).validate()
    snaps = MemorySnapshots(cfg, "cpu", 0, str(tmp_path))
    snaps.window_started()
    assert snaps.window_ended(str(tmp_path)) is None
    assert cuda.history == [] and cuda.observers == []


def test_an_oom_writes_its_snapshot_before_the_error_goes_on_and_notes_it(cuda, tmp_path):
    from worker_ext.rank.memory_snapshot import MemorySnapshots

    cfg = MemorySnapshot(on=["oom"], stacks="none").validate()
    MemorySnapshots(cfg, "cuda", 1, str(tmp_path), role="rollout")
    assert cuda.history == [("all", {"context": None, "stacks": "python", "max_entries": 100_000})]
    (observer,) = cuda.observers
    observer(0, 2 << 30, 70 << 30, 1 << 20)  # what the allocator calls, then raises its OOM
    (path,) = cuda.dumps and [n["path"] for n in notes() if n["on"] == "oom"]
    assert path.startswith(str(tmp_path / "memory" / "rollout" / "rank1.oom-"))
    assert os.path.exists(path)


def test_a_snapshot_that_fails_to_write_is_noted_and_never_raised(cuda, tmp_path):
    from worker_ext.rank.memory_snapshot import MemorySnapshots

    cuda.fail_dump = True
    snaps = MemorySnapshots(
        MemorySnapshot(on=["window", "oom"]).validate(), "cuda", 0, str(tmp_path)
    )
    snaps.window_started()
    assert snaps.window_ended(str(tmp_path / "w")) is None
    cuda.observers[0](0, 1, 2, 3)
    failed = [n for n in notes() if n["error"]]
    assert [n["on"] for n in failed] == ["window", "oom"]
    assert all("injected: disk full" in n["error"] for n in failed)
    assert not any(name.endswith(".tmp") for name in os.listdir(tmp_path / "w"))


def test_a_snapshot_on_demand_comes_through_the_pipe_and_its_note_reaches_the_agent(cuda, tmp_path):
    from worker_ext.rank.memory_snapshot import MemorySnapshots

    MemorySnapshots(MemorySnapshot(on=["demand"]).validate(), "cuda", 2, str(tmp_path))
    sampler = MemorySampler("node-a")
    target = str(tmp_path / "memory" / "demand-001" / "policy" / "rank2.memory.pickle")
    assert ask_for_snapshot(os.getpid(), target) is None
    deadline = time.monotonic() + 10
    while not os.path.exists(target) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)
    got = sampler.watch({"targets": [{"pid": os.getpid()}], "sample_s": 1.0})["snapshots"]
    assert [(n["on"], n["path"], n["pid"]) for n in got] == [("demand", target, os.getpid())]
    assert sampler.watch({"targets": [], "sample_s": 1.0})["snapshots"] == []  # read once


@pytest.mark.parametrize("stacks", ["python", "all", "none"])
def test_max_entries_and_stacks_reach_torch(cuda, tmp_path, stacks):
    from worker_ext.rank.memory_snapshot import MemorySnapshots

    cfg = MemorySnapshot(on=["demand"], max_entries=10_000_000, stacks=stacks).validate()
    MemorySnapshots(cfg, "cuda", 0, str(tmp_path))
    ((enabled, kw),) = cuda.history
    assert kw["max_entries"] == 10_000_000 and (kw["context"] is None) == (stacks == "none")


@pytest.mark.subprocess  # (the rank's node agent is a spawned child here)
def test_a_rank_profiler_s_window_writes_its_snapshot_beside_the_trace(cuda, tmp_path, monkeypatch):
    """The rank profiler's real CPU window, its snapshot calls as on a CUDA rank."""
    from coordinator.core.config import ProfilerConfig
    from tests.torch_helpers import run_profiled
    from worker_ext.rank.memory_snapshot import MemorySnapshots

    as_cuda = MemorySnapshots.of.__func__  # type: ignore[attr-defined]

    def of_cuda(cls, rp):
        made = as_cuda(cls, rp)
        made.on = set(rp.config.memory_snapshot.on)  # what a CUDA rank's would be
        return made

    monkeypatch.setattr(MemorySnapshots, "of", classmethod(of_cuda))
    cfg = ProfilerConfig(
        enable=True, save_path=str(tmp_path), activities=["cpu"], export_type="chrome_trace",
        wait=1, warmup=1, active=2, repeat=1, memory_snapshot={"on": ["window"]},
    )  # fmt: skip
    rp, statuses = run_profiled(cfg, steps=6)
    (closed,) = [s["closed"] for s in statuses if s["closed"]]
    trace = closed["trace_path"]
    assert os.path.isfile(trace)
    snap = os.path.join(os.path.dirname(trace), "rank0.memory.pickle")
    assert Path(snap).read_bytes() == b"snapshot"
    assert [h[0] for h in cuda.history] == ["all", None]  # on for the window, off after it


@pytest.mark.subprocess
def test_two_coordinators_sampling_one_node_each_get_their_own_samples_and_notes():
    shared, mine = child(0), child(0)
    sampler = MemorySampler("node-a")
    try:
        a = {"targets": [{"pid": shared.pid}, {"pid": mine.pid}], "sample_s": 0.1, "watcher": "a"}
        b = {"targets": [{"pid": shared.pid}], "sample_s": 0.5, "watcher": "b"}
        sampler.watch(a)
        sampler.watch(b)
        time.sleep(1.2)
        got_a = {p["pid"]: p["samples"] for p in sampler.watch(a)["processes"]}
        got_b = {p["pid"]: p["samples"] for p in sampler.watch(b)["processes"]}
        assert set(got_a) == {shared.pid, mine.pid} and set(got_b) == {shared.pid}
        assert len(got_b[shared.pid]) >= 8  # every sample of the shared process, for both
        assert got_b[shared.pid] == got_a[shared.pid][-len(got_b[shared.pid]) :]
        memory_dir().mkdir(parents=True, exist_ok=True)
        note = {"on": "demand", "path": "/x.memory.pickle", "error": None, "at": 1.0}
        (memory_dir() / f"{shared.pid}.snapshots.jsonl").write_text(json.dumps(note) + "\n")
        assert [n["pid"] for n in sampler.watch(a)["snapshots"]] == [shared.pid]
        assert [n["pid"] for n in sampler.watch(b)["snapshots"]] == [shared.pid]  # b's too
        assert sampler.watch(a)["snapshots"] == []  # read once per watcher
    finally:
        sampler.close()
        for p in (shared, mine):
            p.kill()
            p.wait()
