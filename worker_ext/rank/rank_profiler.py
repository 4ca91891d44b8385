"""RankProfiler: drives torch.profiler for one rank, one window at a time, without ever crashing it.

Every guard from torch-profiler-facts.md lives here:
- ``stop()`` is called at most once per torch profiler object;
- nothing escapes ``on_trace_ready``;
- every torch call comes from the thread that first touched the profiler;
- at most one profiler runs in the process, and never on top of someone else's.
Any fault disables profiling on this rank for the rest of the run and is reported in
``status()``; it is never raised to the caller.

Stopping a window costs the training process torch's ``stop()``, the raw chrome trace export and
the free of torch's results (in that closing step, not in whichever later step a garbage
collection reaches them), nothing else: the summary, compression, folded stacks and the push to
the coordinator run in the node's agent process (``worker_ext.agent.node_agent``), which reads
the trace from disk.
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Literal

import torch

from coordinator.core.config import ProfilerConfig
from coordinator.core.schedule import Window
from coordinator.core.storage import is_remote
from coordinator.protocol.reasons import is_exit
from coordinator.protocol.replies import ClosedWindow, Phase, RankReply, Reason
from worker_ext.agent.trace_jobs import TraceJob
from worker_ext.rank.agent_link import AgentLink, node_id
from worker_ext.rank.cpu_wait import Reading, per_step, run_delay_ns, waited_ns
from worker_ext.rank.hand_off import HandOff
from worker_ext.rank.memory_snapshot import MemorySnapshots
from worker_ext.rank.stack_dump import enable_stack_dump
from worker_ext.rank.torch_session import (
    TraceTarget,
    activities,
    claim,
    export_trace,
    free_results,
    local_run_dir,
    other_profiler_reason,
    pick_device,
    release,
    trace_job,
    window_profiler,
)

log = logging.getLogger(__name__)


@dataclass
class _Closing:
    """The window being stopped, as the trace handler needs it."""

    window: Window
    steps: tuple[int, int] | None
    partial: bool
    trace_path: str | None = None
    job: TraceJob | None = None  # the written trace's job, handed to the agent after the stop
    cpu_wait_ns: int | None = None  # the recorded steps' wait for a CPU, a step (``cpu_wait``)
    exit: BaseException | None = None  # an interpreter exit caught in the trace handler


class RankProfiler:
    """Profiles one rank on commands that name the global step.

    ``start_window(window, step)`` before training step ``step`` runs; ``step(k)`` after step k
    finished; ``stop_window()`` to close an open window early (partial). Each returns
    ``status()``, which drains the encoded summaries that are ready.
    """

    def __init__(
        self,
        rank: int,
        config: ProfilerConfig,
        run_directory: str | None,
        *,
        warm_up: bool = True,
        refuse_reason: str | None = None,
        report_to: dict[str, str] | None = None,
        agent: AgentLink | None = None,
        role: str = "policy",
    ) -> None:
        self.rank = int(rank)
        self.role = role
        self.config = config
        # Where this rank writes: the run directory, or its staging copy on this node when the
        # run directory is a URL (the node agent uploads each finished trace there).
        self.remote_run_dir = run_directory if run_directory and is_remote(run_directory) else None
        self.run_directory, refused = local_run_dir(config, run_directory, self.remote_run_dir)
        refuse_reason = refuse_reason or refused  # (a staging directory refused)
        self.node_id = node_id()
        self.selected = bool(config.enable and config.selects(self.rank, role))
        self.report_to = report_to  # the coordinator the agent pushes summaries to
        self.hand_off = HandOff(self.rank, agent, report_to)
        self.windows_captured = 0
        self.windows_skipped = 0
        self.last_trace_path: str | None = None
        self.last_skip_reason: str | None = None
        self.fault: Reason | None = None
        self._owner_thread: int | None = None
        self._prof: Any = None
        self._window: Window | None = None
        self._recorded_first: int | None = None
        self._waited_from: Reading | None = None  # run_delay_ns as the recorded steps began
        self._last_done: int | None = None
        self._closing: _Closing | None = None
        self._closed: ClosedWindow | None = None
        self._abandoned: list[Any] = []  # torch objects we must never touch again
        self.device, self.note = pick_device(config)
        self.stack_dump = enable_stack_dump()  # so the node agent can read a stuck rank
        self.snapshots = MemorySnapshots.of(self)  # CUDA memory snapshots (when asked for)
        self.note = "; ".join(filter(None, [self.note, self.snapshots.problem])) or None
        if not self.selected:
            return
        if refuse_reason:
            self._disable("configure", RuntimeError(refuse_reason))
            return
        if run_directory is None:
            self._disable("configure", ValueError("no run directory was given"))
            return
        if warm_up:
            self._guarded("warm_up", self._warm_up)
        self.hand_off.start()

    # ----------------------------------------------------------------- commands

    def start_window(self, window: Window, step: int) -> RankReply:
        """Start ``window``; training step ``step`` is the next one to run."""
        return self._guarded("start_window", self._start, window, int(step))

    def step(self, k: int) -> RankReply:
        """Global step ``k`` has finished."""
        return self._guarded("step", self._step, int(k))

    def stop_window(self) -> RankReply:
        """Stop the open window now as a partial window; a no-op when none is open."""
        return self._guarded("stop_window", self._stop_if_open)

    def finish(self, timeout_s: float) -> None:
        """Before this process ends: up to ``timeout_s`` for what only it can still write
        (nothing here: torch wrote each window's trace at the window's end)."""

    def wait_for_summaries(self, timeout_s: float) -> RankReply:
        """Wait up to ``timeout_s`` for pending summaries, then return the status."""
        self.hand_off.wait(timeout_s)
        return self.status()

    @property
    def phase(self) -> Phase:
        if self._window is None or self._prof is None:
            return "idle"
        return "recording" if self._recorded_first is not None else "warmup"

    def status(self) -> RankReply:
        """A small, msgpack- and JSON-friendly status; drains ready summaries."""
        summaries, failures, pending = self.hand_off.drain()
        closed, self._closed = self._closed, None
        state: Literal["ok", "disabled", "not_selected"] = (
            "not_selected" if not self.selected else "disabled" if self.fault else "ok"
        )
        return {
            "rank": self.rank,
            "node_id": self.node_id,
            "state": state,
            "reason": Reason(**self.fault) if self.fault else None,
            "device": self.device,
            "note": self.note,
            "phase": self.phase,
            "window": self._window.index if self._window is not None else None,
            "windows_captured": self.windows_captured,
            "windows_skipped": self.windows_skipped,
            "last_skip_reason": self.last_skip_reason,
            "last_trace_path": self.last_trace_path,
            "closed": closed,
            "summaries": summaries,
            "summary_failures": failures,
            "summaries_pending": pending,
            "agent": self.hand_off.info(),
            "last_agent_error": self.hand_off.last_error,
            "pid": os.getpid(),
            "stack_dump": self.stack_dump,
        }

    # ------------------------------------------------------------------ guards

    def _guarded(self, where: str, fn: Any, *args: Any) -> RankReply:
        if not self.selected:
            return self.status()
        me = threading.get_ident()
        if self._owner_thread is None:
            self._owner_thread = me
        elif me != self._owner_thread:
            # torch.profiler segfaults when driven from two threads: refuse without touching it.
            self._disable(
                where,
                RuntimeError(
                    "profiler calls arrived on a second thread (a threaded actor?); "
                    "torch.profiler must be driven from one thread"
                ),
            )
            return self.status()
        exit_exc: BaseException | None = None
        if self.fault is None:
            try:
                fn(*args)
            except BaseException as exc:  # a profiler fault must never reach training
                self._disable(where, exc)
                exit_exc = exc if is_exit(exc) else None
        if self.fault is not None:
            self._teardown()
        if exit_exc is not None:
            raise exit_exc  # Ctrl-C or sys.exit: the profiler is safe, the exit is the user's
        return self.status()

    def _disable(self, where: str, exc: BaseException) -> None:
        if self.fault is None:
            self.fault = {"where": where, "type": type(exc).__name__, "message": str(exc)[:2000]}
            log.warning(
                "profiling disabled on rank %d (%s: %s: %s)",
                self.rank,
                where,
                type(exc).__name__,
                exc,
            )
            log.debug("".join(traceback.format_exception(exc)))

    def _teardown(self) -> None:
        """After a fault: stop a live profiler once, writing nothing; never touch it again."""
        prof, self._prof = self._prof, None
        self._window = None
        self._recorded_first = None
        self._closing = None  # the trace handler then exports nothing
        if prof is None:
            release(self)
            return
        self._abandoned.append(prof)
        if getattr(prof, "_rank_profiler_stopped", True):
            release(self)
            return
        prof._rank_profiler_stopped = True
        try:
            prof.stop()
        except Exception:
            log.debug("stop after a fault raised; the profiler is abandoned", exc_info=True)
        finally:
            release(self)

    # ------------------------------------------------------------ torch calls

    def _warm_up(self) -> None:
        """Pay Kineto's one-off initialisation now rather than in a window's first step."""
        if other_profiler_reason(self) or not claim(self):
            return  # never take over someone else's session just to warm up
        try:
            prof = torch.profiler.profile(activities=activities(self.device))
            self._abandoned.append(prof)  # in case start raises: never stop it
            prof.start()
            prof._rank_profiler_stopped = True
            prof.stop()
            free_results(prof)
            self._abandoned.remove(prof)
        finally:
            release(self)

    def _start(self, window: Window, step: int) -> None:
        if not may_start(self, window, step):
            return
        prof = window_profiler(
            self.config, self.device, self.rank, window, step, self._on_trace_ready, self.role
        )
        prof._rank_profiler_stopped = False
        if not claim(self):
            raise RuntimeError("another RankProfiler in this process holds the profiler")
        self._abandoned.append(prof)  # if start raises, it is never stopped
        prof.start()
        self._abandoned.remove(prof)
        self._prof, self._window = prof, window
        self.snapshots.window_started()
        self._recorded_first = step if step >= window.first else None
        self._waited_from = run_delay_ns() if step >= window.first else None
        self._last_done = None

    def _step(self, k: int) -> None:
        prof, w = self._prof, self._window
        if prof is None or w is None or k < prof.step_num:
            return  # no window open, or a stale step: nothing to do
        self._last_done = k
        if k >= w.last:
            self._stop(partial=False)
            return
        prof.step_num = k  # a skipped step keeps the global numbering
        prof.step()
        if self._recorded_first is None and k + 1 >= w.first:
            self._recorded_first = k + 1
            self._waited_from = run_delay_ns()

    def _stop_if_open(self) -> None:
        if self._prof is not None:
            self._stop(partial=True)

    def _stop(self, partial: bool) -> None:
        prof, w = self._prof, self._window
        assert w is not None  # a profiler is open only with its window
        first, last = self._recorded_first, self._last_done
        steps = (first, last) if first is not None and last is not None and last >= first else None
        waited = per_step(waited_ns(self._waited_from), steps)
        self._closing = _Closing(w, steps, partial, cpu_wait_ns=waited)
        try:
            prof._rank_profiler_stopped = True
            prof.stop()  # runs _on_trace_ready while recording
            free_results(prof)  # in this closing step, not in whichever step a collection hits
        finally:
            self._prof = None
            self._window = None
            self._recorded_first = None
            release(self)
            closing, self._closing = self._closing, None
            if closing is not None and closing.job is not None:
                # Only now, and even if stop() raised once the trace was written: the agent's
                # parse never competes with torch's stop, export or free for the node's cores.
                self.hand_off.submit(closing.job)
        self.snapshots.window_ended(closing.job if closing is not None else None)
        self._closed = ClosedWindow(
            window=w.index,
            steps=list(steps) if steps else None,
            partial=partial,
            trace_path=closing.trace_path if closing else None,
        )
        if steps is not None and self.fault is None:
            self.windows_captured += 1
            if closing and closing.trace_path:
                self.last_trace_path = closing.trace_path
        if closing is not None and closing.exit is not None:
            raise closing.exit  # caught in the trace handler; torch's stop() has returned

    def _on_trace_ready(self, prof: Any) -> None:
        """Runs inside torch's stop(): write the raw trace (``_stop`` hands it off). Never
        raises: an exception escaping here segfaults the next stop(), so even an interpreter exit
        (Ctrl-C) is kept and raised by ``_stop`` once torch's stop() has returned."""
        try:
            closing = self._closing
            if closing is None or closing.steps is None or self.fault is not None:
                return
            assert self.run_directory is not None
            where = TraceTarget(
                self.rank, self.device, self.run_directory, self.remote_run_dir, self.role
            )
            job = trace_job(
                self.config, where, closing.window, closing.steps, closing.partial,
                self.report_to, closing.cpu_wait_ns,
            )  # fmt: skip
            export_trace(prof, job)
            closing.trace_path = job.upload_to or job.final_path
            closing.job = job
        except BaseException as exc:  # noqa: BLE001 - re-raised by _stop when an exit
            self._disable("export", exc)
            if is_exit(exc) and self._closing is not None:
                self._closing.exit = exc


def may_start(rp: RankProfiler, window: Window, step: int) -> bool:
    """Whether ``rp``'s ``window`` opens now (every engine's start asks): not twice, nor
    while another profiler runs (skipped, and said); a window still open is stopped first."""
    if rp._window is not None and rp._window.index == window.index:
        return False  # told twice (a relay that failed after delivering it): recording
    rp._stop_if_open()  # a window still open stops before the next one starts
    if step > window.last:
        raise ValueError(f"start_window at step {step} after window {window.index} ended")
    busy = other_profiler_reason(rp)
    if busy:
        rp.windows_skipped += 1
        rp.last_skip_reason = f"window {window.index} skipped: {busy}"
        log.warning("rank %d: %s", rp.rank, rp.last_skip_reason)
        return False
    return True
