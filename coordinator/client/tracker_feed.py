"""The trainer's side of tracker logging: settled windows' figures and phase times handed to a
``log(metrics, step)`` callable (the trainer's own tracker, or ``trainers/trackers.py``'s).

It runs on the training thread, at the end of ``hooks.step``, and never waits there:

- **Windows.** Every ``ask_every_s`` (2 s) it sends ``tracker_figures(after)`` to the
  coordinator and goes on; a later step finds the answer (``ray.wait`` with no timeout) and logs
  each settled window's figures at the window's last recorded step (its findings' costs among
  them), and its findings as a table of text to the trackers that take text (a sink's
  ``text(tag, text, step)``). No thread of its own: a thread in the training process would
  compete for the GIL.
- **Phase times.** At most once every ``phases_every_s`` (1 s) it logs the mean of each region
  and of the step's wall time over the steps since the last time (``profiler/phase/...``).
- **Faults.** A ``log`` that raises is reported once and the feed stops logging; an answer
  that does not come (the coordinator away) is asked again later. Training never sees either.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any

from coordinator.core.tracker_figures import findings_text

log = logging.getLogger(__name__)
Log = Callable[[dict[str, float], int], None]
PHASE_PREFIX = "profiler/phase/"
FINDINGS_TEXT = "profiler/findings"
"""The tag of each window's findings as text (``core.tracker_figures.findings_text``)."""
LOGGED_KEPT = 256
"""The latest windows logged that ``logged_windows`` keeps (what a test or a notebook reads)."""


class TrackerFeed:
    """See the module docstring."""

    def __init__(
        self,
        coordinator: Any,
        sink: Log,
        ask_every_s: float = 2.0,
        phases_every_s: float = 1.0,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.coordinator, self.now = coordinator, now
        self.sink: Log | None = sink
        self.ask_every_s, self.phases_every_s = ask_every_s, phases_every_s
        self.after: int = -1  # the last window logged, of ``run``
        self.run: str | None = None
        self._last_step = 0
        self.logged_windows = collections.deque[int](maxlen=LOGGED_KEPT)  # the latest
        self._ref: Any = None
        self._asked = -float("inf")
        self._phase_since = now()
        self._wall, self._steps = 0.0, 0
        self._regions: dict[str, float] = {}
        self._failing: str | None = None  # why the figures stopped coming, said once

    @property
    def on(self) -> bool:
        """False once ``log`` failed: nothing more is logged."""
        return self.sink is not None

    def on_step(self, step: int, record: list[Any] | None) -> None:
        """After step ``step`` was reported: its phase record (``[step, wall_s, regions]``)
        counted, the phase means logged when due, answers taken, a question sent when due."""
        if not self.on:
            return
        tick = getattr(self.sink, "tick", None)
        if tick is not None:  # (a tracker that rides on the trainer's own commits)
            tick()
        if record is not None:
            self._count(record)
        if self._steps and self.now() - self._phase_since >= self.phases_every_s:
            self._emit(self._phase_means(), step)
        self._take(block_s=0.0)
        if self._ref is None and self.now() - self._asked >= self.ask_every_s:
            self._ask()

    def flush(self, timeout_s: float = 10.0) -> None:
        """At the end of the run: the phase means left, and the windows settled by now
        (asked once more, waited for up to ``timeout_s``)."""
        if not self.on:
            return
        if self._steps:
            self._emit(self._phase_means(), self._last_step)
        if self._ref is None:
            self._ask()
        self._take(block_s=timeout_s)

    # ---------------------------------------------------------------- phases

    def _count(self, record: list[Any]) -> None:
        k, wall, regions = record
        self._last_step = k
        self._wall += wall
        self._steps += 1
        for name, seconds in regions.items():
            self._regions[name] = self._regions.get(name, 0.0) + seconds

    def _phase_means(self) -> dict[str, float]:
        n = self._steps
        out = {f"{PHASE_PREFIX}step_ms": self._wall / n * 1e3}
        out |= {f"{PHASE_PREFIX}{k}_ms": v / n * 1e3 for k, v in self._regions.items()}
        self._wall, self._regions, self._steps = 0.0, {}, 0
        self._phase_since = self.now()
        return out

    # --------------------------------------------------------------- windows

    def _ask(self) -> None:
        self._asked = self.now()
        try:
            self._ref = self.coordinator.tracker_figures.remote(after=self.after)
        except Exception as exc:  # an old coordinator without the call, or none
            self._failed("asked", exc)
            self._ref = None

    def _failed(self, what: str, exc: Exception) -> None:
        """Said once until the figures come again: the tracker gets no window figures now."""
        if self._failing is None:
            log.warning(
                "profiler: the tracker's window figures were not %s (%s: %s); none are "
                "logged until the coordinator answers again (asked every %.0f s)",
                what, type(exc).__name__, exc, self.ask_every_s,
            )  # fmt: skip
        self._failing = f"{type(exc).__name__}: {exc}"

    def _take(self, block_s: float) -> None:
        """Log the windows of the answer, when it is in (within ``block_s``)."""
        import ray

        if self._ref is None:
            return
        ready, _ = ray.wait([self._ref], timeout=block_s)
        if not ready:
            return
        ref, self._ref = self._ref, None
        try:
            answer = ray.get(ref)
        except Exception as exc:  # the coordinator went away: asked again later
            self._failed("answered", exc)
            return
        if self._failing is not None:
            log.warning("profiler: the tracker's window figures come again")
            self._failing = None
        if answer["run"] != self.run:  # a new run: its windows from the first
            self.run, self.after = answer["run"], -1
            if self.logged_windows:
                self.logged_windows.clear()
                self._ask()
                return
        for w in answer["windows"]:
            if w["window"] > self.after and self._emit(w["metrics"], w["step"]):
                self.after = w["window"]
                self.logged_windows.append(w["window"])
                self._emit_text(w.get("findings"), w["step"])  # (an older coordinator: none)

    def _emit_text(self, findings: list[Any] | None, step: int) -> None:
        """The window's findings as text, to the trackers that take it (``text``)."""
        text = getattr(self.sink, "text", None)
        if text is None or not findings:
            return
        try:
            text(FINDINGS_TEXT, findings_text(findings), step)
        except Exception as exc:
            log.warning("profiler: the tracker failed (%s: %s); no more is logged to it",
                        type(exc).__name__, exc)  # fmt: skip
            self.sink = None

    def _emit(self, metrics: dict[str, float], step: int) -> bool:
        if self.sink is None:
            return False
        try:
            self.sink(metrics, step)
            return True
        except Exception as exc:
            log.warning("profiler: the tracker failed (%s: %s); no more is logged to it",
                        type(exc).__name__, exc)  # fmt: skip
            self.sink = None
            return False
