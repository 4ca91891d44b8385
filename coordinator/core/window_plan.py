"""The window plan: turns the trainer's step reports into window commands. Pure.

One vocabulary from the trainer to the rank: the trainer ``start``s, ``step``s and ``stop``s its
run; the plan answers with ``Start`` (a window starts before step ``step``), ``Step`` (a step of
the open window finished; ``stops`` when it was the last) and ``Stop`` (stop the open window
now, partial); a rank's ``RankProfiler`` has ``start_window`` / ``step`` / ``stop_window``, and
only the seed's RPC names differ (``start_profile`` / ``profile_step`` / ``stop_profile``).

The trainer reports ``start(first_step)`` before its loop, ``step(k)`` after global step k has
finished, and ``stop()`` after the loop. The plan answers with the commands the selected ranks
must run before the next training step, and nothing at all on steps outside a window.

One plan holds the scheduled windows and the captures requested at run time, never overlapping.
A capture is planned while the trainer waits for the answer to a report, so it learns of the
plan before it runs another step (see ``request_capture``); the steps planned are the steps
recorded, unless the trainer skips past them or stops first (``Start.planned`` keeps the promise).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.core.schedule import Schedule, Window

MAX_SLIDES = 1000
"""The most windows an SPMD capture's default start slides past to find free steps."""
MAX_STEP = 2**62
"""``quiet_through`` of a plan with no window to come."""


@dataclass(frozen=True)
class Start:
    """Start ``window``; the next training step to run is ``step``.

    ``planned`` is the window as it was planned (a capture's promise, the schedule's steps) when
    the trainer skipped past its start and ``window`` was moved; else None.
    """

    window: Window
    step: int
    planned: Window | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Step:
    """Global step ``step`` has finished inside the open window; ``stops``: it was the window's
    last step, and the window stops with it."""

    step: int
    stops: bool


@dataclass(frozen=True)
class Stop:
    """Stop the open window now (the run stopped inside it): a partial window."""


Command = Start | Step | Stop


@dataclass(frozen=True)
class Ignored:
    """A step report that was not applied: ``reason`` is ``duplicate`` or ``out_of_order``."""

    step: int
    reason: str


class WindowPlan:
    """State of one run's window plan: the open window, the last step, the next window."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.last_step: int | None = None
        self.current: Window | None = None
        self.next_index = 0  # one index space for every window the run opens
        self.skipped_windows = 0
        self._cursor: Window | None = None  # next scheduled window not yet opened or skipped
        self._started = False
        self.captures: list[Window] = []  # requested, not yet opened; sorted by warm-up start
        self.promised: dict[int, Window] = {}  # captures as first planned, until they open
        self.gaps: set[int] = set()  # indices no window here takes (an SPMD rank's late captures)

    @property
    def started(self) -> bool:
        return self._started

    @property
    def cursor(self) -> Window | None:
        """The next scheduled window not yet opened or skipped (saved with the plan)."""
        return self._cursor

    def restore_cursor(self, cursor: Window | None, started: bool) -> None:
        """A saved plan's cursor and start put back (a restarted coordinator)."""
        self._cursor, self._started = cursor, started

    def next_window(self) -> Window | None:
        """The next window to open: a capture, or the scheduled one numbered as it would be."""
        sched = self._cursor.renumbered(self.free_index()) if self._cursor else None
        cap = self.captures[0] if self.captures else None
        if cap is None or (sched is not None and sched.warmup_start < cap.warmup_start):
            return sched
        return cap

    @property
    def next_boundary(self) -> int:
        """The first step the trainer has not reported finished (0 before any report)."""
        return self.last_step + 1 if self.last_step is not None else 0

    def quiet_through(self) -> int:
        """The last step ``k`` whose ``step(k)`` surely returns no command as the plan stands
        now (no window open, the next one's warm-up after ``k + 1``); -1 when none is. A rank
        that counts its steps past the plan up to it calls ``step`` again only after it (its
        hot path), and asks again whenever the plan changes (a command, a capture taken).

        >>> from coordinator.core.config import ProfilerConfig
        >>> cfg = ProfilerConfig(enable=True, skip_first=10, wait=0, warmup=1, active=2)
        >>> plan = WindowPlan(Schedule(cfg)); _ = plan.start(0)
        >>> plan.quiet_through(), plan.step(8), plan.step(9)[0].window.warmup_start
        (8, [], 10)
        """
        if not self._started or self.current is not None:
            return -1
        starts = [w.warmup_start for w in (self._cursor, *self.captures[:1]) if w is not None]
        if not starts:
            return MAX_STEP
        return max(-1, min(starts) - 2)

    def free_index(self, start: int | None = None) -> int:
        """The lowest window index from ``start`` (default ``next_index``) that no pending
        capture holds and that is no gap: the index the next scheduled window opens as."""
        i = self.next_index if start is None else start
        held = {c.index for c in self.captures} | self.gaps
        while i in held:
            i += 1
        return i

    def index_for(self, warmup_start: int) -> int:
        """The index a capture whose warm-up begins at ``warmup_start`` takes when it is
        numbered by its steps (``request_capture(by_steps=True)``): the one after those of the
        scheduled windows that open before it, so a plan that opened them before it learnt of
        the capture (an SPMD rank ahead of the coordinator) numbered them the same."""
        s = self._cursor  # (its index counts the schedule's windows)
        before = 0 if s is None else max(0, self.schedule.windows_before(warmup_start) - s.index)
        i = self.next_index + before  # (no loop: a start far ahead costs nothing more)
        for held in sorted({c.index for c in self.captures} | self.gaps):
            if self.next_index <= held <= i:
                i += 1
        return i

    def add_capture(self, w: Window) -> None:
        """A capture planned elsewhere (the coordinator's plan, for an SPMD rank's copy): it
        opens at its steps with its own index, which no scheduled window takes."""
        if w.index in self.promised or (self.current is not None and w.index == self.current.index):
            return
        self.captures = sorted([*self.captures, w], key=lambda c: c.warmup_start)
        self.promised[w.index] = w

    def request_capture(
        self,
        warmup: int,
        active: int,
        start_step: int | None,
        kind: str = "capture",
        earliest: int | None = None,
        by_steps: bool = False,
    ) -> Window | str:
        """Plan a capture recording ``active`` steps from ``start_step`` (default: the earliest
        step whose warm-up can begin at a boundary the trainer has not reached).

        Call it while the trainer waits for the answer to its report of step ``next_boundary``
        (before ``step`` applies that report), or right after the answer to a report it waited
        for, when it will wait for its next one too: either way it learns of the plan before it
        runs another step. Returns the planned window, or the reason it was refused.

        SPMD ranks run ahead of the plan and learn of the capture later: ``earliest`` is the
        first step none of them can have reached, and ``by_steps`` numbers the capture with
        ``index_for`` (its steps' place among the windows), not ``next_index``; without
        ``start_step`` it takes the first free steps from ``earliest`` on, past other windows.
        """
        if warmup < 0 or active < 1:
            return f"need warmup >= 0 and active >= 1, got warmup={warmup} active={active}"
        # Once started, the trainer may already be running the step after its last report.
        if earliest is None:
            earliest = self.next_boundary + (1 if self._started else 0)
        if start_step is None:
            warmup_start = earliest
        else:
            warmup_start = start_step - warmup
            if warmup_start < earliest:
                return (
                    f"start_step {start_step} is too early: with warmup {warmup} its warm-up "
                    f"would begin at step {warmup_start}, and the earliest step the trainer can "
                    f"still be prepared for is {earliest}"
                )
        length = warmup + active - 1
        clash = self._clash(Window(0, warmup_start, warmup_start + warmup, warmup_start + length))
        for _ in range(MAX_SLIDES if by_steps and start_step is None else 0):
            if clash is None:  # SPMD ranks: the first free steps from the earliest on
                break
            warmup_start = clash[1] + 1
            probe = Window(0, warmup_start, warmup_start + warmup, warmup_start + length)
            clash = self._clash(probe)
        if clash is not None:
            end = warmup_start + length
            return f"steps {warmup_start}-{end} overlap {clash[0]}"
        w = Window(
            self.index_for(warmup_start) if by_steps else self.next_index,
            warmup_start,
            warmup_start + warmup,
            warmup_start + length,
            kind,
        )
        if not by_steps:
            self.next_index += 1
        self.captures = sorted([*self.captures, w], key=lambda c: c.warmup_start)
        self.promised[w.index] = w
        return w

    def cancel_capture(self, index: int) -> str | None:
        """Drop a capture that has not opened yet; returns the reason when it cannot."""
        if self.current is not None and self.current.index == index:
            return f"window {index} is already open; stop() closes it early"
        kept = [c for c in self.captures if c.index != index]
        if len(kept) == len(self.captures):
            return f"no pending capture {index}"
        self.captures = kept
        self.promised.pop(index, None)
        return None

    def _clash(self, w: Window) -> tuple[str, int] | None:
        """The window ``w`` would overlap (what it is, and its last step), or None."""
        cur = self.current
        if cur is not None and cur.overlaps(w):
            return f"{cur.kind} window {cur.index} (steps {cur.warmup_start}-{cur.last})", cur.last
        for c in self.captures:
            if c.overlaps(w):
                return f"capture {c.index} (steps {c.warmup_start}-{c.last})", c.last
        s = self._cursor
        if s is not None and s.warmup_start <= w.last:
            s = self.schedule.first_window_from(max(w.warmup_start, s.warmup_start))
        while s is not None and s.warmup_start <= w.last:
            if s.overlaps(w):
                return f"the scheduled window recording steps {s.first}-{s.last}", s.last
            s = self.schedule.first_window_from(s.last + 1)
        return None

    def start(self, first_step: int) -> list[Command]:
        """Before the loop: the next step to run is ``first_step`` (the resumed step on resume)."""
        if first_step < 0:
            raise ValueError(f"first_step must be >= 0, got {first_step}")
        commands: list[Command] = []
        if self.current is not None:  # started again without stop: close what is open
            commands.append(Stop())
            self.current = None
        self._started = True
        self.last_step = first_step - 1 if first_step > 0 else None
        # Windows that end before first_step belong to steps already run.
        self._cursor = self.schedule.first_window_from(first_step)
        # Requested captures are never dropped: ones that would start earlier move to first_step.
        self.captures = [
            c.shifted_to(first_step) if c.warmup_start < first_step else c for c in self.captures
        ]
        commands += self._maybe_begin(first_step, resumed=True)
        return commands

    def step(self, k: int) -> list[Command] | Ignored:
        """Global step ``k`` finished. Returns commands, or ``Ignored`` for a stale report."""
        if k < 0:
            raise ValueError(f"step must be >= 0, got {k}")
        if not self._started:  # no start(): behave as if the loop began after step k
            return self.start(k + 1)
        if self.last_step is not None and k <= self.last_step:
            return Ignored(k, "duplicate" if k == self.last_step else "out_of_order")
        self.last_step = k
        commands: list[Command] = []
        if self.current is not None:
            stops = k >= self.current.last
            commands.append(Step(k, stops))
            if not stops:
                return commands
            self.current = None
        return commands + self._maybe_begin(k + 1, resumed=False)

    def stop(self) -> list[Command]:
        """After the loop: close an open window (partial). Safe to call repeatedly."""
        if self.current is None:
            return []
        self.current = None
        return [Stop()]

    def drop_captures(self) -> list[Window]:
        """The run is over: forget the captures that never opened; returns them as promised."""
        dropped = [self.promised.get(c.index, c) for c in self.captures]
        self.captures = []
        for c in dropped:
            self.promised.pop(c.index, None)
        return dropped

    def _maybe_begin(self, step: int, resumed: bool) -> list[Command]:
        """Open the window whose warm-up should have begun by ``step``, if any."""
        cap = self.captures[0] if self.captures else None
        sched = self._cursor
        if (
            cap is not None
            and cap.warmup_start <= step
            and (
                sched is None or cap.warmup_start <= sched.warmup_start or sched.warmup_start > step
            )
        ):
            self.captures.pop(0)
            planned = self.promised.pop(cap.index, cap)
            w = cap if step <= cap.first else cap.shifted_to(step)
            self.next_index = max(self.next_index, cap.index + 1)
        elif sched is not None and sched.warmup_start <= step:
            planned = sched.renumbered(self.free_index())
            w = planned
            if step > w.first and not resumed:
                # The trainer skipped past this window's start: it opens now, at full length.
                w = w.shifted_to(step)
            self.next_index = w.index + 1
        else:
            return []
        self.current = w
        self._advance_cursor(after=w.last)
        # Captures that the opened window now covers move to just after it.
        moved = [c.shifted_to(w.last + 1) if c.warmup_start <= w.last else c for c in self.captures]
        self.captures = sorted(moved, key=lambda c: c.warmup_start)
        return [Start(w, step, planned if planned != w else None)]

    def _advance_cursor(self, after: int) -> None:
        if self._cursor is not None and self._cursor.warmup_start > after:
            return  # a capture opened before the next scheduled window: that one still stands
        nxt = self.schedule.first_window_from(after + 1)
        # Scheduled windows that would start inside a shifted window are dropped, not overlapped.
        while nxt is not None and nxt.warmup_start <= after:
            self.skipped_windows += 1
            nxt = self.schedule.first_window_from(nxt.last + 1)
        self._cursor = nxt


MAX_REPLAY = 100_000
"""The most steps ``replay`` goes over one by one; a longer gap is taken as skipped."""


def replay(plan: WindowPlan, k: int) -> list[Command] | Ignored:
    """``plan.step(k)`` for a trainer whose ranks ran every step but which reports only some of
    them (SPMD ranks, each following the plan itself): the steps since the last report first,
    so the plan opens and closes the windows the ranks did, and all their commands in order.

    >>> from coordinator.core.config import ProfilerConfig
    >>> cfg = ProfilerConfig(enable=True, wait=1, warmup=0, active=2, repeat=1)
    >>> plan = WindowPlan(Schedule(cfg)); _ = plan.start(0)
    >>> [type(c).__name__ for c in replay(plan, 5)]
    ['Start', 'Step', 'Step']
    """
    if not plan.started or (plan.last_step is not None and k <= plan.last_step):
        return plan.step(k)
    commands: list[Command] = []
    for s in range(max(plan.next_boundary, k - MAX_REPLAY), k):
        done = plan.step(s)
        assert not isinstance(done, Ignored)  # (every step after the last one)
        commands += done
    done = plan.step(k)
    assert not isinstance(done, Ignored)
    return commands + done
