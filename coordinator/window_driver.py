"""Turns the trainer's step reports into rank commands: pure, no Ray, no torch.

The trainer reports ``start(first_step)`` before its loop, ``step(k)`` after global step k has
finished, and ``stop()`` after the loop. The driver answers with the commands the selected ranks
must run before the next training step, and nothing at all on steps outside a window.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.schedule import Schedule, Window


@dataclass(frozen=True)
class Begin:
    """Open ``window``; the next training step to run is ``step``."""

    window: Window
    step: int


@dataclass(frozen=True)
class Step:
    """Global step ``step`` has finished inside the open window; ``closes`` ends the window."""

    step: int
    closes: bool


@dataclass(frozen=True)
class End:
    """Close the open window now (the run stopped inside it): a partial window."""


Command = Begin | Step | End


@dataclass(frozen=True)
class Ignored:
    """A step report that was not applied: ``reason`` is ``duplicate`` or ``out_of_order``."""

    step: int
    reason: str


class WindowDriver:
    """State of one run's window plan: the open window, the last step, the next window."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.last_step: int | None = None
        self.current: Window | None = None
        self.next_index = 0  # one index space for every window the run opens
        self.skipped_windows = 0
        self._cursor: Window | None = None  # next scheduled window not yet opened or skipped
        self._started = False

    @property
    def started(self) -> bool:
        return self._started

    def next_window(self) -> Window | None:
        """The next scheduled window, numbered as it would be if it opened next."""
        if self._cursor is None:
            return None
        return _renumber(self._cursor, self.next_index)

    def start(self, first_step: int) -> list[Command]:
        """Before the loop: the next step to run is ``first_step`` (the resumed step on resume)."""
        if first_step < 0:
            raise ValueError(f"first_step must be >= 0, got {first_step}")
        commands: list[Command] = []
        if self.current is not None:  # started again without stop: close what is open
            commands.append(End())
            self.current = None
        self._started = True
        self.last_step = first_step - 1 if first_step > 0 else None
        # Windows that end before first_step belong to steps already run.
        self._cursor = self.schedule.first_window_from(first_step)
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
            closes = k >= self.current.last
            commands.append(Step(k, closes))
            if not closes:
                return commands
            self.current = None
        return commands + self._maybe_begin(k + 1, resumed=False)

    def stop(self) -> list[Command]:
        """After the loop: close an open window (partial). Safe to call repeatedly."""
        if self.current is None:
            return []
        self.current = None
        return [End()]

    def _maybe_begin(self, step: int, resumed: bool) -> list[Command]:
        """Open the next scheduled window if its warm-up should have begun by ``step``."""
        w = self._cursor
        if w is None or w.warmup_start > step:
            return []
        if step > w.first and not resumed:
            # The trainer skipped past this window's start: it opens now, at full length.
            w = w.shifted_to(step)
        w = _renumber(w, self.next_index)
        self.next_index += 1
        self.current = w
        self._advance_cursor(after=w.last)
        return [Begin(w, step)]

    def _advance_cursor(self, after: int) -> None:
        nxt = self.schedule.first_window_from(after + 1)
        # Scheduled windows that would start inside a shifted window are dropped, not overlapped.
        while nxt is not None and nxt.warmup_start <= after:
            self.skipped_windows += 1
            nxt = self.schedule.first_window_from(nxt.last + 1)
        self._cursor = nxt


def _renumber(w: Window, index: int) -> Window:
    return Window(index, w.warmup_start, w.first, w.last)
