"""Merged window traces on disk: ranks' traces read one at a time and written as one Chrome trace
(a piece: one node's ranks, made by its agent, or every rank, made by the caller), and pieces
joined into one file. What goes into them is ``coordinator.core.timeline``'s; memory is one
rank's trace, or one piece, whatever the window's size."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
from collections.abc import Callable, Iterator
from typing import IO, Any

import msgspec

from coordinator.core.storage import filesystem
from coordinator.core.timeline import origin_us, rank_process, step_spread
from coordinator.protocol.timeline import PieceRank, RankCount, TimelinePiece

Opener = Callable[[str], IO[bytes]]
"""Opens a trace by its path for reading (raising OSError or ValueError when it will not)."""

_CHUNK = 2_000


def write_piece(
    ranks: list[PieceRank],
    out: str,
    *,
    min_us: float,
    max_events: int,
    storage_options: dict[str, Any] | None = None,
    strict: bool = True,
    opener: Opener | None = None,
) -> TimelinePiece:
    """Merge ``ranks``' traces (local paths or URLs, ``.gz`` or not) into ``out``, each as
    process ``pid``, read one at a time. ``strict``: a trace that cannot be read raises
    ValueError; else it is named in ``failed`` and the others are merged. ``opener``: opens
    each trace (the caller's checks on the open file: a record's traces), else fsspec."""
    if min_us < 0 or max_events < 1:
        raise ValueError(f"min_us must be >= 0 and max_events >= 1 (got {min_us}, {max_events})")
    piece = TimelinePiece(piece="", path=out, bytes=0, events=0, origin=0.0, ranks=[], starts=[],
                          failed={})  # fmt: skip
    origin: float | None = None
    with open_out(out, storage_options) as f:
        f.write(b'{"traceEvents":[')
        for r in ranks:
            try:
                trace = load_trace(r["path"], storage_options, opener)
            except (OSError, ValueError) as exc:
                if strict:
                    raise
                piece["failed"][r["pid"]] = f"cannot read {r['path']}: {exc}"
                continue
            if origin is None:
                origin = origin_us(trace)
            merged, count, steps = rank_process(
                trace, r["label"], pid=r["pid"], origin=origin, min_us=min_us,
                max_events=max_events, offset_us=r.get("clock_offset_us", 0.0),
            )  # fmt: skip
            del trace
            _write_events(f, merged, first=piece["events"] == 0)
            piece["events"] += len(merged)
            piece["ranks"].append(count)
            piece["starts"].append(steps)
        piece["origin"] = origin or 0.0
        f.write(b"]," + _tail(piece["ranks"], piece["starts"], min_us, max_events, piece["origin"]))
    piece["bytes"] = file_size(out, storage_options)
    return piece


def join_pieces(
    pieces: list[TimelinePiece],
    out: str,
    *,
    min_us: float,
    max_events: int,
    storage_options: dict[str, Any] | None = None,
) -> tuple[int, int, dict[int, float]]:
    """Join pieces (each a local file) into ``out``, on the earliest piece's clock: the bytes
    and events written, and each step's start spread over every rank. One piece is copied."""
    if len(pieces) == 1 and pieces[0]["path"].endswith(".gz") == out.endswith(".gz"):
        (piece,) = pieces
        fs, p = filesystem(out, storage_options or {})
        with open(piece["path"], "rb") as fin, fs.open(p, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
        spread = step_spread(piece["starts"])
        return file_size(out, storage_options), piece["events"], spread
    origin = min(p["origin"] for p in pieces)
    counts: list[RankCount] = []
    starts: list[dict[int, float]] = []
    events = 0
    with open_out(out, storage_options) as f:
        f.write(b'{"traceEvents":[')
        for piece in pieces:
            delta = piece["origin"] - origin  # whole seconds: exact
            merged = load_trace(piece["path"], None)["traceEvents"]
            for e in merged:
                if e.get("ph") != "M" and isinstance(e.get("ts"), int | float):
                    e["ts"] = round(e["ts"] + delta, 3)
            _write_events(f, merged, first=events == 0)
            events += len(merged)
            counts += piece["ranks"]
            starts += [{k: round(v + delta, 3) for k, v in s.items()} for s in piece["starts"]]
        f.write(b"]," + _tail(counts, starts, min_us, max_events, origin))
    return file_size(out, storage_options), events, step_spread(starts)


def load_trace(
    path: str, options: dict[str, Any] | None, opener: Opener | None = None
) -> dict[str, Any]:
    """A Chrome trace file (local or URL, ``.gz`` or not; opened by ``opener`` when given),
    decoded; ValueError when it is not a JSON object."""
    if opener is not None:
        raw: IO[bytes] = opener(path)
    else:
        fs, p = filesystem(path, options or {})
        raw = fs.open(p, "rb")
    with raw:
        data = raw.read()
    if path.endswith(".gz"):
        data = gzip.decompress(data)
    try:
        trace = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(trace, dict):
        raise ValueError(f"{path} is not a Chrome trace (a JSON object)")
    return trace


@contextlib.contextmanager
def open_out(out: str, options: dict[str, Any] | None) -> Iterator[IO[bytes] | gzip.GzipFile]:
    """``out`` opened for writing (gzipped when it ends in ``.gz``), its directory made."""
    fs, p = filesystem(out, options or {})
    parent = os.path.dirname(p)
    if parent:
        with contextlib.suppress(Exception):
            fs.makedirs(parent, exist_ok=True)
    with fs.open(p, "wb") as raw:
        if out.endswith(".gz"):
            with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6) as gz:
                yield gz
        else:
            yield raw


def file_size(out: str, options: dict[str, Any] | None) -> int:
    fs, p = filesystem(out, options or {})
    try:
        return int(fs.size(p))
    except Exception:
        return -1


def _write_events(f: IO[bytes] | gzip.GzipFile, events: list[Any], first: bool) -> None:
    for i in range(0, len(events), _CHUNK):
        chunk = msgspec.json.encode(events[i : i + _CHUNK])[1:-1]
        f.write(chunk if first and i == 0 else b"," + chunk)


def _tail(
    counts: list[RankCount],
    starts: list[dict[int, float]],
    min_us: float,
    max_events: int,
    origin: float,
) -> bytes:
    """The merged file's keys after its events: its clock, and what it holds of each rank."""
    about = {
        "ranks": counts,
        "min_us": min_us,
        "max_events_per_rank": max_events,
        "step_start_spread_us": {str(k): v for k, v in step_spread(starts).items()},
        "clock": "each rank's wall clock (Kineto's ts + baseTimeNanoseconds); ranks on two "
        "nodes agree as well as the nodes' clocks do",
    }
    tail = {"displayTimeUnit": "ms", "baseTimeNanoseconds": int(origin * 1000),
            "rayProfiler": about}  # fmt: skip
    return json.dumps(tail)[1:].encode()
