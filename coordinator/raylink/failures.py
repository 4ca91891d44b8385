"""How a failed call to a rank is read, the same in the coordinator and in a node agent."""

from __future__ import annotations

import ray

from coordinator.protocol.reasons import reason
from coordinator.protocol.replies import RankState, Reason

LOST = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError)


def call_failure(method: str, err: BaseException) -> tuple[RankState, Reason]:
    """A rank whose ``method`` call raised ``err``: lost when its actor died, else disabled."""
    state: RankState = "lost" if isinstance(err, LOST) else "disabled"
    return state, reason(method, err)


def no_answer(method: str, timeout: float) -> Reason:
    """Why a rank that did not answer ``method`` within ``timeout`` s is unresponsive."""
    return {
        "where": method,
        "type": "Timeout",
        "message": f"no answer to {method} within {timeout:g} s",
    }
