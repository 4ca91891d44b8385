"""An attached rank 0's step file: its steps where its node agent reads them once the process is
gone (``coordinator.protocol.step_tail``, ``worker_ext.agent.exit_watch``)."""

from __future__ import annotations

import logging
import os
from typing import Any

from coordinator.protocol.step_tail import StepTail, process_start, steps_dir

log = logging.getLogger(__name__)


def keep_last_steps(reports: Any, owner: dict[str, Any]) -> str | None:
    """Rank 0's step reports (``StepReports``) also keep each step in this process's step file,
    and the node agent is asked to watch the process (not waited for). ``owner``: the
    coordinator to report to (``report_to``), the ``rank`` and its ``generation``. Returns why
    not (nothing else changes then), else None; never raises."""
    try:
        import ray

        from worker_ext.rank.agent_link import _node_agent

        pid = os.getpid()
        path = steps_dir() / f"{pid}.step"
        reports.tail = StepTail.create(path, {**owner, "pid": pid, "started": process_start(pid)})
        _node_agent(ray.get_runtime_context().get_node_id()).watch_exits.remote()
        return None
    except Exception as exc:  # (the steps since the last report are lost at the exit: said)
        why = f"{type(exc).__name__}: {exc}"
        log.warning("profiler: no step file; the last steps before this process exits will "
                    "not be reported (%s)", why)  # fmt: skip
        return why
