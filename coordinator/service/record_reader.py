"""A run's record read back (``coordinator.core.record_codec``): the run the coordinator
kept, rebuilt: its windows with their aggregates, its phase log, its stalls. The one reader of
the coordinator's one store, whatever its back end: the CLI's ``--from`` and a new cluster
going on with a lost one's run read ``save_path`` with it (no Ray), and a coordinator Ray
restarted reads its state in Ray's key-value store with it, where a run's live parts
(``state_codec``: plan, ranks, trainers) make the run whole again.
"""

from __future__ import annotations

import collections
import copy
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from coordinator.core import record_codec as codec
from coordinator.core import state_codec as sc
from coordinator.core import storage
from coordinator.core.config import ProfilerConfig
from coordinator.core.memory_record import MemoryFile
from coordinator.core.phases import PhaseLog
from coordinator.core.records import TrainerRecord
from coordinator.core.run import Run, new_run
from coordinator.core.schedule import Schedule
from coordinator.core.state import CoordinatorState
from coordinator.core.window_plan import WindowPlan
from coordinator.protocol.stack_replies import StallEntry
from coordinator.service.record_store import RECORD_DIR, SAVE_PATH_ENV, RecordStore

log = logging.getLogger(__name__)


@dataclass
class Recorded:
    """A record read back: the run rebuilt, its phase log and stalls, what could not be read."""

    url: str
    file: codec.RunFile
    run: Run
    phases: PhaseLog
    stalls: list[StallEntry]
    problems: list[str] = field(default_factory=list)
    last_chunk: list[codec.PhaseRecord] = field(default_factory=list)
    """The records of the last phase chunk (a restored run's record goes on filling it)."""
    memory: MemoryFile | None = None
    """Every rank's memory over the run (None: not recorded, or unreadable: ``memory_error``)."""
    memory_error: str | None = None


def locate(spec: str, save_path: str | None = None, names_only: bool = False) -> str:
    """The record directory ``spec`` names: a record directory, a run's directory (its
    ``record/``), or a run's name under ``save_path`` (else ``$RAY_PROFILER_SAVE_PATH``);
    ``names_only``: a run's name only (the web view reads no path it is given). ValueError
    saying where it looked."""
    tried = []
    paths = (spec, storage.join(spec, RECORD_DIR) if _one_name(spec) is None else None)
    for url in () if names_only else paths:
        if url and RecordStore(url).exists("run.msgpack"):
            return url
        if url:
            tried.append(url)
    base = save_path or os.environ.get(SAVE_PATH_ENV)
    if base and (_one_name(spec) or names_only):
        url = storage.join(base, spec, RECORD_DIR)
        if RecordStore(url).exists("run.msgpack"):
            return url
        tried.append(url)
    hint = "" if base else f" (a run's name alone needs a save_path: ${SAVE_PATH_ENV})"
    raise ValueError(f"no run record at {' or '.join(tried) or spec!r}{hint}")


def _one_name(spec: str) -> str | None:
    """``spec`` when it is a plain run name (no path, no URL), else None."""
    plain = spec and "/" not in spec and "\\" not in spec and spec not in (".", "..")
    return spec if plain and not os.path.exists(spec) else None


MEMORY_FILE = "memory.msgpack"
MAX_PROBLEMS = 20
"""Problems listed one by one; the rest are counted in one line."""


class Source(Protocol):
    """What the reader reads: a ``RecordStore`` (local or fsspec) or a ``KVStore``."""

    url: str
    options: dict[str, Any]

    def get(self, rel: str, limit: int) -> bytes | None: ...
    def exists(self, rel: str) -> bool: ...
    def names(self, sub: str) -> list[str]: ...


def open_record(
    url: str | Source, storage_options: dict[str, Any] | None = None, live: bool = False
) -> Recorded:
    """Read the record at ``url`` (see ``locate``; or a store); ValueError for one that cannot
    be read. A window or chunk file that cannot be read is left out and named in ``problems``.
    ``live``: the store is Ray's key-value store, where the run's live parts are
    (``state.msgpack``): the run is rebuilt from them whole, its plan, counters, every window it
    kept, ranks and trainers. They are read from there only: a record in ``save_path`` is data
    anyone who can write there made, and the trainers' actors are looked up in Ray's table.

    The run's file is not trusted for how many files to look for: each directory is listed
    once, only the files it names that are there are read, and those it names that are not
    are said in one problem per directory (a run file claiming a million windows costs one
    listing, not a million look-ups)."""
    store = RecordStore(url, storage_options) if isinstance(url, str) else url
    head = _read(store, "run.msgpack")
    if head is None:
        raise ValueError(f"no run record at {store.url} (no run.msgpack)")
    if not isinstance(head, codec.RunFile):
        raise ValueError(f"{store.url}/run.msgpack: a {type(head).__name__}, not the run's file")
    problems: list[str] = []
    parts = (
        _part(store, "state.msgpack", sc.RunState, problems)
        if live and store.exists("state.msgpack")
        else None
    )
    run = _run(head, problems if parts is None else [])
    if parts is not None:  # (Ray's key-value store: the run made whole again)
        sc.apply_state(run, parts)
        _live_parts(store, run, parts.rank_chunks, problems)
    for index in _present(store, "windows", parts.windows if parts else head.windows, problems):
        w = _part(store, f"windows/{index:06d}.msgpack", codec.WindowFile, problems)
        if w is not None:
            run.state.windows[index] = codec.window_record(w)
    marked = _present(store, "marks", list(run.state.windows), [])  # (of the windows read)
    for index in marked:
        m = _part(store, f"marks/{index:06d}.msgpack", codec.MarksFile, problems)
        rec = run.state.windows.get(m.window) if m is not None else None
        if m is not None and rec is not None:
            rec.marks, rec.counted_slower = m.marks, m.counted_slower
    phases, last_chunk = PhaseLog(), []
    for n in _present(store, "phases", range(head.phase_chunks), problems):
        chunk = _part(store, f"phases/{n:06d}.msgpack", codec.PhaseChunk, problems)
        if chunk is not None:
            phases.add(chunk.records)
            last_chunk = chunk.records
            if chunk.lost:
                problems.append(f"phases/{n:06d}: {chunk.lost} steps were never recorded")
    stalls = []
    for index in _present(store, "stalls", head.stalls, problems):
        s = _part(store, f"stalls/{index:06d}.msgpack", codec.StallFile, problems)
        if s is not None:
            stalls.append(s.stall)
    memory, memory_error = read_memory(store)
    problems += [memory_error] if memory_error else []
    return Recorded(
        store.url, head, run, phases, stalls, _bounded(problems), last_chunk, memory, memory_error
    )


def read_memory(store: Source) -> tuple[MemoryFile | None, str | None]:
    """The record's memory (None when it holds none: older records), or why it cannot be
    read."""
    if not store.exists(MEMORY_FILE):
        return None, None
    problems: list[str] = []
    got = _part(store, MEMORY_FILE, MemoryFile, problems)
    return got, problems[0] if problems else None


def _present(store: Source, sub: str, named: Iterable[int], problems: list[str]) -> list[int]:
    """The numbers of ``named`` whose file ``sub/NNNNNN.msgpack`` is there (one listing);
    those that are not, said in one problem."""
    there = set()
    for name in store.names(sub):
        stem, dot, ext = name.partition(".")
        if dot and ext == "msgpack" and stem.isdigit():
            there.add(int(stem))
    found: list[int] = []
    gone: list[int] = []
    count = 0
    for n in named:  # (a range, or the run file's list: at most one pass, nothing kept of it
        if n in there:  # but the files that are there and the first few that are not)
            found.append(n)
        else:
            count += 1
            if len(gone) < 5:
                gone.append(n)
    if count:
        more = f" and {count - len(gone)} more" if count > len(gone) else ""
        listed = ", ".join(f"{n:06d}" for n in gone)
        problems.append(f"{store.url}/{sub}: run.msgpack names {listed}{more}, not there")
    return found


def _bounded(problems: list[str]) -> list[str]:
    if len(problems) <= MAX_PROBLEMS:
        return problems
    return [*problems[:MAX_PROBLEMS], f"... and {len(problems) - MAX_PROBLEMS} more problems"]


def _live_parts(store: Source, run: Run, chunks: int, problems: list[str]) -> None:
    """A run's rank records and trainers (with their actor handles) from Ray's key-value
    store; both or neither (they must match)."""
    ranks = {}
    for n in range(chunks):
        chunk = _part(store, f"ranks/{n:06d}.msgpack", sc.RanksChunk, problems)
        if chunk is None:
            return
        ranks.update({(f.trainer_id, f.rank): sc.rank_record(f) for f in chunk.ranks})
    trainers: dict[str, TrainerRecord] = {}
    lost: dict[tuple[str, int], str] = {}
    if store.exists("trainers.msgpack"):
        got = _part(store, "trainers.msgpack", sc.TrainersFile, problems)
        if got is None:
            return
        trainers, lost = _trainers(got, problems)
    run.state.ranks, run.state.trainers = ranks, trainers
    for key, message in lost.items():
        if key in ranks:  # (no call goes to a rank that is not ``ok``: it has no handle)
            run.state.rank_failed(key, "lost", {"where": "coordinator", "type": "LookupError",
                                                "message": message})  # fmt: skip


def _trainers(
    got: sc.TrainersFile, problems: list[str]
) -> tuple[dict[str, TrainerRecord], dict[tuple[str, int], str]]:
    """The trainers, each rank's actor looked up in Ray's actor table by its stored id; the
    ranks whose actor is not found alive, with why (also said in ``problems``)."""
    from coordinator.raylink.handles import load_handles

    found, why = load_handles(i for t in got.trainers for i in t.handles.values())
    lost: dict[tuple[str, int], str] = {}
    for t in got.trainers:
        for rank, ident in t.handles.items():
            if ident not in found:
                lost[(t.trainer_id, rank)] = message = (
                    f"its actor {ident[:40]} was not found again: {why.get(ident, '?')}"
                )
                problems.append(f"trainers.msgpack: rank {rank} of {t.trainer_id!r}: {message}")
    return {t.trainer_id: sc.trainer_record(t, found) for t in got.trainers}, lost


def _read(store: Source, rel: str) -> codec.RecordFile | None:
    blob = store.get(rel, codec.MAX_FILE_BYTES)
    return None if blob is None else codec.decode(blob, f"{store.url}/{rel}")


def _part(store: Source, rel: str, kind: type[Any], problems: list[str]) -> Any:
    """File ``rel`` of type ``kind``, or None with why in ``problems``."""
    try:
        got = _read(store, rel)
    except (ValueError, OSError) as exc:
        problems.append(str(exc))
        return None
    if got is None:
        problems.append(f"{store.url}/{rel}: missing")
    elif not isinstance(got, kind):
        problems.append(f"{store.url}/{rel}: a {type(got).__name__}, not a {kind.__name__}")
        got = None
    return got


def recorded_config(config: dict[str, Any], problems: list[str]) -> ProfilerConfig:
    """The config a record holds. Each field this version refuses (unknown, or of a value it
    no longer takes) is left out and named in ``problems``, the rest read as recorded; never
    the defaults in silence (a recorded straggler threshold of 3.0 must not become the default
    1.25 unnoticed)."""
    left_out: list[str] = []
    mapping: Any = copy.deepcopy(config)
    for _ in range(MAX_PROBLEMS):
        try:
            cfg = ProfilerConfig.from_dict(mapping, check_paths=False)
        except (ValueError, TypeError) as exc:
            field_ = _field_named(str(exc))
            if field_ is None or not _drop(mapping, field_):
                left_out.append(f"all of it ({str(exc)[:200]}): the defaults stand in")
                cfg = ProfilerConfig()
                break
            left_out.append(f"{field_} ({str(exc)[:120]})")
            continue
        break
    else:
        left_out.append("all of it (too many fields refused): the defaults stand in")
        cfg = ProfilerConfig()
    if left_out:
        problems.append(
            "run.msgpack: this version reads its config without "
            + "; ".join(left_out)[:600]
            + " (each window keeps its own straggler threshold)"
        )
    return cfg


def _field_named(message: str) -> str | None:
    """The field a config error names (``'wait' must be``, ``unknown key 'a.b'``)."""
    found = re.search(r"'([A-Za-z_][\w.]*)'", message)
    return found.group(1) if found else None


def _drop(mapping: Any, dotted: str) -> bool:
    """Remove ``a.b`` from nested dicts; whether it was there."""
    *parents, last = dotted.split(".")
    for name in parents:
        mapping = mapping.get(name) if isinstance(mapping, dict) else None
    if not isinstance(mapping, dict) or last not in mapping:
        return False
    del mapping[last]
    return True


def _run(head: codec.RunFile, problems: list[str]) -> Run:
    """The run a record's run file describes, without its windows yet."""
    config = recorded_config(head.config, problems)
    st = CoordinatorState(2**31, 2**31, config.straggler_threshold)
    st.global_step, st.stepping_trainer = head.global_step, head.stepping_trainer
    st.counters = collections.Counter(head.counters)
    for t in head.trainers:
        st.trainers[t.trainer_id] = TrainerRecord(t.trainer_id, t.role, t.ranks, {}, t.run_dir)
    run = Run(head.name, config, head.run_dir, WindowPlan(Schedule(config)), st)
    run.lifecycle = head.lifecycle  # type: ignore[assignment]
    run.created_at, run.started_at = head.created_at, head.started_at
    run.ended_at, run.ended_reason, run.baseline = head.ended_at, head.ended_reason, head.baseline
    return run


# ------------------------------------------------------------------ a run restored


GOING = ("configured", "running")
"""A recorded run in one of these did not end: its cluster went (or its GCS lost the
coordinator's checkpoint) while it ran."""


def new_or_recorded(
    cfg: ProfilerConfig, taken: set[str], now: float | None = None
) -> tuple[Run, Recorded | None]:
    """A fresh run for ``cfg`` (``new_run``), and the record of a run that used its name and
    directory and did not end (to continue it), or None. A recorded run that ended keeps its
    directory: the fresh run takes the next free name (``job.2``) instead. Blocking I/O; a
    record that cannot be looked for is logged, never raised (the run starts fresh)."""
    try:
        return _new_or_recorded(cfg, taken, now)
    except Exception:
        log.exception("the run's record in %s could not be looked for", cfg.save_path)
        return new_run(cfg, taken, now), None


def _new_or_recorded(
    cfg: ProfilerConfig, taken: set[str], now: float | None
) -> tuple[Run, Recorded | None]:
    from coordinator.service.record_store import record_url

    taken = set(taken)
    for _ in range(1000):
        run = new_run(cfg, taken, now)
        if not run.run_dir or not cfg.record:
            return run, None
        url = record_url(run.run_dir)
        try:
            if not RecordStore(url, cfg.storage_options).exists("run.msgpack"):
                return run, None
            found = open_record(url, cfg.storage_options)
        except (ValueError, OSError) as exc:  # unreadable: never written over
            log.warning("the run record at %s cannot be read (%s): not reusing its name", url, exc)
            taken.add(run.name)
            continue
        if found.file.lifecycle in GOING:
            return run, found
        taken.add(run.name)
    raise ValueError(f"no free run name for {cfg.run_name!r}: 1000 taken in {cfg.save_path}")


def adopt(run: Run, rec: Recorded) -> None:
    """Continue the fresh ``run`` as the recorded one: its windows (the last ``max_windows``,
    per-rank values in the last ``detail_windows``), baseline, counters, global step and window
    numbering; counted in ``record_restores``."""
    st, old = run.state, rec.run.state
    kept = sorted(old.windows.items())[-st.max_windows :]
    st.windows = collections.OrderedDict(kept)
    for _, w in kept[: max(0, len(kept) - st.detail_windows)]:
        for agg in w.aggregates.values():
            agg.drop_detail()
    st.counters = collections.Counter(old.counters)
    st.counters["record_restores"] += 1
    st.global_step = old.global_step
    run.baseline = rec.run.baseline
    run.created_at, run.started_at = rec.run.created_at, rec.run.started_at
    run.plan.next_index = max(rec.file.next_window, max(old.windows, default=-1) + 1)
    run.plan.skipped_windows = rec.file.skipped_windows
    log.warning(
        "run %s continued from its record at %s: %d windows, global step %s",
        run.name, rec.url, len(st.windows), st.global_step,
    )  # fmt: skip
