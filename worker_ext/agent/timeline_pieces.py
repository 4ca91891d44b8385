"""A node agent's pieces of merged window traces: its node's ranks merged into one file
(``timeline_file.write_piece``), kept until the caller has read it (``read``) and let it go
(``drop``), or ``KEEP_S`` has passed."""

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
        where = tempfile.mkdtemp(prefix="ray-profiler-timeline-")
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
