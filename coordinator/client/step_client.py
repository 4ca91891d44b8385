"""StepClient: the trainer's side of the step protocol, nearly free on steps outside windows.

Every coordinator reply names ``next_sync_step``, the first step whose report makes ranks act.
From that step on the client reports every step and waits for the acknowledgement, so the
ranks' profilers are in the right state before the next training step starts. Before it, a
report changes nothing on any rank: the client sends one at most every ``report_interval_s``
without waiting, and says so (``waiting=False``; Ray keeps one caller's calls to an actor in
order), so the coordinator's ``global_step`` trails by at most that long, and ``stop()``
reports the last step. A capture requested at run time makes the coordinator answer the next
report with ``next_sync_step`` = the next step: the client then waits, and the coordinator
plans the capture while it does, so the promised steps are the recorded ones.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray

from coordinator.client.phase_buffer import PhaseBuffer

_MAX_IN_FLIGHT = 64


class StepClient:
    """Reports steps to a coordinator for one trainer; see the module docstring."""

    def __init__(
        self,
        coordinator: Any,
        trainer_id: str,
        report_interval_s: float = 0.1,
        timeout_s: float | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.trainer_id = trainer_id
        self.report_interval_s = report_interval_s
        self.timeout_s = timeout_s  # the longest a report waits for its answer (None: no limit)
        self.next_sync_step: int | None = 0
        self.last_reply: dict[str, Any] | None = None
        self._in_flight: list[Any] = []
        self._last_sent = 0.0
        self._unreported: int | None = None
        self.phases = PhaseBuffer()  # the records waiting for a report (a coordinator away)

    def start(self, first_step: int) -> dict[str, Any]:
        """Blocking: the coordinator prepares the ranks for ``first_step``."""
        ref = self.coordinator.start.remote(self.trainer_id, first_step, throttled=True)
        return self._absorb(ray.get(ref, timeout=self.timeout_s))

    def add_phases(self, record: list[Any] | None) -> None:
        """A step's phase record; it rides on the next report sent (never a call of its own)."""
        if record is not None:
            self.phases.add(record)

    def step(self, k: int) -> dict[str, Any] | None:
        """Report that global step ``k`` finished; waits only when ranks must act."""
        if self._in_flight:  # learn of new captures as soon as a reply is back
            self.drain(block=False)
        if self.next_sync_step is not None and k >= self.next_sync_step:
            ref = self._send(k, waiting=True)
            self.drain(block=True)
            return self._absorb(ray.get(ref, timeout=self.timeout_s))
        if time.monotonic() - self._last_sent < self.report_interval_s:
            self._unreported = k
            return None
        self._in_flight.append(self._send(k, waiting=False))
        if len(self._in_flight) > _MAX_IN_FLIGHT:
            self.drain(block=True)
        return None

    def stop(self) -> dict[str, Any]:
        """Blocking: report the last step, close an open window, collect pending summaries."""
        if self._unreported is not None:
            self._in_flight.append(self._send(self._unreported, waiting=False))
        self.drain(block=True)
        ref = self.coordinator.stop.remote(self.trainer_id)
        return self._absorb(ray.get(ref, timeout=self.timeout_s))

    # The asyncio forms: the same protocol, awaiting instead of blocking the event loop.

    async def astart(self, first_step: int) -> dict[str, Any]:
        ref = self.coordinator.start.remote(self.trainer_id, first_step, throttled=True)
        return self._absorb(await asyncio.wait_for(ref, self.timeout_s))

    async def astep(self, k: int) -> dict[str, Any] | None:
        if self._in_flight:
            self.drain(block=False)  # ray.wait with timeout 0 does not block the loop
        if self.next_sync_step is not None and k >= self.next_sync_step:
            ref = self._send(k, waiting=True)
            await self.adrain()
            return self._absorb(await asyncio.wait_for(ref, self.timeout_s))
        if time.monotonic() - self._last_sent < self.report_interval_s:
            self._unreported = k
            return None
        self._in_flight.append(self._send(k, waiting=False))
        if len(self._in_flight) > _MAX_IN_FLIGHT:
            await self.adrain()
        return None

    async def astop(self) -> dict[str, Any]:
        if self._unreported is not None:
            self._in_flight.append(self._send(self._unreported, waiting=False))
        await self.adrain()
        ref = self.coordinator.stop.remote(self.trainer_id)
        return self._absorb(await asyncio.wait_for(ref, self.timeout_s))

    async def adrain(self) -> None:
        refs, self._in_flight = self._in_flight, []
        for ref in refs:
            self._absorb(await asyncio.wait_for(ref, self.timeout_s))

    def resync(self) -> None:
        """After the coordinator came back: wait for the next report's answer, to learn where
        the plan stands (``next_sync_step``) before sending reports without waiting again."""
        self.next_sync_step = 0

    def forget_in_flight(self) -> None:
        """Drop the reports whose answers will never come (the coordinator went down)."""
        self._in_flight = []
        self._unreported = None

    def _send(self, k: int, waiting: bool) -> Any:
        self._last_sent = time.monotonic()
        self._unreported = None
        records, walls = self.phases.take()
        return self.coordinator.step.remote(self.trainer_id, k, waiting, records, walls)

    def drain(self, block: bool = False) -> None:
        """Absorb replies of unacknowledged reports (raises what ``ray.get`` raises)."""
        if not self._in_flight:
            return
        if block:
            done, _ = ray.wait(
                self._in_flight, num_returns=len(self._in_flight), timeout=self.timeout_s
            )
            if len(done) < len(self._in_flight):
                raise TimeoutError(f"no answer from the coordinator within {self.timeout_s} s")
        else:
            done, _ = ray.wait(self._in_flight, num_returns=len(self._in_flight), timeout=0)
        if not done:
            return
        done_set = set(done)
        replies = ray.get(list(done))
        self._in_flight = [r for r in self._in_flight if r not in done_set]
        for reply in replies:
            self._absorb(reply)

    def _absorb(self, reply: dict[str, Any]) -> dict[str, Any]:
        self.last_reply = reply
        if "next_sync_step" in reply:
            self.next_sync_step = reply["next_sync_step"]
        return reply


def wait_for_traces(coordinator: Any, timeout_s: float = 60.0) -> list[int]:
    """Wait until the node agents have finished every closed window's traces (compressed,
    folded or cleaned up); returns the windows still pending when ``timeout_s`` ran out.

    One ``status()`` names the windows with traces pending; then the coordinator's
    ``wait_window`` wakes this call as each one is done (no polling).
    """
    deadline = time.monotonic() + timeout_s
    windows = ray.get(coordinator.status.remote())["windows"]
    late = []
    pending = [w for w in windows if any(p["traces_pending"] for p in w["roles"].values())]
    for index in [w["index"] for w in pending]:
        left = max(0.0, deadline - time.monotonic())
        ref = coordinator.wait_window.remote(index, until="traces", timeout_s=left)
        if not ray.get(ref, timeout=left + 30)["done"]:
            late.append(index)
    return late
