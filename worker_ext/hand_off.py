"""A rank's side of its node's helper: hand each closed trace over, keep what comes back.

The training thread only queues a job (``submit``). The result arrives on the future's thread
and waits here until the rank's next ``status()`` drains it. A helper that dies, cannot be
started or cannot be reached costs that window's summary, never the rank: the failure is kept
with the raw trace's path, and the coordinator is told at once.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Any

from coordinator.replies import HelperError, HelperInfo
from worker_ext.node_agent import TraceHelper, default_helper
from worker_ext.trace_jobs import JobResult, TraceJob

log = logging.getLogger(__name__)


class HandOff:
    """The jobs one rank has handed to its helper, and their results."""

    def __init__(self, rank: int, helper: TraceHelper | None, report_to: dict[str, str] | None):
        self.rank = rank
        self.report_to = report_to  # the coordinator the helper pushes summaries to
        self.helper = helper
        self.pid: int | None = None
        self.last_error: HelperError | None = None
        self._ready: list[bytes] = []  # encoded summaries not yet drained
        self._failures: list[HelperError] = []  # windows whose summary is lost, and why
        self._pending: set[int] = set()
        self._cond = threading.Condition()

    def start(self) -> None:
        """Start the helper (at configure time); a failure is kept, never raised."""
        if self.helper is None:
            self.helper = default_helper()
        try:
            self.pid = self.helper.prepare()
        except BaseException as exc:
            self.helper.forget()
            message = f"the {self.helper.kind} could not be started: {exc}"[:1000]
            self.last_error = HelperError(
                window=None, where="helper", type=type(exc).__name__, message=message
            )
            log.warning("rank %d: %s", self.rank, message)

    def submit(self, job: TraceJob) -> None:
        """Queue ``job`` on the helper; never waits for it, never raises."""
        assert self.helper is not None
        with self._cond:
            self._pending.add(job.window)
        try:
            fut = self.helper.submit(job)
        except BaseException as exc:
            self.helper.forget()
            self._lost(job, exc)
            return
        fut.add_done_callback(lambda f: self.done(job, f))

    def is_pending(self, window: int) -> bool:
        with self._cond:
            return window in self._pending

    def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` until no job is pending."""
        with self._cond:
            self._cond.wait_for(lambda: not self._pending, timeout=max(0.0, timeout_s))

    def drain(self) -> tuple[list[bytes], list[HelperError], list[int]]:
        """The summaries and failures since the last drain, and the windows still pending."""
        with self._cond:
            summaries, self._ready = self._ready, []
            failures, self._failures = self._failures, []
            return summaries, failures, sorted(self._pending)

    def info(self) -> HelperInfo:
        return {"kind": self.helper.kind if self.helper is not None else None, "pid": self.pid}

    def done(self, job: TraceJob, fut: concurrent.futures.Future[JobResult]) -> None:
        """On the future's thread (not the training thread): record what the helper did."""
        try:
            try:
                res = fut.result()
            except BaseException as exc:
                assert self.helper is not None
                self.helper.forget()
                self._lost(job, exc)
                return
            self.pid = res.pid
            with self._cond:
                if res.summary is not None:
                    self._ready.append(res.summary)
                for err in res.errors:
                    failed = HelperError(
                        window=job.window,
                        where=err["where"],
                        type=err["type"],
                        message=err["message"],
                        trace_path=res.trace_path,
                    )
                    self.last_error = failed
                    if err["where"] == "summary":
                        self._failures.append(failed)
                if res.errors:
                    log.warning("rank %d: %s", self.rank, self.last_error)
        except BaseException:  # a callback must never raise
            log.debug("recording a helper result failed", exc_info=True)
        finally:
            with self._cond:
                self._pending.discard(job.window)
                self._cond.notify_all()

    def _lost(self, job: TraceJob, exc: BaseException) -> None:
        """The helper died or was unreachable: that window's summary is lost; the trace stays."""
        kind = self.helper.kind if self.helper is not None else "helper"
        err = HelperError(
            window=job.window,
            where="helper",
            type=type(exc).__name__,
            message=(
                f"the {kind} died or could not be reached before it finished "
                f"window {job.window} (its summary is lost unless it had been pushed); the raw "
                f"trace stays at {job.raw_path}: {exc}"
            )[:1000],
            trace_path=job.raw_path,
        )
        with self._cond:
            self.last_error = err
            self._failures.append(err)
            self._pending.discard(job.window)
            self._cond.notify_all()
        log.warning("rank %d: %s", self.rank, err["message"])
        if self.report_to:
            # Never call Ray from a future's callback: it may run on Ray's own I/O thread.
            threading.Thread(
                target=_notify_failure,
                args=(self.report_to, self.rank, job.window, err),
                name="profiler-notify",
                daemon=True,
            ).start()


def _notify_failure(report_to: dict[str, str], rank: int, window: int, err: dict[str, Any]) -> None:
    """Tell the coordinator at once (one call, not awaited); the reply path tells it again."""
    try:
        import ray

        handle = ray.get_actor(report_to["name"], namespace=report_to["namespace"])
        handle.summary_failed.remote(report_to["trainer_id"], rank, window, err)
    except Exception:
        log.debug("could not tell the coordinator about a lost summary", exc_info=True)
