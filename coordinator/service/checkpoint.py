"""The coordinator's state, kept where its restart finds it: Ray's internal key-value store.

Why Ray's KV and not a file under the run directory: it is reachable from whichever node Ray
restarts the coordinator on (a run directory may be node-local, or a URL that needs credentials
and a network round trip per write), a write costs about a millisecond, and it lives exactly as
long as the cluster the coordinator belongs to. It does not survive a restart of the head node's
GCS, and neither does the detached coordinator it serves.

The checkpoint is incremental, so no write grows with the run's history:

- ``<namespace>/<name>``: the runs (config, window plan, counters, the indices of their
  windows), without their windows, ranks and the trainers' actor handles;
- ``<namespace>/<name>/ranks/<run>``: an index of a run's rank records, in chunks of
  ``RANK_CHUNK`` under ``.../ranks/<run>/<n>``, written only when one may have changed: a step
  whose ranks all answered as before (the per-node path folds them away) writes none. The
  chunks are pickled one per turn of the event loop after the save that found them changed
  (10,000 records took 12 ms of one turn), except when a trainer registered: then at once,
  with its registration, which they must match on a load;
- ``<namespace>/<name>/trainers/<run>``: its trainers' registrations with their actor handles
  (slow to pickle: Ray counts each handle's references), written when a trainer registers;
- ``<namespace>/<name>/window/<run>/<index>``: a window, written at each save while it can
  still change and once more when it settles (stopped, with no summary or trace still to
  come), then never again; deleted when the history drops it. A save copies the windows it
  writes in its own turn and pickles them from the copies in pieces in the next turns
  (``window_pieces``: a window of 10,000 ranks at once was 40-80 ms of one turn in the
  10,000-rank simulation), then queues its writes, the windows before the runs' record that
  names them;
- ``<namespace>/<name>/progress``: the step counters, a few bytes, written by steps outside
  windows instead of the whole run.

Pickling happens on the event loop's thread, from a consistent snapshot, in bounded steps; the
write to the KV, a blocking call to the GCS, happens on one background thread, in order.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import logging
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.core.records import WindowRecord
from coordinator.core.run import Run
from coordinator.core.steps import Steps, T, run_steps, run_steps_yielding
from coordinator.service import window_pieces

log = logging.getLogger(__name__)

KV_NAMESPACE = "ray_profiler"
VERSION = 2
STATE, PROGRESS = "", "progress"  # the parts of a checkpoint
RANK_CHUNK = 1024  # rank records pickled in one turn of the event loop (about 1.2 ms)
WindowKey = tuple[str, int]  # (run name, window index)


def _key(namespace: str, name: str, part: str) -> bytes:
    return f"{namespace}/{name}{'/' + part if part else ''}".encode()


def _window_part(key: WindowKey) -> str:
    return f"window/{key[0]}/{key[1]}"


def _ranks_part(run: str) -> str:
    return f"ranks/{run}"


def _ranks_chunk_part(run: str, n: int) -> str:
    return f"ranks/{run}/{n}"


def _trainers_part(run: str) -> str:
    return f"trainers/{run}"


def _put(namespace: str, name: str, part: str, blob: bytes) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(
        _key(namespace, name, part), blob, overwrite=True, namespace=KV_NAMESPACE
    )


def _delete(namespace: str, name: str, part: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(_key(namespace, name, part), namespace=KV_NAMESPACE)


def _dumps(payload: Any) -> bytes:
    """The standard pickler (twice as fast as cloudpickle on 10,000 rank records: 18 ms, not
    35); cloudpickle for what it cannot pickle. Both load with ``cloudpickle.loads``."""
    try:
        return pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        import ray.cloudpickle as cloudpickle

        return bytes(cloudpickle.dumps(payload))


def save(namespace: str, name: str, payload: dict[str, Any], part: str = STATE) -> int:
    """Store ``payload`` as ``part`` now; returns its size in bytes. Raises what Ray or pickling
    raises."""
    blob = _dumps({"version": VERSION, **payload})
    _put(namespace, name, part, blob)
    return len(blob)


def load(namespace: str, name: str, part: str = STATE) -> dict[str, Any] | None:
    """The last ``part`` stored, or None (none, unreadable, or of another version)."""
    try:
        import ray.cloudpickle as cloudpickle
        from ray.experimental import internal_kv

        blob = internal_kv._internal_kv_get(_key(namespace, name, part), namespace=KV_NAMESPACE)
        if not blob:
            return None
        payload = cloudpickle.loads(blob)
    except Exception:
        log.exception("the coordinator's checkpoint cannot be read; starting without it")
        return None
    if not isinstance(payload, dict) or payload.get("version") != VERSION:
        return None
    return payload


def delete(namespace: str, name: str) -> None:
    """Forget every part of the checkpoint (a coordinator created anew starts clean)."""
    try:
        from ray.experimental import internal_kv

        prefix = _key(namespace, name, "")
        for key in internal_kv._internal_kv_list(prefix, namespace=KV_NAMESPACE):
            if key == prefix or key.startswith(prefix + b"/"):
                internal_kv._internal_kv_del(key, namespace=KV_NAMESPACE)
    except Exception:
        log.debug("could not delete the coordinator's checkpoint", exc_info=True)


def settled(rec: WindowRecord) -> bool:
    """A window that can no longer change: stopped, nothing pending."""
    return rec.closed and not rec.summaries_pending and not rec.traces_pending


def without_windows(run: Run) -> Run:
    """A shallow copy of ``run`` whose state holds no windows, no ranks and no trainers
    (stored apart)."""
    state = copy.copy(run.state)
    state.windows = collections.OrderedDict()
    state.ranks, state.trainers = {}, {}
    state.__dict__.pop("_rank_counts", None)  # (a cache of counts over the ranks)
    light = copy.copy(run)
    light.state = state
    return light


def _timed(steps: Steps[T], spent: list[float]) -> Steps[T]:
    """``steps``, each one's time added to ``spent[0]``."""
    while True:
        t0 = time.perf_counter()
        try:
            next(steps)
        except StopIteration as done:
            spent[0] += time.perf_counter() - t0
            return done.value  # type: ignore[no-any-return]
        spent[0] += time.perf_counter() - t0
        yield


@dataclass
class Checkpointer:
    """Writes one coordinator's checkpoint incrementally, off the event loop (see the module
    docstring). ``stats`` is what ``status()["checkpoint"]`` shows."""

    namespace: str
    name: str
    saved_windows: set[WindowKey] = field(default_factory=set)
    """Settled windows written (never again)."""
    window_parts: set[WindowKey] = field(default_factory=set)
    """Every window part stored, or queued to be."""
    saved_ranks: dict[str, tuple[int, int]] = field(default_factory=dict)
    """run -> (ranks_version, registrations) last written."""
    rank_chunks: dict[str, int] = field(default_factory=dict)
    """run -> the chunks of rank records last written."""
    _ranks_due: dict[str, tuple[Any, int]] = field(default_factory=dict)
    """run -> (its state, ranks_version): rank records still to write."""
    _ranks_task: asyncio.Task[None] | None = None
    _saves: collections.deque[Steps[None]] = field(default_factory=collections.deque)
    """Saves whose windows are still being pickled, in order (``_save_steps``)."""
    _saves_task: asyncio.Task[None] | None = None
    stats: dict[str, Any] = field(
        default_factory=lambda: {"bytes": 0, "seconds": 0.0, "at": None, "error": None}
    )
    _writer: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, "profiler-checkpoint")
    )

    def save_runs(self, current: Run, previous: list[Run], extra: dict[str, Any]) -> None:
        """Snapshot the runs now and queue the writes: the windows that can still change (and
        those that settled since the last save) are pickled in pieces from copies taken now,
        in the next turns of the event loop, and written before the runs' record."""
        t0 = time.perf_counter()
        runs = [current, *previous]
        try:
            writes, snapshot, windows = self._snapshot(runs)
            blob = _dumps({"version": VERSION, "runs": snapshot, **extra})
        except Exception as exc:  # a checkpoint that fails costs the restart, never the run
            self._failed(exc)
            return
        keep = {(run.name, i) for run in runs for i in run.state.windows}
        gone = self.window_parts - keep
        self.window_parts, self.saved_windows = keep, self.saved_windows & keep
        names = {r.name for r in runs}
        dropped = [run for run in self.saved_ranks if run not in names]  # runs no longer kept
        chunks = []
        for run in dropped:
            del self.saved_ranks[run]
            self._ranks_due.pop(run, None)
            chunks += [_ranks_chunk_part(run, n) for n in range(self.rank_chunks.pop(run, 0))]
        spent = [time.perf_counter() - t0]
        writes.append((STATE, blob))
        self._queue(self._save_steps(windows, writes, (sorted(gone), dropped, chunks), spent))
        self._write_ranks_soon()

    def _save_steps(
        self,
        windows: list[tuple[WindowKey, WindowRecord]],
        writes: list[tuple[str, bytes]],
        deletes: tuple[list[WindowKey], list[str], list[str]],
        spent: list[float],
    ) -> Steps[None]:
        """Pickle ``windows`` (snapshots) in steps, then queue every write of the save: the
        windows first, so that a stored record never names a window not stored yet."""
        parts = []
        for key, snap in windows:
            parted = yield from _timed(window_pieces.pickle_steps(snap, _dumps), spent)
            t0 = time.perf_counter()
            parts.append((_window_part(key), _dumps({"version": VERSION, "window": parted})))
            spent[0] += time.perf_counter() - t0
        size = sum(len(b) for _, b in [*parts, *writes])
        self.stats.update(bytes=size, seconds=spent[0], at=time.time())
        self._writer.submit(self._write, [*parts, *writes], *deletes)

    def loaded(self, runs: list[Run]) -> None:
        """The runs ``load_runs`` put back are stored: their settled windows are not written
        again."""
        self.window_parts = {(r.name, i) for r in runs for i in r.state.windows}
        self.saved_windows = {
            (r.name, i) for r in runs for i, w in r.state.windows.items() if settled(w)
        }

    def save_progress(self, progress: dict[str, Any]) -> None:
        """Queue a write of the step counters only."""
        try:
            blob = _dumps({"version": VERSION, **progress})
        except Exception as exc:
            self._failed(exc)
            return
        self._writer.submit(self._write, [(PROGRESS, blob)], [])

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every queued write is done (tests, and a clean shutdown)."""
        self._saves_now()
        self._write_ranks_now()
        self._writer.submit(lambda: None).result(timeout=timeout_s)

    def _queue(self, save: Steps[None]) -> None:
        """Run ``save``'s steps: its first now (a small run's save has no other), the rest in
        later turns of the event loop after the saves queued before it (at once without a
        loop)."""
        if not self._saves:
            try:
                next(save)
            except StopIteration:
                return
            except Exception as exc:
                self._failed(exc)
                return
        self._saves.append(save)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._saves_now()
            return
        if self._saves_task is None or self._saves_task.done():
            self._saves_task = loop.create_task(self._run_saves())

    async def _run_saves(self) -> None:
        while self._saves:
            save = self._saves[0]
            try:  # (a flush meanwhile may finish it: its steps then end at once)
                await run_steps_yielding(save)
            except Exception as exc:
                self._failed(exc)
            if self._saves and self._saves[0] is save:
                self._saves.popleft()

    def _saves_now(self) -> None:
        while self._saves:
            try:
                run_steps(self._saves[0])
            except Exception as exc:
                self._failed(exc)
            self._saves.popleft()

    def _write_ranks_soon(self) -> None:
        """The rank records of the runs whose records changed, ``RANK_CHUNK`` records per turn
        of the event loop (10,000 of them took 12 ms of one turn), or at once without a loop."""
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
            await run_steps_yielding(self._ranks_steps(next(iter(self._ranks_due))))

    def _write_ranks_now(self) -> None:
        while self._ranks_due:
            run_steps(self._ranks_steps(next(iter(self._ranks_due))))

    def _ranks_steps(self, run: str) -> Steps[None]:
        """Pickle ``run``'s rank records in chunks, one per step, then queue their writes:
        the chunks, then the index that names how many there are."""
        due = self._ranks_due.get(run)
        if due is None:
            return
        st, version = due
        keys, writes = list(st.ranks), []
        for n, i in enumerate(range(0, len(keys), RANK_CHUNK)):
            chunk = {k: st.ranks[k] for k in keys[i : i + RANK_CHUNK] if k in st.ranks}
            blob = _dumps({"version": VERSION, "ranks": chunk})
            writes.append((_ranks_chunk_part(run, n), blob))
            yield
        if self._ranks_due.get(run, (None, None))[1] == version:  # (not changed since)
            del self._ranks_due[run]
        count, before = len(writes), self.rank_chunks.get(run, 0)
        writes.append((_ranks_part(run), _dumps({"version": VERSION, "chunks": count})))
        self.rank_chunks[run] = count
        stale = [_ranks_chunk_part(run, n) for n in range(count, before)]
        self._writer.submit(self._write, writes, [], (), stale)

    def _snapshot(
        self, runs: list[Run]
    ) -> tuple[list[tuple[str, bytes]], list[tuple[Run, list[int]]], list[Any]]:
        """The writes to make now, the runs' record, and the windows to pickle in steps
        (snapshots): those that can still change, and those settled since the last save."""
        writes: list[tuple[str, bytes]] = []
        snapshot, windows = [], []
        for run in runs:
            snapshot.append((without_windows(run), list(run.state.windows)))
            st = run.state
            was = self.saved_ranks.get(run.name, (-1, -1))
            # (an SPMD rank joining its trainer changes the trainer's part as a registration does)
            now = (st.ranks_version, st.counters["registrations"] + st.counters["rank_attaches"])
            if was[0] != now[0]:  # (in later turns, unless a trainer registered: see below)
                self._ranks_due[run.name] = (st, st.ranks_version)
            if was[1] != now[1]:  # its rank records go with it, now: they must match on a load
                run_steps(self._ranks_steps(run.name))
                trainers = {"version": VERSION, "trainers": st.trainers}
                writes.append((_trainers_part(run.name), _dumps(trainers)))
            self.saved_ranks[run.name] = now
            for i, rec in st.windows.items():
                key = (run.name, i)
                if key in self.saved_windows:
                    continue
                if settled(rec):
                    self.saved_windows.add(key)
                windows.append((key, window_pieces.snapshot(rec)))
        return writes, snapshot, windows

    def _write(
        self,
        writes: list[tuple[str, bytes]],
        gone: list[WindowKey],
        dropped: Sequence[str] = (),
        parts_gone: Sequence[str] = (),
    ) -> None:
        try:
            for part, blob in writes:
                _put(self.namespace, self.name, part, blob)
            for key in gone:
                _delete(self.namespace, self.name, _window_part(key))
            for run in dropped:
                _delete(self.namespace, self.name, _ranks_part(run))
                _delete(self.namespace, self.name, _trainers_part(run))
            for part in parts_gone:
                _delete(self.namespace, self.name, part)
            self.stats["error"] = None
        except Exception as exc:
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        self.stats["error"] = f"{type(exc).__name__}: {exc}"[:500]
        log.warning("checkpoint failed: %s", self.stats["error"])


def load_runs(namespace: str, name: str) -> tuple[list[Run], dict[str, Any]] | None:
    """The runs of the last checkpoint (current first) with their settled windows put back,
    and the rest of what was saved; None without a checkpoint."""
    saved = load(namespace, name)
    if saved is None:
        return None
    runs = []
    for light, indices in saved.pop("runs"):
        ranks = _load_ranks(namespace, name, light.name)
        trainers = load(namespace, name, _trainers_part(light.name))
        if ranks is not None and trainers is not None:
            light.state.ranks, light.state.trainers = ranks["ranks"], trainers["trainers"]
        for i in indices:
            part = load(namespace, name, _window_part((light.name, i)))
            if part is not None:
                light.state.windows[i] = window_pieces.restore(part["window"])
        light.state.windows = collections.OrderedDict(sorted(light.state.windows.items()))
        runs.append(light)
    return runs, saved


def _load_ranks(namespace: str, name: str, run: str) -> dict[str, Any] | None:
    """A run's rank records: its chunks put together (or one part, as written before), or
    None if any is missing."""
    index = load(namespace, name, _ranks_part(run))
    if index is None or "chunks" not in index:
        return index
    ranks: dict[Any, Any] = {}
    for n in range(int(index["chunks"])):
        chunk = load(namespace, name, _ranks_chunk_part(run, n))
        if chunk is None:
            return None
        ranks.update(chunk["ranks"])
    return {"ranks": ranks}


def load_window(namespace: str, name: str, key: WindowKey) -> WindowRecord | None:
    """One settled window as stored, or None."""
    part = load(namespace, name, _window_part(key))
    return None if part is None else window_pieces.restore(part["window"])
