"""A rank's side of its node's agent: hand each closed trace over, keep what comes back.

The training thread only queues a job (``submit``). The result arrives on the future's thread
and waits here until the rank's next ``status()`` drains it. A agent that dies, cannot be
started or cannot be reached costs that window's summary, never the rank: the failure is kept
with the raw trace's path, and the coordinator is told at once.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Any

from coordinator.protocol.replies import AgentEntry, AgentError
from worker_ext.agent.trace_jobs import JobResult, TraceJob
from worker_ext.rank.agent_link import AgentLink, default_link

log = logging.getLogger(__name__)


class HandOff:
    """The jobs one rank has handed to its agent, and their results."""

    def __init__(self, rank: int, agent: AgentLink | None, report_to: dict[str, str] | None):
        self.rank = rank
        self.report_to = report_to  # the coordinator the agent pushes summaries to
        self.agent = agent
        self.pid: int | None = None
        self.last_error: AgentError | None = None
        self._ready: list[bytes] = []  # encoded summaries not yet drained
        self._failures: list[AgentError] = []  # windows whose summary is lost, and why
        self._pending: set[int] = set()
        self._cond = threading.Condition()

    def start(self) -> None:
        """Start the agent (at configure time); a failure is kept, never raised."""
        if self.agent is None:
            self.agent = default_link()
        try:
            self.pid = self.agent.prepare()
        except Exception as exc:
            self.agent.forget()
            message = f"the {self.agent.kind} could not be started: {exc}"[:1000]
            self.last_error = AgentError(
                window=None, where="agent", type=type(exc).__name__, message=message
            )
            log.warning("rank %d: %s", self.rank, message)

    def serve_kineto(self, directory: str) -> None:
        """Have the agent play libkineto's daemon in ``directory``; a failure is kept."""
        if self.agent is None:
            return
        try:
            self.agent.serve_kineto(directory)
        except Exception as exc:
            self.last_error = AgentError(
                window=None, where="agent", type=type(exc).__name__, message=str(exc)[:1000]
            )

    def submit(self, job: TraceJob) -> None:
        """Queue ``job`` on the agent; never waits for it, never raises."""
        assert self.agent is not None
        with self._cond:
            self._pending.add(job.window)
        try:
            fut = self.agent.submit(job)
        except Exception as exc:
            self.agent.forget()
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

    def drain(self) -> tuple[list[bytes], list[AgentError], list[int]]:
        """The summaries and failures since the last drain, and the windows still pending."""
        with self._cond:
            summaries, self._ready = self._ready, []
            failures, self._failures = self._failures, []
            return summaries, failures, sorted(self._pending)

    def info(self) -> AgentEntry:
        agent = self.agent
        return {
            "kind": agent.kind if agent is not None else None,
            "pid": self.pid,
            "name": agent.name if agent is not None else None,
        }

    def done(self, job: TraceJob, fut: concurrent.futures.Future[JobResult]) -> None:
        """On the future's thread (not the training thread): record what the agent did."""
        try:
            try:
                res = fut.result()
            except Exception as exc:
                assert self.agent is not None
                self.agent.forget()
                self._lost(job, exc)
                return
            self.pid = res.pid
            with self._cond:
                if res.summary is not None:
                    self._ready.append(res.summary)
                for err in res.errors:
                    failed = AgentError(
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
        except Exception:  # a callback must never raise
            log.debug("recording a agent result failed", exc_info=True)
        finally:
            with self._cond:
                self._pending.discard(job.window)
                self._cond.notify_all()

    def _lost(self, job: TraceJob, exc: BaseException) -> None:
        """The agent died or was unreachable: that window's summary is lost; the trace stays."""
        kind = self.agent.kind if self.agent is not None else "agent"
        err = AgentError(
            window=job.window,
            where="agent",
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
