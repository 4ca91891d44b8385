"""An attached rank 0's last steps, kept where its node agent reads them after the process is gone.

An attached process has no end of loop: it is killed (``ray.kill``, the job's end) with up to
0.1 s of steps not yet reported, and nothing in it runs at that moment (no ``atexit``, and a
Ray call from a dying worker never arrives). So rank 0 keeps its step in a small file of the
node's private folder (``node_dir("steps")/<pid>.step``), mapped into its memory: a step is two
stores into the mapped page (about 1 us), no system call. The page is the file's, so what was
stored is there when the process dies, however it dies, and the node agent reads it then
(``read_tail``) and reports the steps since the last report to the coordinator.

Layout (little-endian): ``MAGIC``; the last step; the last step sent in a report; the slot
count; one wall time per slot (step ``k`` at slot ``k % slots``, NaN: none); then the owner as
JSON (its length first), written once. A step of -1 is none.

>>> import os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "1.step")
>>> tail = StepTail.create(path, {"pid": 1}, slots=4)
>>> for k in (1, 2, 3):
...     tail.step(k, 0.5)
>>> tail.sent(1)
>>> tail.step(4, 0.25)
>>> got = read_tail(path)
>>> got.last_step, got.sent_step, got.unreported(), got.owner
(4, 1, (2, [0.5, 0.5, 0.25]), {'pid': 1})
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.protocol.atomic_file import write_atomic
from coordinator.protocol.node_dir import node_dir
from coordinator.protocol.node_files import open_own

MAGIC = b"RPSTEP1\0"
SLOTS = 256
"""Steps whose wall times are kept; rank 0 reports every 0.1 s, so more than enough unless its
steps take under 0.4 ms (the older ones' wall times are then not sent; the step still is)."""
_HEAD = struct.Struct("<8sqqq")
_STEP = struct.Struct("<q")
_WALL = struct.Struct("<d")
_LAST, _SENT = 8, 16
MAX_OWNER = 64 << 10


def steps_dir() -> Path:
    """This node's folder of step files (made private, as every folder of ``node_dir``)."""
    return node_dir("steps", what="the step files' folder")


class StepTail:
    """The writer: rank 0's mapped step file (see the module docstring)."""

    def __init__(self, path: str, mapped: mmap.mmap, slots: int) -> None:
        self.path, self._map, self._slots = path, mapped, slots

    @classmethod
    def create(cls, path: str | Path, owner: dict[str, Any], slots: int = SLOTS) -> StepTail:
        """A new step file at ``path`` (whole: ``write_atomic``), mapped for writing."""
        blob = json.dumps(owner).encode()
        if len(blob) > MAX_OWNER:
            raise ValueError(f"the step file's owner is {len(blob)} bytes, over {MAX_OWNER}")
        walls = _WALL.pack(math.nan) * slots
        head = _HEAD.pack(MAGIC, -1, -1, slots)
        write_atomic(path, head + walls + struct.pack("<I", len(blob)) + blob)
        fd = open_own(path, os.O_RDWR)
        try:
            mapped = mmap.mmap(fd, _HEAD.size + _WALL.size * slots)
        finally:
            os.close(fd)  # (the map keeps the file)
        return cls(os.fspath(path), mapped, slots)

    def step(self, step: int, wall: float | None) -> None:
        """Step ``step`` finished in ``wall`` seconds (None: not timed). The hot path."""
        at = _HEAD.size + 8 * (step % self._slots)
        _WALL.pack_into(self._map, at, math.nan if wall is None else wall)
        _STEP.pack_into(self._map, _LAST, step)

    def sent(self, step: int) -> None:
        """The report of ``step`` (and every step before it) was sent."""
        _STEP.pack_into(self._map, _SENT, step)

    def close(self, remove: bool = True) -> None:
        """Unmap; ``remove``: the file too (the process reports its end itself)."""
        self._map.close()
        if remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


@dataclass(frozen=True)
class TailRead:
    """What a step file holds."""

    last_step: int
    sent_step: int
    walls: list[float]  # by slot
    owner: dict[str, Any]

    def unreported(self) -> tuple[int, list[float]] | None:
        """The steps after the last report that have wall times: ``(first step, walls)``,
        the newest run of them without a gap; None when none."""
        if self.last_step < 0 or self.last_step <= self.sent_step:
            return None
        first = max(self.sent_step + 1, self.last_step - len(self.walls) + 1, 0)
        out: list[float] = []
        for k in range(self.last_step, first - 1, -1):
            wall = self.walls[k % len(self.walls)]
            if math.isnan(wall):
                break
            out.append(wall)
        return (self.last_step - len(out) + 1, out[::-1]) if out else None


def read_tail(path: str | Path) -> TailRead:
    """Read a step file (never through a link, only this user's). Raises ValueError for a
    file that is not one (its name is said), OSError when it cannot be read."""
    fd = open_own(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        data = f.read(_HEAD.size + _WALL.size * 65536 + 4 + MAX_OWNER)
    try:
        magic, last, sent, slots = _HEAD.unpack_from(data)
        if magic != MAGIC or not 0 < slots <= 65536:
            raise ValueError("not a step file")
        walls = list(struct.unpack_from(f"<{slots}d", data, _HEAD.size))
        at = _HEAD.size + 8 * slots
        (size,) = struct.unpack_from("<I", data, at)
        owner = json.loads(data[at + 4 : at + 4 + size])
        if not isinstance(owner, dict):
            raise ValueError("its owner is not a mapping")
    except (struct.error, ValueError) as exc:
        raise ValueError(f"{path} is not a step file: {exc}") from None
    return TailRead(int(last), int(sent), walls, owner)


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, from ``/proc``); None when it is
    gone, a zombie, or ``/proc`` cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # (the name may hold spaces and parentheses)
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def is_gone(pid: int, started: int | None) -> bool:
    """Whether the process ``pid`` that started at ``started`` has ended (a new process with
    its pid is another one)."""
    now = process_start(pid)
    return now is None or (started is not None and now != started)
