"""Replays WindowPlan commands the way a rank applies them, without torch."""

from __future__ import annotations

from coordinator.core.window_plan import Ignored, Start, Step, Stop, WindowPlan


def recorded_steps(plan: WindowPlan, first_step: int, steps: list[int]) -> dict[int, list[int]]:
    """Run the plan over ``steps`` (the order the trainer reports them) and stop.

    Returns window index -> the global steps a rank records in it.
    """
    out: dict[int, list[int]] = {}
    open_w = None
    recording_from = None
    last_done = None

    def close(upto):
        if upto is not None and recording_from is not None and upto >= recording_from:
            out[open_w.index] = list(range(recording_from, upto + 1))

    def apply(cmds):
        nonlocal open_w, recording_from, last_done
        if isinstance(cmds, Ignored):
            return
        for c in cmds:
            if isinstance(c, Start):
                open_w, last_done = c.window, None
                recording_from = max(c.step, c.window.first)
            elif isinstance(c, Step):
                last_done = c.step
                if c.stops:
                    close(c.step)
                    open_w = None
            elif isinstance(c, Stop):
                close(last_done)
                open_w = None

    apply(plan.start(first_step))
    for k in steps:
        apply(plan.step(k))
    apply(plan.stop())
    return out
