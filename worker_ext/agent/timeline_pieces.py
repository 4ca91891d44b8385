"""A node agent's pieces of merged window traces: its node's ranks merged into one file
(``timeline_file.write_piece``), kept until the caller has read it (``read``) and let it go
(``drop``), or ``KEEP_S`` has passed (a caller that timed out: ``sweep``, which the agent runs
now and then, not only when it merges again). An agent that leaves drops its pieces
(``drop_all``); one killed outright leaves directories that the next agent of the node removes
once they are ``KEEP_S`` old (``sweep_left``)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid

from coordinator.protocol.timeline import PieceRank, TimelinePiece
from worker_ext.agent.timeline_file import write_piece

KEEP_S = 600.0
"""A piece nobody dropped is removed this long after it was made."""
PREFIX = "ray-profiler-timeline-"
MAX_CHUNK = 8 << 20


class PieceStore:
    """The pieces this agent made, by name; each in a directory of its own."""

    def __init__(self) -> None:
        self._pieces: dict[str, tuple[str, float]] = {}  # name -> (its directory, made at)

    def make(
        self, ranks: list[PieceRank], min_us: float, max_events: int, is_trace: object
    ) -> TimelinePiece:
        """Merge ``ranks`` (trace files of this node: ``is_trace(path)`` must hold for each)
        into a new piece; a rank whose trace cannot be read is named in ``failed``."""
        bad = [r.get("path") for r in ranks if not callable(is_trace) or not is_trace(r["path"])]
        if bad:
            raise ValueError(f"not trace files of a profiling window on this node: {bad[:3]}")
        self.sweep()
        name = uuid.uuid4().hex
        where = tempfile.mkdtemp(prefix=PREFIX)
        self._pieces[name] = (where, time.monotonic())
        try:
            piece = write_piece(
                ranks, os.path.join(where, "piece.json.gz"), min_us=min_us,
                max_events=max_events, strict=False,
            )  # fmt: skip
        except BaseException:
            self.drop(name)
            raise
        piece["piece"] = name
        return piece

    def read(self, name: str, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes of piece ``name`` from ``offset`` (b"" at its end)."""
        if name not in self._pieces:
            raise ValueError(
                f"no piece {str(name)[:40]!r} here (dropped, or older than {KEEP_S:g} s)"
            )
        if not isinstance(offset, int) or not isinstance(size, int) or offset < 0 or size < 1:
            raise ValueError("offset must be an int >= 0 and size an int >= 1")
        with open(os.path.join(self._pieces[name][0], "piece.json.gz"), "rb") as f:
            f.seek(offset)
            return f.read(min(size, MAX_CHUNK))

    def drop(self, name: str) -> bool:
        """Remove piece ``name``; whether it was here."""
        entry = self._pieces.pop(name, None)
        if entry is not None:
            shutil.rmtree(entry[0], ignore_errors=True)
        return entry is not None

    def sweep(self) -> None:
        """Remove the pieces made over ``KEEP_S`` ago."""
        now = time.monotonic()
        for name in [n for n, (_, made) in self._pieces.items() if now - made > KEEP_S]:
            self.drop(name)

    def drop_all(self) -> None:
        for name in list(self._pieces):
            self.drop(name)


def sweep_left(folder: str | None = None, now: float | None = None) -> list[str]:
    """Remove this user's piece directories in ``folder`` (the temp directory) last changed
    over ``KEEP_S`` ago: left by an agent killed outright (a live agent has swept its own by
    then); the names removed. Never raises, never follows a link."""
    folder = folder or tempfile.gettempdir()
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
            if not (entry.name.startswith(PREFIX) and entry.is_dir(follow_symlinks=False)):
                continue
            if st.st_uid == os.getuid() and now - st.st_mtime > KEEP_S:
                shutil.rmtree(entry.path)
                removed.append(entry.name)
        except OSError:
            continue
    return removed
