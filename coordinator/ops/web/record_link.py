"""What ``ray-profiler serve --from`` serves: a run's record, through the server's link calls."""

from __future__ import annotations

from typing import Any

from coordinator.ops.recorded import ReadOnly, RecordedCoordinator
from coordinator.ops.web.server import Conflict, _refused


class RecordLink:
    """A ``CoordinatorLink`` of a record: its reads answered from it, every change refused."""

    def __init__(self, recorded: RecordedCoordinator) -> None:
        self.recorded = recorded
        self.read_only = (
            f"read-only: the record of run {recorded.rec.run.name} at {recorded.rec.url}; "
            "nothing here changes a run (captures need a live coordinator)"
        )

    def handle(self) -> Any:
        """What ``collect_window`` and ``merge_window`` take: the record, whose traces they
        read from ``save_path`` here."""
        return self.recorded

    async def call(self, method: str, *args: Any, timeout: float = 0.0, **kw: Any) -> Any:
        try:
            return await self.recorded.call(method, *args, **kw)
        except ReadOnly as exc:
            raise Conflict(f"{self.read_only}: {exc}") from None
        except ValueError as exc:
            raise _refused(exc) from None
