"""What the node agents report to the coordinator: summaries, lost summaries, stored traces.

Each report names the run it belongs to, so one that arrives after a new run began still lands
in its own run. Anything malformed is refused without touching the run.
"""

from __future__ import annotations

import asyncio
from typing import Any

from coordinator.core.run import Run
from coordinator.core.validate import (
    MAX_SUMMARY_BYTES,
    MAX_TEXT,
    is_int,
    is_rank,
    trainer_id_problem,
)
from coordinator.protocol.partial_codec import MAX_PARTIAL_BYTES
from coordinator.service.fold_queue import FoldQueue
from coordinator.service.node_fanout import YIELD_EVERY
from coordinator.service.shell import CoordinatorShell

MAX_TRACE_REPORTS = 4096
"""Trace reports in one ``traces_stored`` call (a node's ranks, many times over)."""


class AgentReports:
    """``ingest_summary``, ``summary_failed`` and ``trace_stored`` (see the actor's docs)."""

    def __init__(self, shell: CoordinatorShell) -> None:
        self.shell = shell
        self.folds = FoldQueue()

    async def ingest_summary(
        self, trainer_id: str, rank: int, blob: bytes, run: str | None = None
    ) -> bool:
        """A rank's summary, pushed by its node agent as soon as it is built.

        True when the coordinator has it, or never will want it (the agent then drops it).
        """
        if not self._reporter_ok(trainer_id, rank, run):
            return True  # nobody will ever want it: do not make the rank keep it
        if not isinstance(blob, (bytes, bytearray)) or len(blob) > MAX_SUMMARY_BYTES:
            size = (
                f"{len(blob)} bytes"
                if isinstance(blob, (bytes, bytearray))
                else type(blob).__name__
            )
            self.shell.refuse(
                "ingest_summary", f"a summary must be bytes, at most 4 MiB; got {size}"
            )
            return True  # refused before it is decoded; sending it again would not help
        target = self._report_run(trainer_id, rank, run, "unexpected_summaries")
        if target is None:
            return True
        target.state.counters["summaries_pushed"] += 1
        key = (trainer_id, rank)
        window = await self.folds.run(lambda: target.state.ingest_summary(key, blob))
        if window is not None:
            self.shell.refresh_stragglers(target, window)
        self.shell.save(force=False)  # (no metric counts summaries: nothing to export)
        return True

    async def ingest_partial(self, trainer_id: str, blob: bytes, run: str | None = None) -> bool:
        """A node partial (``protocol.partial_codec``): the summaries of one node's ranks.

        True when the coordinator has it, or never will want it; False when it is refused (the
        agent then lets each rank send its own summary).
        """
        if trainer_id_problem(trainer_id) or not (run is None or isinstance(run, str)):
            self.shell.run.state.counters["unexpected_reports"] += 1
            return True
        if not isinstance(blob, (bytes, bytearray)) or len(blob) > MAX_PARTIAL_BYTES:
            size = f"{len(blob)} bytes" if isinstance(blob, (bytes, bytearray)) else type(blob)
            self.shell.refuse(
                "ingest_partial", f"a node partial must be bytes, at most 32 MiB; got {size}"
            )
            return True
        target = self.shell.find_run(run)
        if target is None or trainer_id not in target.state.trainers:
            self.shell.run.state.counters["unexpected_summaries"] += 1
            return True
        target.state.counters["partials_pushed"] += 1
        accepted, window = await self.folds.run_steps(
            lambda: target.state.ingest_partial_steps(trainer_id, blob)
        )
        if window is not None:
            self.shell.refresh_stragglers(target, window)
        self.shell.save(force=False)
        return accepted

    async def summary_failed(
        self, trainer_id: str, rank: int, window: int, reason: Any, run: str | None = None
    ) -> bool:
        """A rank's node agent could not build its summary of ``window`` (or died): say why."""
        if not self._reporter_ok(trainer_id, rank, run) or not is_int(window):
            return False
        target = self._report_run(trainer_id, rank, run, "unexpected_summaries")
        if target is None:
            return False
        if not isinstance(reason, dict):
            self.shell.run.state.counters["unexpected_summaries"] += 1
            return False
        self.shell.save(force=False)
        return target.state.summary_failed((trainer_id, rank), window, _bounded(reason))

    async def trace_stored(
        self,
        trainer_id: str,
        rank: int,
        window: int,
        path: object,
        error: Any = None,
        run: str | None = None,
        local_path: object = None,
        node: object = None,
    ) -> bool:
        """The node agent finished a rank's trace of ``window``: its final ``path``, or why not."""
        ok = self._trace_one(trainer_id, rank, window, path, error, run, local_path, node)
        if ok:
            self.shell.save(force=False)
        return ok

    async def traces_stored(
        self, trainer_id: str, reports: Any, run: str | None = None
    ) -> list[bool]:
        """Several ranks' ``trace_stored`` in one call (a node agent's batch): a list of at most
        ``MAX_TRACE_REPORTS`` dicts with ``rank``, ``window``, ``path`` and optionally ``error``,
        ``local_path`` and ``node``; each judged by itself. Returns one bool per report."""
        if not isinstance(reports, list) or len(reports) > MAX_TRACE_REPORTS:
            what = f"{len(reports)} reports" if isinstance(reports, list) else type(reports)
            self.shell.refuse(
                "traces_stored", f"reports must be a list of at most {MAX_TRACE_REPORTS}; {what}"
            )
            return []
        out: list[bool] = []
        for n, r in enumerate(reports):
            if n % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)
            if not isinstance(r, dict):
                self.shell.run.state.counters["unexpected_trace_reports"] += 1
                out.append(False)
                continue
            args = (r.get("rank"), r.get("window"), r.get("path"), r.get("error"))
            out.append(self._trace_one(trainer_id, *args, run, r.get("local_path"), r.get("node")))
        if any(out):
            self.shell.save(force=False)
        return out

    def _trace_one(
        self,
        trainer_id: Any,
        rank: Any,
        window: Any,
        path: object,
        error: Any,
        run: Any,
        local_path: object,
        node: object,
    ) -> bool:
        if not self._reporter_ok(trainer_id, rank, run) or not is_int(window):
            return False
        target = self._report_run(trainer_id, rank, run, "unexpected_trace_reports")
        if target is None:
            return False
        if not all(v is None or isinstance(v, str) for v in (path, local_path, node)):
            target.state.counters["unexpected_trace_reports"] += 1
            return False
        if error is not None:
            error = _bounded(error if isinstance(error, dict) else {"message": error})
        return target.state.trace_stored(
            (trainer_id, rank),
            window,
            path[:MAX_TEXT] if isinstance(path, str) else None,
            error,
            local_path=local_path[:MAX_TEXT] if isinstance(local_path, str) else None,
            node=node[:128] if isinstance(node, str) else None,
        )

    def _reporter_ok(self, trainer_id: object, rank: object, run: object) -> bool:
        """A node agent's report names a trainer, a rank and a run (or None) of plain types."""
        if trainer_id_problem(trainer_id) or not is_rank(rank):
            self.shell.run.state.counters["unexpected_reports"] += 1
            return False
        return run is None or isinstance(run, str)

    def _report_run(self, trainer_id: str, rank: int, run: str | None, counter: str) -> Run | None:
        """The run a report belongs to, if it knows that rank; else None, counted."""
        target = self.shell.find_run(run)
        if target is None or (trainer_id, rank) not in target.state.ranks:
            self.shell.run.state.counters[counter] += 1
            return None
        return target


def _bounded(reason: dict[Any, Any]) -> dict[str, str]:
    """A reason from a report, as at most 8 short strings."""
    return {str(k): str(v)[:1000] for k, v in list(reason.items())[:8]}
