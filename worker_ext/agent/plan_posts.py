"""The node agent's side of the plan board (``coordinator.protocol.plan_board``): write the board
the coordinator sent for this node's SPMD ranks, then wait for their acknowledgements.

The wait looks at the ranks' acknowledgement files every ``POLL_S`` and at whether their
processes still live, so a dead rank is named at once and a live one within ``timeout_s``. Only
files under ``plans_dir()`` named by a board id are ever written or read.

``sweep_boards`` removes what runs that are over left there: a board untouched for
``STALE_S`` whose ranks' processes are all gone, with its acknowledgements; an acknowledgement
of a gone process with no board; a temporary file of a write cut off.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

from coordinator.protocol.agent_rpc import PlanAnswer, PlanPost
from coordinator.protocol.plan_board import (
    PlanAck,
    ack_path,
    board_path,
    decode_ack,
    is_board_id,
    plans_dir,
    read_capped,
    write_private,
)
from worker_ext.agent.stack_reader import process_exited

POLL_S = 0.02
STALE_S = 3600.0
"""A board or temporary file not written for this long, whose ranks are gone, is swept."""
MAX_WAIT_S = 3600.0
MAX_RANKS = 1 << 16


class BoardWriter:
    """Boards written on this node: never one older than the last written for its file."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._versions: dict[str, int] = {}

    async def post(self, post: PlanPost) -> PlanAnswer:
        """Write ``post``'s board (unless a newer one is there) and wait for its ranks."""
        problem = post_problem(post)
        if problem is not None:
            raise ValueError(problem)
        bid = post["board"]
        if post["version"] >= self._versions.get(bid, -1):
            self._versions[bid] = post["version"]
            await asyncio.get_running_loop().run_in_executor(
                None, write_private, board_path(bid), post["blob"]
            )
        answer: PlanAnswer = {
            "node": self.node,
            "held": [],
            "late": [],
            "off": [],
            "lost": [],
            "silent": [],
        }
        window = post["window"]
        if window is None:
            return answer
        waiting = {int(r): pid for r, pid in post["ranks"]}
        deadline = time.monotonic() + float(post["timeout_s"])
        while waiting:
            for rank, pid in list(waiting.items()):
                if _settle(answer, bid, rank, pid, window):
                    del waiting[rank]
            if not waiting or time.monotonic() >= deadline:
                break
            await asyncio.sleep(POLL_S)
        answer["silent"] = sorted(waiting)
        return answer


def _settle(answer: PlanAnswer, bid: str, rank: int, pid: int | None, window: int) -> bool:
    """Whether ``rank`` has answered for ``window`` (its answer added), or is gone."""
    if pid is not None and process_exited(pid):  # (whatever it wrote, it records nothing now)
        answer["lost"].append(rank)
        return True
    ack = _read_ack(bid, rank)
    if ack is not None and (pid is None or ack.pid == pid):
        if ack.off is not None:
            answer["off"].append((rank, ack.off))
            return True
        if window in ack.held:
            answer["held"].append((rank, ack.step))
            return True
        if window in ack.late:
            answer["late"].append((rank, ack.step))
            return True
    return False


def _read_ack(bid: str, rank: int) -> PlanAck | None:
    try:
        return decode_ack(read_capped(ack_path(bid, rank)))
    except (OSError, ValueError):
        return None  # none yet, or one being replaced: looked at again


def post_problem(post: object) -> str | None:
    """Why ``post`` is not a ``PlanPost``, or None."""
    if not isinstance(post, dict):
        return f"a plan post must be a dict, got {type(post).__name__}"
    if not is_board_id(post.get("board")):
        return "a plan post's board must be a board id (32 hex digits)"
    if not isinstance(post.get("blob"), bytes):
        return "a plan post's blob must be bytes"
    if not isinstance(post.get("version"), int) or isinstance(post.get("version"), bool):
        return "a plan post's version must be an int"
    window = post.get("window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool)):
        return "a plan post's window must be an int or None"
    timeout = post.get("timeout_s")
    if not isinstance(timeout, (int, float)) or not 0 <= timeout <= MAX_WAIT_S:
        return f"a plan post's timeout_s must be a number in 0..{MAX_WAIT_S:g}"
    ranks = post.get("ranks")
    ok = isinstance(ranks, list) and len(ranks) <= MAX_RANKS
    ok = ok and all(
        isinstance(p, (list, tuple))
        and len(p) == 2
        and isinstance(p[0], int)
        and (p[1] is None or isinstance(p[1], int))
        for p in ranks  # type: ignore[union-attr]
    )
    return None if ok else "a plan post's ranks must be a list of [rank, pid or None]"


def sweep_boards(folder: Path | None = None, now: float | None = None) -> list[str]:
    """Remove the plans directory's files of runs that are over (see the module docstring);
    the names removed. Never raises; a directory that is not private is left alone."""
    now = time.time() if now is None else now
    try:
        where = folder or plans_dir()
        files = {p.name: p for p in where.iterdir()}
    except OSError:
        return []
    acks: dict[str, list[Path]] = {}
    for name, path in files.items():
        bid, _, rest = name.partition(".")
        if is_board_id(bid) and rest.endswith(".ack"):
            acks.setdefault(bid, []).append(path)
    gone = []
    for name, path in files.items():
        bid, _, rest = name.partition(".")
        if rest == "plan" and is_board_id(bid):
            ranks = acks.pop(bid, [])
            if _age(path, now) > STALE_S and all(_ack_gone(a, now) for a in ranks):
                gone += [path, *ranks]
        elif name.startswith(".") and name.endswith(".tmp") and _age(path, now) > STALE_S:
            gone.append(path)
    gone += [a for ranks in acks.values() for a in ranks if _ack_gone(a, now)]  # (no board)
    removed: list[str] = []
    for path in gone:
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path.name)
    return removed


def _age(path: Path, now: float) -> float:
    try:
        return now - os.lstat(path).st_mtime
    except OSError:
        return 0.0


def _ack_gone(path: Path, now: float) -> bool:
    """Whether the process that wrote this acknowledgement is gone (an unreadable one: when
    it is ``STALE_S`` old)."""
    try:
        return process_exited(decode_ack(read_capped(path)).pid)
    except (OSError, ValueError):
        return _age(path, now) > STALE_S
