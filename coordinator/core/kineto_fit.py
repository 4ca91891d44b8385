"""Whether a schedule leaves libkineto the time it needs (``engine: kineto``), in words for
``status()["schedule_problems"]``. Pure: no Ray, no torch.

libkineto asks the node agent for a config once a second (``POLL_S``) and takes one only while
it neither records nor writes a trace. A window's config goes out when its warm-up begins (the
first window, a capture) or as soon as the window before it ended (the next scheduled one), so:
the warm-up must last a poll, or the window starts late (partial); and the steps between one
window's end and the next one's first step must last the writing of the trace (libkineto's
thread wakes once a second to write it) and a poll, or the next window is lost.
"""

from __future__ import annotations

import math
from typing import Any

from coordinator.core.schedule import Schedule

POLL_S = 1.0  # libkineto's poll (worker_ext.agent.kineto_ipc.POLL_S)
GAP_S = 3.0  # a window's end to the next one's first step: libkineto writes (1-2 s), then polls


def kineto_schedule_problems(config: Any, step_s: float | None) -> list[str]:
    """What of ``config``'s schedule libkineto cannot serve at ``step_s`` seconds a step; empty
    for another engine, a schedule with no window, or while the step time is not known."""
    if getattr(config, "engine", "torch") != "kineto" or step_s is None or step_s <= 0:
        return []
    sched = Schedule(config)
    if sched.num_windows == 0:
        return []
    ms = f"{step_s * 1e3:.0f} ms"
    problems = []
    if sched.warmup * step_s < POLL_S:
        need = math.ceil(POLL_S / step_s)
        problems.append(
            f"engine 'kineto': the first window may start late (partial): its config reaches "
            f"libkineto at its next poll, up to {POLL_S:g} s after the warm-up begins, and "
            f"warmup {sched.warmup} x {ms} a step = {sched.warmup * step_s:.2f} s; "
            f"warmup >= {need} gives it a poll"
        )
    gap = sched.wait + sched.warmup
    if sched.num_windows != 1 and gap * step_s < GAP_S:
        need = math.ceil(GAP_S / step_s)
        problems.append(
            f"engine 'kineto': windows after the first may be lost: libkineto takes a window's "
            f"config only once the trace before it is written, about {GAP_S:g} s after that "
            f"window's end with its next poll, and wait + warmup = {gap} x {ms} a step = "
            f"{gap * step_s:.2f} s; wait + warmup >= {need} leaves that"
        )
    return problems
