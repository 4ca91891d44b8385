"""The plan board: captures planned at run time on their way to SPMD ranks, one file per node.

SPMD ranks (``trainers.RankSession``) follow the run's window plan by themselves and take no
call from the coordinator. A capture planned at run time reaches them through their node's
agent: the coordinator sends the trainer's board (its pending captures) to each node agent that
hosts its ranks (``post_plan``); the agent writes it, atomically, to a node-local file; each rank
looks at that file (one ``os.stat``) at most every ``LOOK_EVERY_S`` between two steps, takes the
captures it has not seen into its plan, and answers with its acknowledgement, a file of its own
beside the board. The agent waits for the acknowledgements and answers the coordinator for its
node. Nothing on a rank's step path waits or calls Ray.

Both files are msgpack, decoded strictly and size-capped; a file that is not one is refused.
The directory is private to its user (mode 0700, owned by them, not a link: ``plans_dir``),
files are written through a temporary file of a random name made exclusively and read without
following a link, so another user of the node can neither plant a board nor redirect a write.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import TypeVar

import msgspec

from coordinator.protocol.atomic_file import write_atomic
from coordinator.protocol.node_dir import chosen_dir
from coordinator.protocol.node_files import open_own

T = TypeVar("T")

PLANS_ENV = "RAY_PROFILER_PLANS_DIR"
LOOK_EVERY_S = 0.1
"""A rank looks at its board at most this often (between two steps)."""
MAX_BOARD_BYTES = 1 << 20
MAX_ENTRIES = 1024
_ID = re.compile(r"[0-9a-f]{32}")


class BoardEntry(msgspec.Struct, frozen=True):
    """One capture: its window (index and steps), the ranks that record it (None: every rank
    the config selects), and whether the coordinator's plan has opened it (a rank that has not
    seen it by then keeps its number free, and records it only if still before its steps)."""

    index: int
    warmup_start: int
    first: int
    last: int
    kind: str
    ranks: list[int] | None
    opened: bool = False


class Board(msgspec.Struct, frozen=True):
    """A trainer's captures: those not yet opened, and the latest opened (``spmd_plan``);
    ``version`` grows with every board the coordinator sends."""

    run: str
    trainer_id: str
    version: int
    entries: list[BoardEntry]


class PlanAck(msgspec.Struct, frozen=True):
    """A rank's answer to the board it read last: its process, the step it was finishing, the
    captures it holds (it records them, or is not one of their ranks), those it read too late
    (their warm-up had begun), and why it cannot follow the plan at all, if so."""

    pid: int
    step: int | None
    version: int
    held: list[int]
    late: list[int]
    off: str | None = None


def board_id(namespace: str, name: str, run: str, trainer_id: str) -> str:
    """The board's file name (hex) for one coordinator's run and trainer."""
    return hashlib.sha256(f"{namespace}\0{name}\0{run}\0{trainer_id}".encode()).hexdigest()[:32]


def is_board_id(value: object) -> bool:
    return isinstance(value, str) and bool(_ID.fullmatch(value))


def plans_dir() -> Path:
    """Where this node's boards live (the agent and the ranks of a node share it), made private
    and checked (``node_dir.private_dir``): ``$RAY_PROFILER_PLANS_DIR``, else
    ``<tmp>/ray-profiler-<uid>/plans``.

    Raises:
        PermissionError: it is a link, another user's or open to others (a board planted there
            would inject captures into this user's ranks); the message says what to do.
    """
    return chosen_dir(PLANS_ENV, "plans", "the plan boards directory")


def board_path(bid: str) -> Path:
    """The board's file in this node's private plans directory (``plans_dir``)."""
    if not is_board_id(bid):
        raise ValueError(f"{bid!r:.80} is not a board id")
    return plans_dir() / f"{bid}.plan"


def ack_path(bid: str, rank: int) -> Path:
    return board_path(bid).with_name(f"{bid}.{int(rank)}.ack")


def encode_board(board: Board) -> bytes:
    return msgspec.msgpack.encode(board)


def _decode(blob: bytes, kind: type[T], what: str) -> T:
    if len(blob) > MAX_BOARD_BYTES:
        raise ValueError(f"{what} of {len(blob)} bytes is over {MAX_BOARD_BYTES}")
    try:
        return msgspec.msgpack.decode(blob, type=kind)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not {what}: {exc}") from None


def decode_board(blob: bytes) -> Board:
    """The board in ``blob``; ValueError for anything else, or one too large."""
    board = _decode(blob, Board, "a plan board")
    if len(board.entries) > MAX_ENTRIES:
        raise ValueError(f"a board of {len(board.entries)} captures is over {MAX_ENTRIES}")
    for e in board.entries:
        if not (e.index >= 0 and 0 <= e.warmup_start <= e.first <= e.last):
            raise ValueError(f"capture {e.index}: bad steps {e.warmup_start}/{e.first}/{e.last}")
    return board


def encode_ack(ack: PlanAck) -> bytes:
    return msgspec.msgpack.encode(ack)


def decode_ack(blob: bytes) -> PlanAck:
    """The acknowledgement in ``blob``; ValueError for anything else."""
    return _decode(blob, PlanAck, "a plan acknowledgement")


def write_private(path: Path, blob: bytes) -> None:
    """``blob`` at ``path``, whole or not at all and never through a link
    (``atomic_file.write_atomic``), readable by this user alone."""
    write_atomic(path, blob, mode=0o600)


def read_capped(path: Path) -> bytes:
    """The file's bytes, never through a link nor from a file of another user's (``OSError``:
    ``node_files.open_own``); ValueError when it is larger than a board may be."""
    fd = open_own(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        blob = f.read(MAX_BOARD_BYTES + 1)
    if len(blob) > MAX_BOARD_BYTES:
        raise ValueError(f"{path.name} is over {MAX_BOARD_BYTES} bytes")
    return blob
