"""A node agent that has had nothing to do for a while, with no live run to serve, exits.

Agents are detached (they outlive every rank of their node), so without this they would live
until the cluster ends. The idle time is the coordinator's ``agent_idle_exit_s`` (each window
command carries it; 0 never exits); the check asks every coordinator the agent has served
whether its run is live, and one that cannot be reached is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterator

log = logging.getLogger(__name__)
IDLE_EXIT_S = 600.0


class IdleExit:
    """Watches an agent's activity; calls ``leave`` once idle with no live run."""

    def __init__(
        self,
        idle_exit_s: float,
        owners_live: Callable[[], Awaitable[bool]],
        leave: Callable[[], None] | None = None,
    ) -> None:
        self.idle_exit_s = idle_exit_s
        self.owners_live = owners_live
        self.leave = leave or exit_actor
        self.last = time.monotonic()
        self._busy = 0
        self._task: asyncio.Task[None] | None = None

    def touch(self, idle_exit_s: object = None) -> None:
        """Something happened; ``idle_exit_s`` (a number >= 0) replaces the idle time."""
        self.last = time.monotonic()
        if isinstance(idle_exit_s, (int, float)) and math.isfinite(idle_exit_s):
            self.idle_exit_s = max(0.0, float(idle_exit_s))
        if self._task is None:
            with contextlib.suppress(RuntimeError):  # (no running loop: started by a later call)
                self._task = asyncio.get_running_loop().create_task(self._watch())

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Work in progress: never idle while inside."""
        self._busy += 1
        self.touch()
        try:
            yield
        finally:
            self._busy -= 1
            self.touch()

    def idle_for(self) -> float:
        return 0.0 if self._busy else time.monotonic() - self.last

    async def _watch(self) -> None:
        while True:
            limit = self.idle_exit_s
            await asyncio.sleep(max(0.2, min(30.0, limit / 4)) if limit > 0 else 30.0)
            if self.idle_exit_s <= 0 or self.idle_for() < self.idle_exit_s:
                continue
            if await self.owners_live():
                continue
            log.info("node agent idle for %.0f s with no live run: exiting", self.idle_for())
            self.leave()
            return


def exit_actor() -> None:
    """This actor leaves for good (never restarted)."""
    try:
        import ray

        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
    except Exception:
        os._exit(0)
