"""An attached rank 0's step file: its steps where its node agent reads them once the process is
gone (``coordinator.protocol.step_tail``, ``worker_ext.agent.exit_watch``)."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from coordinator.protocol.step_tail import StepTail, process_start, steps_dir

log = logging.getLogger(__name__)


def keep_last_steps(reports: Any, owner: dict[str, Any]) -> str | None:
    """Rank 0's step reports (``StepReports``) also keep each step in this process's step file,
    and the node agent is asked to watch the process (not waited for). ``owner``: the
    coordinator and run to report to (``report_to``), the ``rank`` and its ``generation``; the
    file adds the process (``pid``, ``started``), when it was ``made`` and the Ray
    ``session``. Returns why not (no file then, nothing else changes), else None; never
    raises."""
    try:
        import ray

        from worker_ext.rank.agent_link import _node_agent

        pid, folder = os.getpid(), steps_dir()
        context = ray.get_runtime_context()
        path = folder / f"{pid}.step"
        process = {"pid": pid, "started": process_start(pid), "made": time.time()}
        tail = StepTail.create(path, {**owner, **process, "session": context.get_session_name()})
    except Exception as exc:  # (the steps since the last report are lost at the exit: said)
        return _no_file(exc)
    try:
        _node_agent(context.get_node_id()).watch_exits.remote()
    except Exception as exc:  # (a file nobody watches would outlive the job: removed)
        tail.close()
        return _no_file(exc)
    reports.tail = tail
    return None


def _no_file(exc: Exception) -> str:
    why = f"{type(exc).__name__}: {exc}"
    log.warning("profiler: no step file; the last steps before this process exits will "
                "not be reported (%s)", why)  # fmt: skip
    return why
