"""Node agents found by name, once, off the event loop (``ray.get_actor`` blocks)."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from coordinator.protocol.names import AGENT_NAMESPACE


class AgentHandles:
    """A cache of node agents' handles by actor name."""

    def __init__(self) -> None:
        self._handles: dict[str, Any] = {}

    async def get(self, name: str) -> Any:
        """The agent named ``name``; raises what ``ray.get_actor`` raises (ValueError: none)."""
        handle = self._handles.get(name)
        if handle is None:
            import ray

            loop = asyncio.get_running_loop()
            lookup = functools.partial(ray.get_actor, name, namespace=AGENT_NAMESPACE)
            handle = self._handles[name] = await loop.run_in_executor(None, lookup)
        return handle

    def forget(self, name: str) -> None:
        """The agent failed: look it up again next time."""
        self._handles.pop(name, None)
