"""Captures: an operator's (``request_capture``) and the coordinator's own when the run slows
down (``request_auto``); both are planned to exactly the steps the ranks will record.

A capture is planned only while the trainer waits for an answer: at once when its next report
is waited for, else after its next report, whose answer makes a ``StepClient`` wait.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from coordinator.core.validate import (
    MAX_WORLD,
    flag_problem,
    is_int,
    is_number,
    is_rank,
    step_problem,
)
from coordinator.protocol.replies import (
    AutoCaptureReply,
    AutoTrigger,
    CancelReply,
    CaptureReply,
)
from coordinator.service.capture_rules import (
    accepted,
    auto_refused,
    capture_keys,
    count_capture,
    refusal,
)
from coordinator.service.rank_calls import fan_out
from coordinator.service.shell import CONFIGURE_TIMEOUT_S, CaptureRequest, CoordinatorShell, Key
from coordinator.service.spmd_captures import SpmdCaptures, spmd_stepping

log = logging.getLogger(__name__)

# How long request_capture waits for the trainer's next report before it says no.
CAPTURE_REPORT_TIMEOUT_S = 30.0


class Captures:
    """``request_capture`` and ``cancel_capture`` (see the actor's docs), and planning the
    requests that waited for the trainer's report."""

    def __init__(self, shell: CoordinatorShell) -> None:
        self.shell = shell
        self.spmd = SpmdCaptures(shell)
        self._tasks: set[asyncio.Task[None]] = set()

    async def request_capture(
        self,
        active: int = 1,
        warmup: int = 1,
        ranks: list[int] | None = None,
        start_step: int | None = None,
        wait_s: float = CAPTURE_REPORT_TIMEOUT_S,
    ) -> CaptureReply:
        """Profile ``active`` steps from ``start_step`` (default: as soon as possible).

        The answer names exactly the steps every selected rank records. To promise them, the
        coordinator must know where the trainer is: if the trainer will wait for its next
        report's answer, the capture is planned at once; otherwise this waits (at most
        ``wait_s``) for the trainer's next report, which it tells to wait. ``ranks=None``
        means the configured ranks.
        """
        no = request_problem(
            self.shell.run.config.max_capture_steps, active, warmup, ranks, start_step, wait_s
        )
        if no is not None:
            return self.shell.capture_no(no)
        req = CaptureRequest(active, warmup, None if ranks is None else list(ranks), start_step)
        if spmd_stepping(self.shell):  # ranks that step themselves: through their node agents
            return await self.spmd.plan(req, wait_s)
        async with self.shell.lock:
            no = refusal(self.shell, req)
            if no:
                return self.shell.capture_no(no)
            if self.shell.next_report_waits:
                return await self._plan(req)
            self.shell.requests.append(req)
        try:
            return await asyncio.wait_for(asyncio.shield(req.answer), wait_s)
        except asyncio.TimeoutError:
            async with self.shell.lock:
                if req.answer.done():
                    return req.answer.result()
                self.shell.requests.remove(req)
            return self.shell.capture_no(
                f"the trainer reported no step within {wait_s:g} s, so no steps can be promised "
                "(is it in a long step, or stalled?); ask again"
            )

    async def _plan(self, req: CaptureRequest) -> CaptureReply:
        """Plan ``req`` now: the trainer learns of it before it runs another step."""
        run = self.shell.run
        no = refusal(self.shell, req)
        if no is None:
            planned = run.plan.request_capture(req.warmup, req.active, req.start_step, req.kind)
            no = planned if isinstance(planned, str) else None
        if no is not None:
            if req.kind == "auto":
                return auto_refused(self.shell, req, no)
            return self.shell.capture_no(no)
        assert not isinstance(planned, str)
        keys = capture_keys(self.shell, req)
        await configure_for_capture(self.shell, keys)
        run.capture_ranks[planned.index] = keys
        count_capture(self.shell, req, planned)
        self.shell.save()
        return accepted(run, planned, keys, [])

    def request_auto(self, trigger: AutoTrigger) -> None:
        """The run is slow: ask for an auto capture, planned at the trainer's next waited
        report like any capture (one at a time)."""
        sh = self.shell
        if any(r.kind == "auto" for r in sh.requests):
            return
        cfg = sh.run.config.auto_capture
        req = CaptureRequest(cfg.active, cfg.warmup, None, None, "auto", trigger)
        sh.requests.append(req)
        if spmd_stepping(sh):  # planned now: SPMD ranks never wait for a report's answer
            self._tasks.add(task := asyncio.ensure_future(self._auto_spmd(req)))
            task.add_done_callback(self._tasks.discard)

    async def _auto_spmd(self, req: CaptureRequest) -> None:
        try:
            answer = await self.spmd.plan(req, CAPTURE_REPORT_TIMEOUT_S)
        except Exception as exc:  # (the detector asks again later)
            log.warning("an auto capture for SPMD ranks could not be planned: %s", exc)
            answer = self.shell.capture_no(f"{type(exc).__name__}: {exc}")
        finally:
            if req in self.shell.requests:
                self.shell.requests.remove(req)
        if not req.answer.done():
            req.answer.set_result(answer)

    async def set_auto_capture(self, enable: object) -> AutoCaptureReply:
        sh = self.shell
        async with sh.lock:
            no = flag_problem("enable", enable)
            if no is None and not sh.run.config.enable:
                no = "profiling is disabled in this run's config"
            if no is not None or not isinstance(enable, bool):
                why = sh.refuse("auto_capture", no or "")
                return {"applied": False, "reason": why, "auto_capture": sh.auto_capture_entry()}
            sh.run.auto_override = enable
            if not enable:  # an auto capture not planned yet is dropped with it
                sh.requests = [r for r in sh.requests if r.kind != "auto"]
            sh.run.state.counters[f"auto_capture_switched_{'on' if enable else 'off'}"] += 1
            log.warning("auto capture switched %s by an operator", "on" if enable else "off")
            sh.save()
            return {"applied": True, "reason": None, "auto_capture": sh.auto_capture_entry()}

    async def plan_waiting(self) -> None:
        requests, self.shell.requests = self.shell.requests, []
        for req in requests:
            if not req.answer.done():
                req.answer.set_result(await self._plan(req))

    async def cancel_capture(self, window: int) -> CancelReply:
        """Drop a requested capture that has not opened yet."""
        async with self.shell.lock:
            if not is_int(window):
                return {
                    "cancelled": False,
                    "reason": self.shell.refuse(
                        "cancel", f"window must be an int, got {window!r:.80}"
                    ),
                    "window": -1,
                }
            plan = self.shell.run.plan
            if spmd_stepping(self.shell) and window in plan.promised:
                why: str | None = (
                    f"capture {window} is in the plan SPMD ranks already hold, and a rank "
                    "that had not heard of a cancel would record it alone: it stays"
                )
            else:
                why = plan.cancel_capture(window)
            if why is not None:
                return {
                    "cancelled": False,
                    "reason": self.shell.refuse("cancel", why),
                    "window": window,
                }
            self.shell.run.capture_ranks.pop(window, None)
            self.shell.run.state.counters["captures_cancelled"] += 1
            self.shell.save()
            return {"cancelled": True, "reason": None, "window": window}


async def configure_for_capture(shell: CoordinatorShell, keys: list[Key]) -> None:
    """Ranks the config does not select are configured for this capture only."""
    run = shell.run
    st = run.state
    fresh = [k for k in keys if not st.ranks[k].selected]
    if not fresh:
        return
    for key in fresh:
        st.ranks[key].selected = True
    st.ranks_version += 1
    trainer = st.trainers[fresh[0][0]]  # (only the stepping trainer's ranks are named)
    report_to, run_dir = shell.report_to(trainer.trainer_id), trainer.run_dir
    base, role = run.config.to_dict(), trainer.role

    def args(key: Key) -> tuple[Any, ...]:
        just = {**base, "roles": {**base["roles"], role: {"ranks": [key[1]]}}}
        return (key[1], just, run_dir, False, report_to, role)

    await fan_out(
        run,
        fresh,
        "configure_profiler",
        args,
        timeout=max(CONFIGURE_TIMEOUT_S, run.config.worker_timeout_s),
    )


def request_problem(
    cap: int, active: Any, warmup: Any, ranks: Any, start_step: Any, wait_s: Any
) -> str | None:
    """Why ``request_capture``'s arguments are refused (``cap``: ``max_capture_steps``)."""
    for name, value, low in (("active", active, 1), ("warmup", warmup, 0)):
        if not is_int(value) or not low <= value <= cap:
            return f"{name} must be an int in {low}..{cap} (max_capture_steps), got {value!r:.80}"
    if active + warmup > cap:
        return f"warmup + active = {active + warmup} steps, more than max_capture_steps ({cap})"
    if start_step is not None and (problem := step_problem("start_step", start_step)):
        return problem
    if ranks is not None and (
        not isinstance(ranks, (list, tuple))
        or len(ranks) > MAX_WORLD
        or not all(is_rank(r) for r in ranks)
    ):
        return f"ranks must be None or a list of ints in 0..{MAX_WORLD - 1}, got {ranks!r:.80}"
    if not is_number(wait_s) or not 0 < wait_s <= 3600:
        return f"wait_s must be a number in (0, 3600], got {wait_s!r:.80}"
    return None
