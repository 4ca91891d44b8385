"""An SPMD rank's reader of its node's plan board (``coordinator.protocol.plan_board``).

Between two steps, once the step's clock reading (``time.perf_counter``) reaches ``look_at``
(at most every ``LOOK_EVERY_S``), the rank looks; ``look`` costs one
``os.stat`` while the board has not changed, and otherwise takes the captures this rank has not
seen into its plan (``coordinator.core.spmd_plan.take_captures``) and writes its acknowledgement
for the node agent. Runs on the training thread; never raises.

It trusts nothing on the board that its own run did not say: a board that names another run or
trainer is ignored, and so is a capture of an unknown kind or longer (warm-up and recorded steps)
than the coordinator lets one be (``max_capture_steps``); each is counted (``ignored``) and said
once in the log. A plans directory that is not private to this user is refused, once.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter

from coordinator.core.schedule import WINDOW_KINDS, Window
from coordinator.core.spmd_plan import Capture, Taken, take_captures
from coordinator.core.window_plan import Command, Start, Step, Stop, WindowPlan
from coordinator.protocol import plan_board

log = logging.getLogger(__name__)
KINDS = tuple(k for k in WINDOW_KINDS if k != "scheduled")  # (scheduled ones never travel)


class BoardReader:
    """One rank's view of its trainer's plan board on this node."""

    def __init__(self, board: str, rank: int, run: str, trainer_id: str, max_steps: int) -> None:
        self.board, self.rank = board, rank  # the board's id (``plan_board.board_id``)
        self.run, self.trainer_id, self.max_steps = run, trainer_id, max_steps
        self.ignored: Counter[str] = Counter()  # what was refused, by why
        self.refused: str | None = None  # the plans directory, when it is not private
        try:
            self.path = plan_board.board_path(board)
        except (OSError, ValueError) as exc:
            self.refused = str(exc)
            log.error("profiler: rank %s takes no capture at run time: %s", rank, exc)
        self.seen: set[int] = set()  # captures taken from the board
        self.not_mine: set[int] = set()  # captures held but recorded by other ranks only
        self._stamp: tuple[int, int, int] | None = None  # the board's mtime, size and inode
        self.look_at = 0.0  # (``time.perf_counter``) the next look is due from then on
        self._skipping = False  # the open window is one of ``not_mine``

    def look(self, plan: WindowPlan, next_step: int | None) -> Taken | None:
        """Take the board's new captures into ``plan`` (``next_step``: the first step whose
        window the plan has not decided; None before the loop) and acknowledge them; None
        when the board is absent, unchanged or unreadable."""
        self.look_at = time.perf_counter() + plan_board.LOOK_EVERY_S
        if self.refused is not None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None  # (no capture was planned yet)
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        try:
            board = plan_board.decode_board(plan_board.read_capped(self.path))
            if (board.run, board.trainer_id) != (self.run, self.trainer_id):
                self._ignore(
                    "other run",
                    f"a board of run {board.run!r:.80}, trainer {board.trainer_id!r:.80}",
                )
                return None
            caps = [
                Capture(
                    Window(e.index, e.warmup_start, e.first, e.last, e.kind),
                    None if e.ranks is None else tuple(e.ranks),
                    e.opened,
                )
                for e in board.entries
                if self._allowed(e)
            ]
            taken = take_captures(plan, caps, self.rank, next_step, self.seen, self.not_mine)
            at = None if next_step is None else next_step - 1
            ack = plan_board.PlanAck(
                os.getpid(), at, board.version, taken.held, taken.late, taken.off
            )
            ack_file = plan_board.ack_path(self.board, self.rank)
            plan_board.write_private(ack_file, plan_board.encode_ack(ack))
        except Exception as exc:  # a bad board or a full disk: the schedule goes on
            log.warning("profiler: rank %s could not take the plan board: %s", self.rank, exc)
            return None
        return taken

    def _allowed(self, e: plan_board.BoardEntry) -> bool:
        steps = e.last - e.warmup_start + 1
        if e.kind not in KINDS:
            self._ignore("unknown kind", f"a capture of unknown kind {e.kind!r:.40}")
        elif steps > self.max_steps:
            self._ignore("too long", f"a capture of {steps} steps (at most {self.max_steps})")
        else:
            return True
        return False

    def _ignore(self, kind: str, what: str) -> None:
        """Counted by ``kind``; the first of each kind said in the log."""
        if not self.ignored[kind]:
            log.warning("profiler: rank %s ignored %s on its plan board", self.rank, what)
        self.ignored[kind] += 1

    def skips(self, cmd: Command) -> bool:
        """Whether ``cmd`` is for a capture that this rank holds (for the windows' numbers)
        but that other ranks record."""
        if isinstance(cmd, Start) and cmd.window.index in self.not_mine:
            self._skipping = True
            return True
        if self._skipping and (isinstance(cmd, Stop) or (isinstance(cmd, Step) and cmd.stops)):
            self._skipping = False
            return True
        return self._skipping
