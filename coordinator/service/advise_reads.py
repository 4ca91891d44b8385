"""The ``advise()`` read: one window's findings across ranks, in words (issue 57;
docs/advise.md).

The figures are the ones ``kernel_summary()`` and ``collectives()`` answer (each builds its
large parts on the shell's reads thread); the rules (``core.findings.window_findings``) run on
that thread too, never on the event loop. A record answers it the same way
(``ops/recorded.py``). ``status()`` and the tracker read its replies as ``keep_findings`` keeps
them (``status_findings.py``).
"""

from __future__ import annotations

import asyncio
import functools

from coordinator.core.findings_inputs import advise_parts
from coordinator.protocol.finding_replies import Finding, FindingsReply
from coordinator.service.readers import Readers
from coordinator.service.status_findings import FindingCache


def keep_findings(readers: Readers) -> Readers:
    """``readers``, keeping each window's findings as ``advise`` makes them, once per window
    (``readers.findings``: ``status()["findings"]``, the tracker's)."""
    readers.findings = FindingCache(functools.partial(advise, readers))
    return readers


async def advise(
    readers: Readers,
    window: int | None = None,
    trainer_id: str | None = None,
    run: str | None = None,
    role: str | None = None,
) -> FindingsReply:
    """The findings of window ``window`` (None: the latest closed) of ``run``'s trainer
    ``trainer_id`` (or the one with ``role``; neither: the stepping trainer), costliest first."""
    table = await readers.kernel_summary(window, 0, trainer_id, False, run, role)
    target = readers.shell.find_run(run)
    settings = target.config.advise if target is not None else {}
    problems: list[str] = []
    found: list[Finding] = []
    quiet: list[str] = []
    missing: dict[str, str] = {}
    if table["window"] is None:
        problems.append("no window has closed yet: nothing to judge")
    else:
        coll = await readers.collectives(table["window"], trainer_id, run, role, 0)
        made = getattr(readers.shell, "memory_recorded", None)  # (memory_leak's marks)
        memory = None
        if made is not None and table["run"]:  # (its marks, not every rank's series)
            memory = await made(table["run"], False, table["trainer_id"])
        loop = asyncio.get_running_loop()
        found, quiet, missing = await loop.run_in_executor(
            readers.shell.reads, advise_parts, table, coll, settings, memory
        )
        if table["summaries_pending"]:
            pending = ", ".join(map(str, table["summaries_pending"][:16]))
            problems.append(f"summaries still pending (ranks {pending}): the findings may change")
        problems += [f"rank {r}: {why}" for r, why in sorted(table["bad_ranks"].items())][:16]
    return {
        "run": table["run"],
        "window": table["window"],
        "steps": table["steps"] or None,
        "trainer_id": table["trainer_id"],
        "role": table["role"],
        "findings": found,
        "quiet": quiet,
        "not_judged": missing,
        "problems": problems,
    }
