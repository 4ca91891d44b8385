"""The coordinator's state in Ray's key-value store, kept where its restart finds it: the run's
record files (``record_codec``) and its live parts (``state_codec``), written by the record's
one writer (``record_writes``) to the ``KVStore`` back end, read back by the record's one reader
(``record_reader.open_record``). No pickle.

Layout under ``{namespace}/{name}/`` (``kv_store.KV_NAMESPACE``):

- ``coordinator.msgpack``: the runs kept (the current first), restarts, the step throttle;
- ``progress.msgpack``: the step counters, written by steps outside windows instead of the run;
- ``runs/{run}/run.msgpack`` and ``runs/{run}/state.msgpack``: the run, and where it stands;
- ``runs/{run}/windows/{index:06d}.msgpack``: a window, written at each save while it can still
  change and once more when it settles, then never again; deleted when the history drops it.
  Its per-rank kernel values stay out (``save_path``'s record keeps them);
- ``runs/{run}/ranks/{n:06d}.msgpack``: its rank records, ``RANK_CHUNK`` a file, written only
  when one may have changed, one chunk converted per turn of the event loop (at once, with
  its registration, when a trainer registered: they must match on a load);
- ``runs/{run}/trainers.msgpack``: its trainers with their ranks' actor ids, when one
  registers (a restart finds each actor again in Ray's actor table: ``raylink.handles``).

Each part of a key (namespace, name, run) is one component of it (``kv_store.key_part``):
coordinator ``x``'s keys are never ``x-2``'s, nor namespace ``a/b`` with name ``c`` those of
namespace ``a`` with name ``b/c``.

What a save converts on the event loop is bounded: a window is copied in the save's turn
(``WindowRecord.snapshot``) and encoded on the writer's thread; rank records go a chunk a
turn. Writes happen on the writer's thread, in the order queued, the windows before the state
that names them; the state names a window only once its file is written (``StateSaver``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from coordinator.core import record_codec as codec
from coordinator.core import state_codec as sc
from coordinator.core.records import WindowRecord
from coordinator.core.run import Run
from coordinator.core.steps import Steps, run_steps, run_steps_yielding
from coordinator.raylink.handles import dump_handle
from coordinator.service.kv_store import KVStore
from coordinator.service.record_reader import Recorded, open_record
from coordinator.service.record_writes import RecordWrites

log = logging.getLogger(__name__)
COORDINATOR, PROGRESS = "coordinator.msgpack", "progress.msgpack"
WindowKey = tuple[str, int]  # (run name, window index)


def root(namespace: str, name: str) -> KVStore:
    """The coordinator's files in Ray's KV."""
    return KVStore(namespace, name)


def run_store(namespace: str, name: str, run: str) -> KVStore:
    """One run's files in Ray's KV."""
    return KVStore(namespace, name, "runs", run)


def _encoded(item: codec.RecordFile) -> Callable[[], bytes]:
    return functools.partial(codec.encode, item)


def _window_blob(run: str, snap: WindowRecord) -> bytes:
    """A window as a restart reads it: without its per-rank kernel values (the bulk of a window
    at scale: 8 of its 9.8 MB at 1,024 ranks; only the rank x kernel views read them)."""
    return codec.encode(codec.window_file(run, snap, detail=False))


def _gone() -> None:
    return None  # (a blob of None removes the file)


@dataclass
class StateSaver:
    """Writes one coordinator's state incrementally (see the module docstring). ``stats`` is
    what ``status()["checkpoint"]`` shows.

    Work is marked saved only once it is written, as the record's writer does: a write the
    queue refuses (full) marks nothing and is queued again at the next save; a settled window
    is "saved" (never written again) once its file is written; the state and run files name a
    window only once its file is written (at their own write, on the writer's thread), and are
    queued again when a window they left out is written later."""

    namespace: str
    name: str
    writes: RecordWrites = field(default_factory=RecordWrites)
    saved_windows: set[WindowKey] = field(default_factory=set)
    """Settled windows written (never again)."""
    written: set[WindowKey] = field(default_factory=set)
    """Windows written, in some version: those the state may name."""
    window_parts: set[WindowKey] = field(default_factory=set)
    """Every window stored, or queued to be."""
    saved_ranks: dict[str, tuple[int, int]] = field(default_factory=dict)
    """run -> (ranks_version, registrations) last queued."""
    rank_chunks: dict[str, int] = field(default_factory=dict)
    """run -> the rank chunks stored."""
    restore_problems: list[str] = field(default_factory=list)
    """What the last restart's load could not read back (``status()["checkpoint"]``)."""
    _settling: set[WindowKey] = field(default_factory=set)  # settled, queued, not yet written
    _stale: set[str] = field(default_factory=set)  # runs whose state must be queued again
    _heads: dict[str, tuple[sc.RunState, codec.RunFile]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # (the sets the writer marks)
    _ranks_due: dict[str, Run] = field(default_factory=dict)
    _ranks_task: asyncio.Task[None] | None = None
    stats: dict[str, Any] = field(
        default_factory=lambda: {"bytes": 0, "seconds": 0.0, "at": None, "error": None}
    )
    _error: str | None = None
    _looked: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    """run -> what ``_looks`` saw of it at the last save that queued its state."""
    _configs: dict[str, tuple[Any, dict[str, Any], dict[str, Any]]] = field(default_factory=dict)
    """run -> (its config, whole, redacted): converted once."""

    def save_runs(self, current: Run, previous: list[Run], extra: dict[str, Any]) -> None:
        """Queue the writes of the runs as they are now: their windows that can still change
        (and those that settled since the last save), their state, the coordinator's file."""
        t0 = time.perf_counter()
        runs = [current, *previous]
        self._error = None
        try:
            keep = {(run.name, i) for run in runs for i in run.state.windows}
            for key in sorted(self.window_parts - keep):
                store = run_store(self.namespace, self.name, key[0])
                if self._queue(store, f"windows/{key[1]:06d}.msgpack", _gone):
                    self.window_parts.discard(key)
            with self._lock:
                for marks in (self.saved_windows, self.written, self._settling):
                    marks.intersection_update(keep)
            for run in runs:
                self._save_run(run, run is current)
            for dropped in [r for r in self.saved_ranks if r not in {x.name for x in runs}]:
                self._drop_run(dropped)
            head = sc.CoordinatorFile(sc.STATE_VERSION, [r.name for r in runs],
                                      int(extra["restarts"]), bool(extra["throttled"]))  # fmt: skip
            self._queue(root(self.namespace, self.name), COORDINATOR, _encoded(head))
        except Exception as exc:  # a checkpoint that fails costs the restart, never the run
            self._failed(exc)
            return
        self.stats.update(seconds=time.perf_counter() - t0, at=time.time())
        self._write_ranks_soon()

    def _save_run(self, run: Run, current: bool) -> None:
        """Queue what changed of ``run``. A run that ended changes little: its state is written
        again only when a window of it is, or what ``_looks`` reads of it changed. What was
        refused is marked as not done (the next save does it)."""
        store, st = run_store(self.namespace, self.name, run.name), run.state
        looks = _looks(run)
        changed = current or self._looked.get(run.name) != looks or run.name in self._stale
        done = True
        for i, rec in st.windows.items():
            key = (run.name, i)
            if key in self.saved_windows or key in self._settling:
                continue
            settled = rec.settled
            blob = functools.partial(_window_blob, run.name, rec.snapshot())
            written = self._window_written(key, settled)
            if self._queue(store, f"windows/{i:06d}.msgpack", blob, written):
                self.window_parts.add(key)
                if settled:
                    self._settling.add(key)
            changed = True
        was = self.saved_ranks.get(run.name, (-1, -1))
        # (an SPMD rank joining its trainer changes the trainer's part as a registration does)
        now = (st.ranks_version, st.counters["registrations"] + st.counters["rank_attaches"])
        self.saved_ranks[run.name] = now
        if was[1] != now[1]:  # its rank records go with it, now: they must match on a load
            self._ranks_due.pop(run.name, None)
            done = run_steps(self._ranks_steps(run))
            trainers = [sc.trainer_file(t, dump_handle) for t in st.trainers.values()]
            f = sc.TrainersFile(sc.STATE_VERSION, run.name, trainers)
            done = self._queue(store, "trainers.msgpack", _encoded(f)) and done
        elif was[0] != now[0]:  # (in later turns)
            self._ranks_due[run.name] = run
        if changed or was != now:
            done = self._queue_state(run) and done
        if done:
            self._looked[run.name] = looks
        else:  # (all of it again at the next save)
            self._looked.pop(run.name, None)
            self.saved_ranks[run.name] = (-1, -1)

    def _window_written(self, key: WindowKey, settled: bool) -> Callable[[], None]:
        """What the writer's thread calls once window ``key``'s file is written: the state may
        name it; a settled one is saved; the run's state is queued again if it left it out."""

        def done() -> None:
            with self._lock:
                new = key not in self.written
                self.written.add(key)
                if settled:
                    self._settling.discard(key)
                    self.saved_windows.add(key)
                heads = self._heads.get(key[0])
                if new and heads is not None and key[1] in heads[0].windows:
                    self._queue_heads(key[0], heads)

        return done

    def _queue_state(self, run: Run) -> bool:
        """``run``'s state and run file, after whatever is queued for it already; whether both
        were queued."""
        st = run.state
        kept = self._configs.get(run.name)
        if kept is None or kept[0] is not run.config:  # (a run's config is converted once)
            kept = self._configs[run.name] = (
                run.config, run.config.to_dict(), run.config.public_dict()
            )  # fmt: skip
        state = sc.run_state(run, self.rank_chunks.get(run.name, 0), kept[1])
        head = codec.run_file(run, list(st.windows), 0, 0, [], time.time(), config=kept[2])
        with self._lock:  # (never an older state queued over it by the writer's thread)
            self._heads[run.name] = (state, head)
            return self._queue_heads(run.name, (state, head))

    def _queue_heads(self, run: str, heads: tuple[sc.RunState, codec.RunFile]) -> bool:
        """Queue ``heads`` (the state, the run file), each naming only the windows written
        when it is encoded; a refusal makes the next save queue them again. Under the lock."""
        store = run_store(self.namespace, self.name, run)
        ok = [
            self._queue(store, rel, functools.partial(_named, self, run, f))
            for rel, f in (("state.msgpack", heads[0]), ("run.msgpack", heads[1]))
        ]
        if all(ok):
            self._stale.discard(run)
        else:
            self._stale.add(run)
        return all(ok)

    def _drop_run(self, run: str) -> None:
        """A run no longer kept: its files go."""
        store = run_store(self.namespace, self.name, run)
        for rel in ("run.msgpack", "state.msgpack", "trainers.msgpack"):
            self._queue(store, rel, _gone)
        for n in range(self.rank_chunks.pop(run, 0)):
            self._queue(store, f"ranks/{n:06d}.msgpack", _gone)
        del self.saved_ranks[run]
        self._looked.pop(run, None)
        self._configs.pop(run, None)
        self._ranks_due.pop(run, None)
        with self._lock:
            self._heads.pop(run, None)
            self._stale.discard(run)

    def _queue(
        self,
        store: KVStore,
        rel: str,
        blob: Callable[[], bytes | None],
        on_written: Callable[[], None] | None = None,
        counted: bool = True,
    ) -> bool:
        """Queue a write; whether it was (a refusal is the save's error, until the next save).
        ``counted``: its bytes go to ``stats["bytes"]`` once encoded (the step counters' writes
        are not: idle steps leave the figures as they are)."""

        def encoded() -> bytes | None:
            data = blob()
            if counted and data:
                self.stats["bytes"] += len(data)
            return data

        if self.writes.queue(store, rel, encoded, on_written):
            return True
        self._error = f"{store.url}/{rel}: the state's writes are over their bound (again later)"
        self.stats["error"] = self._error
        return False

    # ------------------------------------------------------------ rank records

    def _write_ranks_soon(self) -> None:
        """The rank records of the runs whose records changed, ``RANK_CHUNK`` records per turn
        of the event loop, or at once without a loop."""
        if not self._ranks_due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._write_ranks_now()
            return
        if self._ranks_task is None or self._ranks_task.done():
            self._ranks_task = loop.create_task(self._write_ranks())

    async def _write_ranks(self) -> None:
        while self._ranks_due:
            run = self._ranks_due.pop(next(iter(self._ranks_due)))
            try:
                if not await run_steps_yielding(self._ranks_steps(run)):
                    self.saved_ranks[run.name] = (-1, -1)  # (refused: again at the next save)
            except Exception as exc:
                self._failed(exc)

    def _write_ranks_now(self) -> None:
        while self._ranks_due:
            run = self._ranks_due.pop(next(iter(self._ranks_due)))
            if not run_steps(self._ranks_steps(run)):
                self.saved_ranks[run.name] = (-1, -1)

    def _ranks_steps(self, run: Run) -> Steps[bool]:
        """Convert ``run``'s rank records a chunk per step, then queue their writes, the
        chunks no longer needed removed, and the state that counts them; whether all of it
        was queued (the count changes only then)."""
        st, store = run.state, run_store(self.namespace, self.name, run.name)
        keys, chunks = list(st.ranks), []
        for n, i in enumerate(range(0, len(keys), sc.RANK_CHUNK)):
            rows = [st.ranks[k] for k in keys[i : i + sc.RANK_CHUNK] if k in st.ranks]
            # (encoded in this turn, in C: the records change in place later)
            chunks.append(codec.encode(sc.RanksChunkOut(sc.STATE_VERSION, run.name, n, rows)))
            yield
        before = self.rank_chunks.get(run.name, 0)
        queued = [
            self._queue(store, f"ranks/{n:06d}.msgpack", functools.partial(bytes, blob))
            for n, blob in enumerate(chunks)
        ]
        if not all(queued):
            return False
        for n in range(len(chunks), before):
            self._queue(store, f"ranks/{n:06d}.msgpack", _gone)
        self.rank_chunks[run.name] = len(chunks)
        return self._queue_state(run)

    # ------------------------------------------------------------ the rest

    def load(self) -> tuple[list[Recorded], dict[str, Any]] | None:
        """``load_runs`` for this coordinator, what it could not read kept for ``entry()``."""
        self.restore_problems = []
        return load_runs(self.namespace, self.name, self.restore_problems)

    def loaded(self, runs: list[Run]) -> None:
        """The runs ``load_runs`` put back are stored: their settled windows are not written
        again, their rank records only once they change."""
        self.window_parts = {(r.name, i) for r in runs for i in r.state.windows}
        with self._lock:
            self.written = set(self.window_parts)
            self.saved_windows = {
                (r.name, i) for r in runs for i, w in r.state.windows.items() if w.settled
            }
        for r in runs:
            st = r.state
            regs = st.counters["registrations"] + st.counters["rank_attaches"]
            self.saved_ranks[r.name] = (st.ranks_version, regs)
            self.rank_chunks[r.name] = -(-len(st.ranks) // sc.RANK_CHUNK)

    def save_progress(self, run: str, last_step: int | None, global_step: int | None) -> None:
        """Queue a write of the step counters only."""
        f = sc.ProgressFile(sc.STATE_VERSION, run, last_step, global_step)
        try:
            self._queue(root(self.namespace, self.name), PROGRESS, _encoded(f), counted=False)
        except Exception as exc:
            self._failed(exc)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write is done (tests, and a clean shutdown)."""
        self._write_ranks_now()
        done = self.writes.flush(timeout_s)
        self._sync_stats()
        return done

    def _sync_stats(self) -> None:
        self.stats["error"] = self.writes.stats()["error"] or self._error

    def _failed(self, exc: Exception) -> None:
        self._error = f"{type(exc).__name__}: {exc}"[:500]
        self.stats["error"] = self._error
        log.warning("checkpoint failed: %s", self._error)

    def entry(self) -> dict[str, Any]:
        """``status()["checkpoint"]``: the bytes the saves wrote so far, the last save's
        seconds on the event loop, when, the latest error (a write still failing, or a save
        that could not be made, until the next save), and what the last restart could not
        read back (``restore_problems``)."""
        self._sync_stats()
        return {**self.stats, "restore_problems": list(self.restore_problems)}


def _named(saver: StateSaver, run: str, f: sc.RunState | codec.RunFile) -> bytes:
    """``f`` as written: naming only the windows of ``run`` written by now (on the writer's
    thread, after every write queued before it)."""
    with saver._lock:
        windows = [i for i in f.windows if (run, i) in saver.written]
    return codec.encode(msgspec.structs.replace(f, windows=windows))


def _read_root(
    namespace: str, name: str, rel: str, problems: list[str] | None = None
) -> codec.RecordFile | None:
    """One of the coordinator's own files, or None (none, or unreadable: logged, and said in
    ``problems``)."""
    store = root(namespace, name)
    try:
        blob = store.get(rel, codec.MAX_FILE_BYTES)
        return codec.decode(blob, f"{store.url}/{rel}") if blob else None
    except Exception as exc:
        log.exception("the coordinator's %s cannot be read; going on without it", rel)
        if problems is not None:
            problems.append(f"{store.url}/{rel}: {type(exc).__name__}: {exc}"[:500])
        return None


def _looks(run: Run) -> tuple[Any, ...]:
    """What can still change in a run that ended (cheap to read at every save)."""
    st = run.state
    return (run.lifecycle, run.ended_at, run.baseline, run.auto_override, st.global_step,
            sum(st.counters.values()), len(st.counters), tuple(st.windows))  # fmt: skip


def load_runs(
    namespace: str, name: str, problems: list[str] | None = None
) -> tuple[list[Recorded], dict[str, Any]] | None:
    """The runs of the coordinator's state in Ray's KV (current first), each read back by the
    record's one reader, and the coordinator's own file's fields; None without one. Never
    raises: what cannot be read is left out, logged and said in ``problems`` (a run's own
    problems also in its ``Recorded.problems``): a corrupt state must cost the restart what it
    holds, never the restart (Ray would restart the coordinator into the same fault forever)."""
    said: list[str] = [] if problems is None else problems
    head = _read_root(namespace, name, COORDINATOR, said)
    if not isinstance(head, sc.CoordinatorFile):
        return None
    runs = []
    for run in head.runs:
        try:
            runs.append(open_record(run_store(namespace, name, run), live=True))
        except Exception as exc:  # (of any kind: see above)
            log.warning("run %s of the coordinator's state cannot be read: %s", run, exc)
            said.append(f"run {run[:200]}: {type(exc).__name__}: {exc}"[:500])
            continue
        said += [f"run {run}: {p}" for p in runs[-1].problems]
    return runs, {"restarts": head.restarts, "throttled": head.throttled}


def load_progress(namespace: str, name: str) -> sc.ProgressFile | None:
    """The step counters saved after the last full save, or None."""
    got = _read_root(namespace, name, PROGRESS)
    return got if isinstance(got, sc.ProgressFile) else None


def delete(namespace: str, name: str) -> None:
    """Forget the coordinator's state (a coordinator created anew starts clean)."""
    try:
        root(namespace, name).clear()
    except Exception:
        log.debug("could not delete the coordinator's state", exc_info=True)
