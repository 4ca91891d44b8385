"""The stall watchdog: a timer on the coordinator that takes every stack when steps stop coming.

The step path only stamps the time of each report (``StallWatch.observe``, O(1)); this timer
reads the stamp once a second. When the stepping trainer of a running run has reported no step
for ``max(stall_factor x median step time, stall_min_s)``, it takes stacks once (and asks CUDA
ranks for their NCCL Flight Recorder dump), records the stall in ``status()["stalls"]`` and as
``<run dir>/stalls/stall_<n>.json``, logs one line and counts it (``profiler_stalls``). It
takes stacks again with backoff while the stall lasts, and marks the stall resumed when a step
comes. An attached trainer whose job has ended (its ranks have no loop end to say so) is no
stall: its run ends at its last step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from coordinator.core.run import Run
from coordinator.core.stall_watch import StallWatch
from coordinator.core.storage import is_remote
from coordinator.protocol.atomic_file import write_atomic
from coordinator.protocol.stack_replies import StacksReply, StallEntry
from coordinator.service.rank_exits import end_if_job_ended
from coordinator.service.shell import CoordinatorShell
from coordinator.service.stacks import StackCalls

log = logging.getLogger(__name__)
TICK_S = 1.0


class StallWatchdog:
    """See the module docstring; ``history`` (the shell's ``stalls``) is ``status()["stalls"]``."""

    def __init__(
        self, shell: CoordinatorShell, stacks: StackCalls, end_run: Callable[[str, str], Any]
    ) -> None:
        self.shell, self.stacks, self.end_run = shell, stacks, end_run
        self.history = shell.stalls
        self.current: StallEntry | None = None
        self._task: asyncio.Task[None] | None = None
        self._busy = False

    def start(self) -> None:
        """Start the timer (once; from the event loop)."""
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                await self.tick(time.monotonic())
            except Exception:  # the watchdog must outlive its own faults
                log.exception("stall watchdog tick failed")

    async def tick(self, now: float) -> None:
        """Look at the stepping trainer's last report once; take stacks when due."""
        run, watch = self.shell.run, self.shell.stall_watch
        if self.current is not None and (watch.stalled_at is None or run.lifecycle != "running"):
            self._ended(watch, now)
        if self._busy or run.lifecycle != "running" or not run.config.stall_watch:
            return
        due = watch.due(now)
        if due is None:
            return
        self._busy = True
        try:
            if due != "stall" or not await self._job_ended(run):
                await self._take(run, watch, now, first=due == "stall")
        finally:
            self._busy = False

    async def _job_ended(self, run: Run) -> bool:
        """The stepping trainer's steps stopped because its job ended (its ranks are attached
        ones: no loop end tells the coordinator): the run ends then, at its last reported step
        (``rank_exits.end_if_job_ended``), instead of a stall on processes that are gone."""
        return await end_if_job_ended(run, self.end_run)

    async def _take(self, run: Run, watch: StallWatch, now: float, first: bool) -> None:
        watch.took(now)
        if first:
            self.current = self._new_entry(run, watch, now)
        entry = self.current
        assert entry is not None
        fr_dir = _local(run, f"stalls/stall_{entry['index']}_flight_recorder") if first else None
        try:
            reply = await self.stacks.stacks(flight_recorder_dir=fr_dir)
            _record(entry, reply, watch.takes)
        except Exception as exc:
            entry["error"] = f"stacks: {type(exc).__name__}: {exc}"[:300]
            reply = None
        if first:  # recorded with its stacks, never without
            self.history.append(entry)
            run.state.counters["stalls"] += 1
            self.shell.metrics.export(run.state)
            log.warning(
                "stall: no step from %s for %.0f s after step %s; %s",
                entry["trainer_id"],
                now - (watch.last_at or now),
                entry["last_step"],
                entry["culprit"] or f"{len(entry['lines'])} stack groups (status()['stalls'])",
            )
        await self._write(run, entry, reply)

    def _new_entry(self, run: Run, watch: StallWatch, now: float) -> StallEntry:
        wall = time.time()
        return {
            # numbered per run, from its checkpointed counter: a restart never reuses a file name
            "index": run.state.counters["stalls"] + 1,
            "trainer_id": run.state.stepping_trainer or "",
            "detected_at": wall,
            "last_step": watch.last_step,
            "last_step_at": wall - (now - (watch.last_at or now)),
            "threshold_s": watch.threshold_s(),
            "median_step_s": watch.median_step_s(),
            "takes": 0,
            "resumed_at": None,
            "resumed_step": None,
            "culprit": None,
            "lines": [],
            "flight_recorder": {},
            "path": None,
            "error": None,
        }

    def _ended(self, watch: StallWatch, now: float) -> None:
        """Steps came back (or the run stopped): close the current stall."""
        entry, self.current = self.current, None
        if entry is None or watch.resumed is None or watch.stalled_at is not None:
            return
        step, at = watch.resumed
        entry["resumed_at"] = time.time() - (now - at)
        entry["resumed_step"] = step
        with contextlib.suppress(Exception):
            asyncio.ensure_future(self._write(self.shell.run, entry, None))

    async def _write(self, run: Run, entry: StallEntry, reply: StacksReply | None) -> None:
        """The stall's JSON file in the run's directory (a local one; a URL gets none)."""
        folder = _local(run, "stalls")
        if folder is None:
            entry["error"] = entry["error"] or "the run directory is not local: no stall file"
            return
        path = os.path.join(folder, f"stall_{entry['index']}.json")
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, _dump, path, entry, reply)
            entry["path"] = path
        except Exception as exc:  # a full disk, or a reply that will not serialise: said
            entry["error"] = f"stall file: {type(exc).__name__}: {exc}"[:300]
            log.warning("stall %s: no file written at %s: %s", entry["index"], path, entry["error"])


def _local(run: Run, sub: str) -> str | None:
    if not run.run_dir or is_remote(run.run_dir):
        return None
    return os.path.join(run.run_dir, sub)


def _record(entry: StallEntry, reply: StacksReply, takes: int) -> None:
    entry["takes"] = takes
    entry["culprit"], entry["lines"] = reply["culprit"], reply["lines"]
    for e in reply["entries"]:
        if e["flight_recorder"] is not None:
            who = "driver" if e["rank"] is None else str(e["rank"])
            entry["flight_recorder"][f"{e['trainer_id']}/{who}"] = e["flight_recorder"]


def _dump(path: str, entry: StallEntry, reply: StacksReply | None) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    old: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError), open(path) as f:
        old = json.load(f)
    body = {"stall": entry, "stacks": reply if reply is not None else old.get("stacks")}
    write_atomic(path, json.dumps(body, indent=1, default=str))
