"""Window diffs and regression marks: ``kernel_diff(a, b)``, ``pin_baseline``, and the marks
``status()`` shows on each window against its run's baseline.

The baseline is the window the operator pinned (``pin_baseline``), else the run's first
scheduled window that recorded what it planned with every summary in. Each trainer's part of a
window is judged once, when the window's summaries are all in, against that trainer's earlier
windows from the baseline on (``coordinator/core/marks.py``: beyond the run's own spread, by
``regression_threshold`` or more, and by a share of the step that matters).
"""

from __future__ import annotations

import asyncio
from typing import Any

from coordinator.core.marks import (
    WindowProfile,
    confirm,
    judge,
    pick_reference,
    profile,
    slower,
)
from coordinator.core.records import WindowRecord
from coordinator.core.run import Run
from coordinator.core.validate import is_int
from coordinator.core.window_diff import kernel_diff
from coordinator.protocol.replies import BaselineReply, KernelDiffReply, RegressionEntry
from coordinator.service.readers import Readers
from coordinator.service.shell import CoordinatorShell

CHEAP_KERNELS = 400
"""Up to this many kernels in the two windows together, a diff is made on the event loop."""

ALL_KERNELS = 100_000


class Diffs:
    """See the module docstring."""

    def __init__(self, shell: CoordinatorShell, readers: Readers) -> None:
        self.shell, self.readers = shell, readers
        self._cannot: set[tuple[str, int, str]] = set()  # (run, window, trainer): no table
        self._marking: tuple[Run, asyncio.Future[None]] | None = None

    async def kernel_diff(
        self, a: Any, b: Any, run_a: Any, run_b: Any, trainer_id: Any, top_k: Any
    ) -> KernelDiffReply:
        if not is_int(top_k) or not 0 <= top_k <= ALL_KERNELS:
            raise ValueError(f"top_k must be an int in 0..{ALL_KERNELS}, got {top_k!r:.80}")
        for name, w in (("a", a), ("b", b)):
            if not is_int(w):
                raise ValueError(f"{name} must be a window's index, got {w!r:.80}")
        sa = await self.readers.kernel_summary(a, ALL_KERNELS, trainer_id, False, run_a)
        sb = await self.readers.kernel_summary(b, ALL_KERNELS, trainer_id, False, run_b)
        for name, s in (("a", sa), ("b", sb)):
            if not s["ranks"]:
                raise ValueError(f"window {s['window']} ({name}) has no summary to compare yet")
        if len(sa["kernels"]) + len(sb["kernels"]) <= CHEAP_KERNELS:
            return kernel_diff(sa, sb, top_k)
        # A few thousand kernels each (a window's mark compares them all): off the event
        # loop, as a large window's table is made (49 ms of one turn at 10,000 ranks).
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.shell.reads, kernel_diff, sa, sb, top_k)

    async def pin_baseline(self, window: Any) -> BaselineReply:
        run = self.shell.run
        if window is not None:
            if not is_int(window):
                raise ValueError(f"window must be a window's index or None, got {window!r:.80}")
            rec = run.state.windows.get(window)
            if rec is None or not rec.closed:
                known = [w.window.index for w in run.state.closed_windows()]
                raise ValueError(f"no closed window {window} in run {run.name}: closed {known}")
        if self._marking is not None:  # (a marking under way against the old baseline ends
            await asyncio.shield(self._marking[1])  # before the marks are cleared)
        async with self.shell.lock:
            run.baseline = window
            for rec in run.state.windows.values():  # marked again, against the new baseline
                rec.marks = {}
            self.shell.save()
        await self.mark(run)
        return {"run": run.name, "baseline": baseline(run), "pinned": window is not None}

    async def mark(self, run: Run) -> None:
        """Mark every settled window of ``run`` not marked yet (status() calls it). Calls that
        come while a marking of the same run is under way wait for it, not make their own (a
        mark of a large window builds two full tables off the loop)."""
        marking = self._marking
        if marking is None or marking[0] is not run or marking[1].done():
            marking = self._marking = (run, asyncio.ensure_future(self._mark(run)))
        await asyncio.shield(marking[1])

    async def _mark(self, run: Run) -> None:
        base = baseline(run)
        if base is None:
            return
        for rec in run.state.closed_windows():
            if not _settled(rec):
                continue
            index = rec.window.index
            for tid in sorted(rec.aggregates):
                prof = await self._profile(run, rec, tid)
                if prof is None or index <= base or tid in rec.marks:
                    continue
                previous = _previous(run, index, tid) if _whole(rec) else None
                entry = rec.marks[tid] = judge(
                    prof,
                    _reference(run, index, tid, base),
                    threshold=run.config.regression_threshold,
                    baseline=base,
                    run=run.name,
                    trainer_id=tid,
                    previous=previous,
                )
                confirm(previous, entry)  # what the window before found too is marked in both
        for rec in run.state.closed_windows():
            # A window is counted once: marked again against a newly pinned baseline, it is
            # the same window ("regressions": windows marked slower, any role).
            counted = getattr(rec, "counted_slower", False)  # (older checkpoints)
            if not counted and any(slower(m) for m in getattr(rec, "marks", {}).values()):
                rec.counted_slower = True
                run.state.counters["regressions"] += 1
                self.shell.metrics.export(run.state)

    async def _profile(self, run: Run, rec: WindowRecord, tid: str) -> WindowProfile | None:
        """Trainer ``tid``'s profile of a settled window, made once from its table."""
        if not hasattr(rec, "profiles"):  # (a record from an older checkpoint: its marks were
            rec.profiles, rec.marks = {}, {}  # made the old way)
        prof = rec.profiles.get(tid)
        key = (run.name, rec.window.index, tid)
        if prof is not None or key in self._cannot:
            return prof
        try:
            summary = await self.readers.kernel_summary(
                rec.window.index, ALL_KERNELS, tid, False, run.name
            )
        except ValueError:  # the window left the history
            self._cannot.add(key)
            return None
        if not summary["ranks"]:
            self._cannot.add(key)
            return None
        prof = rec.profiles[tid] = profile(summary)
        return prof


def _reference(run: Run, index: int, tid: str, base: int) -> list[WindowProfile]:
    """The windows trainer ``tid``'s part of window ``index`` is judged against: its settled
    whole windows, as ``pick_reference`` picks them."""
    earlier = []
    for rec in run.state.closed_windows():
        prof = getattr(rec, "profiles", {}).get(tid)
        if prof is not None and _whole(rec):
            earlier.append((rec.window.index, prof, rec.marks.get(tid)))
    return pick_reference(index, base, earlier)


def _previous(run: Run, index: int, tid: str) -> RegressionEntry | None:
    """Trainer ``tid``'s judged entry of the whole window just before window ``index``."""
    found = None
    for rec in run.state.closed_windows():
        if rec.window.index >= index:
            break
        entry = getattr(rec, "marks", {}).get(tid)
        if _whole(rec) and entry is not None:
            found = entry
    return found if found is not None and found["judged"] else None


def _whole(rec: WindowRecord) -> bool:
    """Whether a window may be judged against and confirm another: not partial, not ``auto``
    (an auto capture is taken because the run was slow)."""
    return not rec.partial and rec.window.kind != "auto"


def baseline(run: Run) -> int | None:
    """The pinned window, else the run's first scheduled window that kept its plan, with
    every summary in."""
    pinned: int | None = getattr(run, "baseline", None)  # (an older checkpoint's run has none)
    if pinned is not None:
        return pinned
    for rec in run.state.closed_windows():
        if rec.window.kind == "scheduled" and not rec.partial and rec.steps and _settled(rec):
            return rec.window.index
    return None


def _settled(rec: WindowRecord) -> bool:
    return rec.closed and not rec.summaries_pending and bool(rec.aggregates)
