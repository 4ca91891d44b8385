"""What the framework callbacks share (``trainers.hf_callback``, ``trainers.lightning_callback``):
a ``RankSession`` attached in the rank when training begins, a region around each step, and the
global step as the framework counts it (optimiser steps done: the first step is 1).

This module imports no framework; each callback module imports its own.
"""

from __future__ import annotations

import os
from typing import Any

from worker_ext.rank.rank_session import RankSession

_LIVE: dict[int, FrameworkSteps] = {}  # pid -> the steps whose training began and never ended


class FrameworkSteps:
    """One rank's session, driven by a framework's training events."""

    def __init__(
        self,
        config: Any,
        trainer_id: str,
        role: str = "policy",
        name: str = "profiler",
        namespace: str = "profiler",
    ) -> None:
        self._attach = dict(config=config, trainer_id=trainer_id, role=role, name=name,
                            namespace=namespace)  # fmt: skip
        self.session: RankSession | None = None
        self._region: Any = None
        self._last: int | None = None

    def begin(self, done: int) -> None:
        """Training begins with ``done`` steps already done (a resumed run: the checkpoint's).

        A training of this process that began and never ended (it raised, and the framework
        has no exception hook: Hugging Face's) ends first, as a failed one: its window closes
        and its session slot is freed, so this one attaches."""
        earlier = _LIVE.pop(os.getpid(), None)
        if earlier is not None:
            earlier.end(finished=False)
            earlier.session = None
        if self.session is None:
            self.session = RankSession.attach(**self._attach)
        _LIVE[os.getpid()] = self
        self._last = done
        self.session.start(first_step=done + 1)

    def step_begins(self) -> None:
        """A batch begins: the step's region starts with its first batch."""
        if self.session is not None and self._region is None:
            self._region = self.session.region("step")
            self._region.__enter__()

    def step_ends(self, global_step: int) -> None:
        """A batch ended; ``global_step``: the framework's count of optimiser steps. A batch that
        did not move it (gradient accumulation) is part of the next step."""
        if self.session is None or global_step == self._last:
            return
        if self._region is not None:
            self._region.__exit__(None, None, None)
            self._region = None
        self._last = global_step
        self.session.step(global_step)

    def end(self, finished: bool) -> None:
        """Training ended (``finished``) or raised: see ``RankSession.stop``."""
        if _LIVE.get(os.getpid()) is self:
            del _LIVE[os.getpid()]
        if self.session is not None:
            self.session.stop(end_run=finished)
