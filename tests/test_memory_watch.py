"""The coordinator's memory watch with a real node sampler: ``MemoryWatcher`` pulls a real
``MemorySampler`` (as the node agent's ``watch_memory`` does, off its event loop) that samples
real processes, one leaking 600 MiB a minute (10 MiB a second), one flat. The steep leak is
named by the short span, at its rate, with the time its node has left from the memory the
sampler read; the flat process is not. The spans are shortened (6 s, not 90) to keep it short;
the default spans' timing is tested on synthetic series in ``test_memory_core``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from types import SimpleNamespace

import pytest

from coordinator.core.config import ProfilerConfig
from coordinator.core.records import RankRecord, TrainerRecord
from coordinator.core.run import new_run
from coordinator.ops.memory_table import render_memory
from coordinator.ops.recorded import RecordedCoordinator, call, open_record
from coordinator.protocol.names import agent_name
from coordinator.service.memory_watch import MemoryWatcher
from coordinator.service.phase_store import PhaseStore
from coordinator.service.run_recorder import RunRecorder
from tests.test_memory_sampler import child
from worker_ext.agent.memory_sampler import MemorySampler, check_watch

MiB = 1 << 20
RATE = 10 * MiB  # bytes a second: 600 MiB a minute
MEMORY = {"sample_s": 0.2, "leak_fast_span_s": 6}  # the long span and both floors: defaults


class SamplerAgent:
    """A node agent's ``watch_memory`` in this process: the real sampler, called the way the
    agent calls it (the watch checked, the sampler on a worker thread)."""

    def __init__(self, sampler: MemorySampler) -> None:
        self.sampler = sampler
        self.watch_memory = SimpleNamespace(remote=self._watch)

    async def _watch(self, watch):
        check_watch(watch)
        return await asyncio.get_running_loop().run_in_executor(None, self.sampler.watch, watch)


def run_of(pids, save_path=None, taken=()):
    cfg = {"memory": MEMORY, **({"save_path": str(save_path)} if save_path else {})}
    run = new_run(ProfilerConfig.from_dict(cfg), set(taken))
    run.lifecycle = "running"
    run.state.trainers["sft"] = TrainerRecord("sft", "policy", list(range(len(pids))), {}, None)
    for r, pid in enumerate(pids):
        run.state.ranks[("sft", r)] = RankRecord("sft", r, True, node_id="node-a", pid=pid)
    return run


def watcher_of(pids, reads, save_path=None):
    metrics = SimpleNamespace(marks=[], memory=lambda m: metrics.marks.append(m))
    shell = SimpleNamespace(
        run=run_of(pids, save_path), previous=[], reads=reads, metrics=metrics, namespace="t",
        name="c", restored={}, stalls=[], phases=PhaseStore(lambda *a: "", print),
    )  # fmt: skip
    watcher = MemoryWatcher(shell)
    return watcher, metrics


@pytest.mark.subprocess
def test_a_steep_leak_is_named_by_the_short_span_with_its_node_s_time_left():
    flat, leak = child(0), child(RATE)
    t0 = time.time()
    sampler = MemorySampler("node-a")
    reads = concurrent.futures.ThreadPoolExecutor(1)
    watcher, metrics = watcher_of([flat.pid, leak.pid], reads)
    watcher.agents._handles[agent_name("node-a")] = SamplerAgent(sampler)

    async def pull_until_marked():
        while time.time() - t0 < 30:
            await asyncio.sleep(1.0)  # pull_every(0.2)
            await watcher.pull()
            if watcher.entry()["marked"]:
                return time.time() - t0
        return None

    try:
        took = asyncio.run(pull_until_marked())
        m = asyncio.run(watcher.reply(series=False, trainer_id=None))
    finally:
        sampler.close()
        reads.shutdown()
        for p in (flat, leak):
            p.kill()
            p.wait()
    assert took is not None and took < 6 * 2.5, watcher.entry()
    (mark,) = watcher.entry()["marked"]
    assert (mark["rank"], mark["span_s"]) == (1, 6.0)
    assert mark["bytes_per_min"] == pytest.approx(RATE * 60, rel=0.3)
    flat_rank, leak_rank = m["ranks"]
    assert flat_rank["growth"] is None and leak_rank["growth"] is not None
    node = m["nodes"]["node-a"]
    assert node["total_bytes"] >= node["available_bytes"] > 0 and node["at"] >= t0
    left = leak_rank["growth"]["time_left_s"]
    assert left == pytest.approx(node["available_bytes"] / (mark["bytes_per_min"] / 60), rel=0.05)
    assert (m["leak_fast_span_s"], m["leak_fast_min_bytes_per_min"]) == (6.0, 100 * MiB)
    assert metrics.marks and metrics.marks[-1][0]["time_left_s"] == mark["time_left_s"]
    table = render_memory(m)
    assert "or over 6 s at 100 MiB/min" in table and ", node memory gone in " in table


def test_a_run_that_ends_before_the_first_pull_is_recorded_with_no_samples():
    """The record's memory file is made for a short run too (a fresh-clone run failed on a
    record with no ``memory.msgpack``: its run ended before the watcher's first pull)."""
    reads = concurrent.futures.ThreadPoolExecutor(1)
    try:
        watcher, _ = watcher_of([11, 12], reads)
        got = asyncio.run(watcher.recorded(watcher.shell.run.name))
        assert got is not None and [r["rank"] for r in got["ranks"]] == [0, 1]
        assert all(r["samples"] == 0 for r in got["ranks"]), got["ranks"]
        assert asyncio.run(watcher.recorded("another-run")) is None
    finally:
        reads.shutdown()


def test_runs_that_follow_one_another_before_a_pull_each_get_their_last_memory(tmp_path):
    """Runs A, B, C follow one another with no pull between (issue 54 item 4, a review): A's
    record gets its memory as it was when B began (its second sample, folded after the
    recorder's last look at A), and B's, current only between two looks, its ranks with no
    sample; before, the watcher caught up only at a pull, and both files were lost or stale."""
    reads = concurrent.futures.ThreadPoolExecutor(1)
    watcher, _ = watcher_of([11, 12], reads, save_path=tmp_path)
    shell = watcher.shell
    a = shell.run

    async def mark(_run):
        return None

    def sample(at):  # (one sample of rank 0 of A, on the reads thread as a fold adds it)
        reads.submit(
            watcher.book.add, ("sft", 0), 11, [(at, 10**9, None, None)], None, "n"
        ).result()

    async def go():
        recorder = RunRecorder(shell, mark)  # type: ignore[arg-type]
        sample(time.time())
        await recorder.look()  # A running: its memory made (one sample)
        sample(time.time() + 1)
        for _ in range(2):  # B begins, ends; C begins: no pull, no look between
            shell.run.lifecycle = "stopped"
            shell.previous.append(shell.run)
            shell.run = run_of([21], tmp_path, taken={r.name for r in shell.previous})
        assert await recorder.flush(30.0)

    try:
        asyncio.run(go())
    finally:
        reads.shutdown()
    b = shell.previous[1]
    assert len({a.name, b.name, shell.run.name}) == 3
    got = {}
    for run in (a, b):
        record = os.path.join(run.run_dir, "record")
        assert os.path.isfile(os.path.join(record, "memory.msgpack")), run.name
        got[run.name] = call(RecordedCoordinator(open_record(record)), "memory", series=True)
    assert [r["samples"] for r in got[a.name]["ranks"]] == [2, 0]
    assert got[a.name]["run"] == a.name and got[b.name]["run"] == b.name
    assert [(r["rank"], r["samples"]) for r in got[b.name]["ranks"]] == [(0, 0)]
