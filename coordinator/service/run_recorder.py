"""The run's record in ``save_path``, kept by the coordinator as the run goes.

Every ``RECORD_INTERVAL_S`` (and at once when a window settles or the run stops) the recorder
looks at each run it keeps that has a ``run_dir`` and ``record: true``, and queues what is new
(``coordinator.core.record_codec`` names the files):

- each window once it settled, after its regression marks are made (a snapshot taken here,
  encoded and written on the writer's thread);
- the marks of a recorded window again when a later window changed them;
- the steps' phase times since the last look, into the growing chunk (``CHUNK_STEPS`` a chunk);
- each stall of the current run, again while its stacks change;
- the run's file, when anything in it changed: it names only the windows already written;
- the current run's memory (``memory.msgpack``: what ``memory(series=True)`` shows, bounded by
  ``memory_record``), when it changed, at most every ``MEMORY_EVERY_S``, and at once at the
  run's end and at a flush (a run that ended as the next began, before a look: once more, from
  the memory watcher's kept book); a run going on from its record keeps the memory recorded
  before.

A file the writer has no room for is queued again at a later look, never taken as written.
What is kept per run is bounded: the marks and stalls of the windows and stalls the
coordinator still keeps (only those can change). A run is finished with when it ended, every
window kept is recorded and nothing of it is queued. Writes never block the event loop and a
failed one is retried (``record_writes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from coordinator.core import record_codec as codec
from coordinator.core.memory_record import MemoryFile, memory_file, merged
from coordinator.core.records import WindowRecord
from coordinator.core.run import Run
from coordinator.protocol.memory_replies import MemoryReply
from coordinator.protocol.replies import RecordEntry
from coordinator.raylink.node_names import node_names
from coordinator.service.phase_store import PhaseStore
from coordinator.service.record_reader import MEMORY_FILE, Recorded, open_record, read_memory
from coordinator.service.record_store import RecordStore, record_url
from coordinator.service.record_writes import RecordWrites
from coordinator.service.shell import CoordinatorShell

log = logging.getLogger(__name__)
RECORD_INTERVAL_S = 2.0
CHUNK_STEPS = 1000
"""Steps' phase times in one chunk file (about 60 KB with a few regions)."""
MEMORY_EVERY_S = 15.0
"""The run's memory file is made at most this often while the run goes (longer when making it
takes longer: at most a twentieth of the time), at once at its end and at a flush."""


@dataclass
class _RunRecord:
    """What one run's record holds so far."""

    store: RecordStore
    windows: set[int] = field(default_factory=set)  # queued (or written)
    written: set[int] = field(default_factory=set)  # written: the run's file names these
    marks: dict[int, bytes] = field(default_factory=dict)  # as queued, encoded (kept windows)
    stalls: dict[int, bytes] = field(default_factory=dict)  # likewise (stalls kept)
    steps_seen: int = 0  # the phase log's steps looked at
    chunk: list[codec.PhaseRecord] = field(default_factory=list)  # the growing chunk's
    chunk_lost: int = 0
    chunk_queued: bool = True  # the growing chunk as it is now is queued
    chunks: int = 0  # chunk files, the growing one included
    steps: int = 0  # steps in the chunk files
    run_file: bytes = b""
    finished: bool = False
    nodes: dict[str, str] = field(default_factory=dict)  # node id -> its name (timelines)
    unnamed: set[str] = field(default_factory=set)  # nodes of queued windows, not yet named
    memory_seen: Any = None  # what the memory file last queued showed (``_memory_seen``)
    memory_due: float = 0.0  # (time.monotonic) the memory file is not made again before this
    memory_ended: bool = False  # made once after the run ended: nothing more will change it
    memory_base: MemoryFile | None = None  # the record's memory before this coordinator's


class RunRecorder:
    """See the module docstring; ``mark`` makes a run's regression marks (``Diffs.mark``)."""

    def __init__(self, shell: CoordinatorShell, mark: Callable[[Run], Awaitable[None]]) -> None:
        self.shell, self._mark = shell, mark
        self.writes = RecordWrites()
        self._runs: dict[str, _RunRecord] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._loop_of: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Start looking (once; from the event loop)."""
        self._loop_of = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._loop())

    def _written(self, rr: _RunRecord, index: int) -> Callable[[], None]:
        """What the writer's thread calls once window ``index``'s file is written: the run's
        file may name it now (at a look woken for it)."""

        def done() -> None:
            rr.written.add(index)
            if self._loop_of is not None:
                with contextlib.suppress(RuntimeError):  # (the loop has closed)
                    self._loop_of.call_soon_threadsafe(self.soon)

        return done

    def soon(self) -> None:
        """Look now, not at the next interval (a window settled, the run stopped)."""
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), RECORD_INTERVAL_S)
            self._wake.clear()
            try:
                await self.look()
            except Exception:  # the record must outlive its own faults
                log.exception("the run's record could not be brought up to date")
            await asyncio.sleep(0.2)  # (changes in a burst: one look)

    async def look(self, flushing: bool = False) -> None:
        """Queue what is new in every run kept (see the module docstring); ``flushing``: the
        memory too, whenever it was last made."""
        for run in [self.shell.run, *self.shell.previous]:
            rr = await self._record_of(run)
            done = rr is not None and rr.finished and rr.memory_ended  # (the current run's
            if rr is None or (done and run is not self.shell.run):  # stalls may still end, and
                continue  # the next run then keeps it for reading)
            if any(self._due(rr, rec) for rec in run.state.windows.values()):
                await self._mark(run)  # (marks first: a window is written once)
            self._windows(run, rr)
            await self._name_nodes(rr)
            self._phases(run, rr)
            ended = run.lifecycle in ("stopped", "abandoned")
            if run is self.shell.run:
                self._stalls(run, rr)
                await self._memory(run, rr, flushing or (ended and not rr.memory_ended), ended)
            elif not rr.memory_ended:  # (it ended as the next began, before a look: its last
                await self._memory(run, rr, True, True)  # memory, once)
            self._run_file(run, rr)
            rr.finished = ended and all(r.settled for r in run.state.windows.values())
        self.writes.kick()  # (a retry that is due)

    async def _record_of(self, run: Run) -> _RunRecord | None:
        """``run``'s record: new, or (the coordinator restarted, or a run continued after its
        cluster was lost) going on from what its directory already holds."""
        rr = self._runs.get(run.name)
        if rr is None and run.run_dir and getattr(run.config, "record", True):
            store = RecordStore(record_url(run.run_dir), run.config.storage_options)
            found = self.shell.restored.pop(run.name, None)
            if found is None:  # (reading is I/O: off the event loop)
                found = await asyncio.get_running_loop().run_in_executor(None, _existing, store)
            rr = self._runs[run.name] = _RunRecord(store)
            if found is not None:
                _go_on(rr, found, self.shell.phases, run.name)
                base = await asyncio.get_running_loop().run_in_executor(None, read_memory, store)
                rr.memory_base = base[0]  # (the run's memory in save_path, not Ray's KV)
            kept = {self.shell.run.name, *(r.name for r in self.shell.previous)}
            self._runs = {n: r for n, r in self._runs.items() if n in kept}
        return rr

    @staticmethod
    def _due(rr: _RunRecord, rec: WindowRecord) -> bool:
        return rec.window.index not in rr.windows and rec.settled

    def _windows(self, run: Run, rr: _RunRecord) -> None:
        for index, rec in run.state.windows.items():
            if self._due(rr, rec):
                snap = _snapshot(rec)
                name = f"windows/{index:06d}.msgpack"
                blob = functools.partial(_window_blob, run.name, snap)
                if self.writes.queue(rr.store, name, blob, self._written(rr, index)):
                    rr.windows.add(index)
                    rr.marks[index] = _marks_blob(run.name, rec)
                    rr.unnamed |= {t["node"] for t in snap.traces.values() if t["node"]}
            elif index in rr.windows:
                now = _marks_blob(run.name, rec)
                if now != rr.marks.get(index) and self.writes.queue(
                    rr.store, f"marks/{index:06d}.msgpack", _const(now)
                ):
                    rr.marks[index] = now
        # (a window the coordinator no longer keeps can no longer change its marks)
        rr.marks = {i: b for i, b in rr.marks.items() if i in run.state.windows}

    @staticmethod
    async def _name_nodes(rr: _RunRecord) -> None:
        """The names of the nodes new windows' traces were written on (one look-up in Ray's
        node table, off the event loop, when a window brings a node not named yet)."""
        unnamed, rr.unnamed = rr.unnamed - set(rr.nodes), set()
        if unnamed:
            names = await asyncio.get_running_loop().run_in_executor(None, node_names)
            rr.nodes.update({n: names.get(n, n[:8]) for n in unnamed})

    def _phases(self, run: Run, rr: _RunRecord) -> None:
        log_ = self.shell.phases.log(run.name)
        new = log_.steps_seen - rr.steps_seen
        if new <= 0:
            return
        kept = list(log_.exact)[-new:] if new <= len(log_.exact) else list(log_.exact)
        lost = new - len(kept)  # (the record fell more than EXACT_STEPS steps behind)
        rr.steps_seen = log_.steps_seen
        records = [(s, w, dict(r)) for s, w, r in kept]
        while records:
            if rr.chunks == 0 or len(rr.chunk) == CHUNK_STEPS:
                if not rr.chunk_queued:  # (a full chunk is queued before the next begins)
                    self._queue_chunk(run, rr)
                    if not rr.chunk_queued:
                        rr.steps_seen -= len(records)  # (looked at again at the next look)
                        return
                rr.chunk, rr.chunk_lost, rr.chunks = [], 0, rr.chunks + 1
            taken = records[: CHUNK_STEPS - len(rr.chunk)]
            records = records[len(taken) :]
            rr.chunk += taken
            rr.steps += len(taken)
            rr.chunk_lost, lost = rr.chunk_lost + lost, 0
            rr.chunk_queued = False
        self._queue_chunk(run, rr)

    def _queue_chunk(self, run: Run, rr: _RunRecord) -> None:
        """The growing chunk as it is now, unless it is queued already (or there is none)."""
        if rr.chunk_queued or not rr.chunks:
            return
        n = rr.chunks - 1
        chunk = codec.PhaseChunk(codec.VERSION, run.name, n, list(rr.chunk), rr.chunk_lost)
        encoded = functools.partial(codec.encode, chunk)  # (on the writer's thread)
        rr.chunk_queued = self.writes.queue(rr.store, f"phases/{n:06d}.msgpack", encoded)

    def _stalls(self, run: Run, rr: _RunRecord) -> None:
        live = set()
        for entry in self.shell.stalls:
            if entry["detected_at"] < run.created_at:  # (an earlier run's)
                continue
            index = entry["index"]
            live.add(index)
            blob = codec.encode(codec.StallFile(codec.VERSION, run.name, copy.deepcopy(entry)))
            if rr.stalls.get(index) != blob and self.writes.queue(
                rr.store, f"stalls/{index:06d}.msgpack", _const(blob)
            ):
                rr.stalls[index] = blob
        for index, blob in rr.stalls.items():
            if blob and index not in live:  # (no longer kept, so it cannot change: its file
                rr.stalls[index] = b""  # stays named, its bytes are not kept here)

    async def _memory(self, run: Run, rr: _RunRecord, now: bool, ended: bool) -> None:
        """The run's memory file, when it changed since the last one queued (module
        docstring); ``now``: whenever the last was made."""
        made = getattr(self.shell, "memory_recorded", None)  # (None: no memory watcher)
        if made is None:
            rr.memory_ended = ended
            return
        if not now and time.monotonic() < rr.memory_due:
            return
        t0 = time.monotonic()
        reply = await made(run.name)
        took = time.monotonic() - t0
        rr.memory_due = time.monotonic() + max(MEMORY_EVERY_S, 20 * took)
        if reply is None:  # (no watcher holds it now: none will)
            rr.memory_ended = ended
            return
        seen, base = _memory_seen(reply), rr.memory_base
        if seen != rr.memory_seen:

            def blob() -> bytes:  # (on the writer's thread)
                f = memory_file(reply, codec.VERSION, time.time())
                return codec.encode(f if base is None else merged(base, f))

            if not self.writes.queue(rr.store, MEMORY_FILE, blob):
                return  # (queued again at a later look)
            rr.memory_seen = seen
        rr.memory_ended = ended

    def _run_file(self, run: Run, rr: _RunRecord) -> None:
        f = codec.run_file(
            run, sorted(rr.written), rr.chunks, rr.steps, sorted(rr.stalls), 0.0, rr.nodes
        )
        same = codec.encode(f)
        if same == rr.run_file:
            return
        f.written_at = time.time()
        if self.writes.queue(rr.store, "run.msgpack", _const(codec.encode(f))):
            rr.run_file = same

    def entry(self) -> RecordEntry:
        """``status()["record"]``: where the current run's record is and how its writes go."""
        rr = self._runs.get(self.shell.run.name)
        stats = self.writes.stats()
        return {
            "dir": rr.store.url if rr is not None else None,
            "windows": len(rr.written) if rr is not None else 0,
            "steps": rr.steps if rr is not None else 0,
            "files": stats["files"],
            "bytes": stats["bytes"],
            "pending": stats["pending"],
            "failures": stats["failures"],
            "dropped": stats["dropped"],
            "error": stats["error"],
            "retry_in_s": stats["retry_in_s"],
            "last_write_at": stats["at"],
        }

    async def flush(self, timeout_s: float) -> bool:
        """Look now and wait until everything queued is written, then look again (the run's
        file names a window once its file is written) until a look queues nothing: whether
        that came within ``timeout_s`` (a run's stop, tests)."""
        deadline = time.monotonic() + timeout_s
        loop, first = asyncio.get_running_loop(), True
        while True:
            before = self.writes.accepted
            await self.look(flushing=first)  # (the memory once: it changes at every pull)
            first = False
            if self.writes.accepted == before and not self.writes.stats()["pending"]:
                return True
            left = deadline - time.monotonic()
            if left <= 0 or not await loop.run_in_executor(None, self.writes.flush, left):
                return False


def _memory_seen(reply: MemoryReply) -> Any:
    """What of ``reply`` changes when the run's memory does (its time of making does not)."""
    ranks = tuple(
        (r["trainer_id"], r["rank"], r["samples"], r["state"], str(r["growth"]), r["culprit"])
        for r in reply["ranks"]
    )
    return ranks, len(reply["snapshots"]), tuple(map(tuple, reply["windows"])), reply["sample_s"]


def _existing(store: RecordStore) -> Recorded | None:
    """The record already at ``store``, or None (none there, or unreadable: logged)."""
    try:
        return open_record(store.url, store.options) if store.exists("run.msgpack") else None
    except (ValueError, OSError) as exc:
        log.warning("the run record at %s cannot be read (%s); writing it anew", store.url, exc)
        return None


def _go_on(rr: _RunRecord, rec: Recorded, phases: PhaseStore, run: str) -> None:
    """A record that already holds some of the run (``record_reader.adopt``, or the
    coordinator restarted from its checkpoint): what it holds is not written again, its last
    phase chunk goes on filling, and a phase log the coordinator lost comes back from it."""
    head = rec.file
    rr.windows = set(rec.run.state.windows)
    rr.written = set(rec.run.state.windows)
    rr.marks = {i: _marks_blob(head.name, w) for i, w in rec.run.state.windows.items()}
    rr.stalls = {
        s["index"]: codec.encode(codec.StallFile(codec.VERSION, head.name, s)) for s in rec.stalls
    }
    rr.chunks, rr.chunk, rr.steps = head.phase_chunks, list(rec.last_chunk), head.steps_recorded
    rr.nodes = dict(head.nodes)
    log_ = phases.log(run)
    if log_ is not rec.phases:  # (a restarted coordinator: reports may have come before this)
        last = rec.phases.exact[-1][0] if rec.phases.exact else -1
        rec.phases.add([[s, w, dict(r)] for s, w, r in log_.exact if s > last])
        phases.adopt(run, rec.phases)
        log_ = rec.phases
    # The steps after the record's last one are written at this look.
    recorded = rr.chunk[-1][0] if rr.chunk else -1
    rr.steps_seen = log_.steps_seen - sum(1 for s, _, _ in log_.exact if s > recorded)


def _snapshot(rec: WindowRecord) -> WindowRecord:
    """A copy of a settled window the writer's thread can encode while the loop goes on."""
    snap = rec.snapshot()
    for name, empty in (("marks", {}), ("profiles", {}), ("trigger", None)):
        setattr(snap, name, copy.deepcopy(getattr(rec, name, empty)))
    return snap


def _const(blob: bytes) -> Callable[[], bytes]:
    return lambda: blob


def _window_blob(run: str, snap: WindowRecord) -> bytes:
    return codec.encode(codec.window_file(run, snap))


def _marks_blob(run: str, rec: WindowRecord) -> bytes:
    marks: dict[str, Any] = copy.deepcopy(getattr(rec, "marks", {}))
    counted = getattr(rec, "counted_slower", False)
    return codec.encode(codec.MarksFile(codec.VERSION, run, rec.window.index, marks, counted))
