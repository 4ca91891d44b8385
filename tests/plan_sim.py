"""Replays WindowDriver commands the way a rank applies them, without torch."""

from __future__ import annotations

from coordinator.window_driver import Begin, End, Ignored, Step, WindowDriver


def recorded_steps(driver: WindowDriver, first_step: int, steps: list[int]) -> dict[int, list[int]]:
    """Run the driver over ``steps`` (the order the trainer reports them) and stop.

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
            if isinstance(c, Begin):
                open_w, last_done = c.window, None
                recording_from = max(c.step, c.window.first)
            elif isinstance(c, Step):
                last_done = c.step
                if c.closes:
                    close(c.step)
                    open_w = None
            elif isinstance(c, End):
                close(last_done)
                open_w = None

    apply(driver.start(first_step))
    for k in steps:
        apply(driver.step(k))
    apply(driver.stop())
    return out
