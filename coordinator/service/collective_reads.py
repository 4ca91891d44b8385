"""The ``collectives()`` read: one window's collectives matched across its ranks (issue 56).

The ranks' blocks (what each summary carried) are taken on the event loop, a dict copy; the
matching (``core.collectives.window_collectives``: O(ranks x collectives), about 1 s of CPU at
1,024 ranks with 200 collectives each) runs on the shell's reads thread, never the event loop.
"""

from __future__ import annotations

import asyncio
import statistics
import weakref
from typing import Any

from coordinator.core.aggregate import WindowAggregate
from coordinator.core.collectives import SHOWN, window_collectives
from coordinator.core.run import Run
from coordinator.core.state import trainer_window
from coordinator.core.validate import is_int, role_problem, trainer_id_problem
from coordinator.protocol.collective_replies import CollectivesReply, WindowCollectivesReply
from coordinator.service.shell import CoordinatorShell

MAX_SHOWN = 100_000


def check_args(window: Any, trainer_id: Any, role: Any, shown: Any) -> None:
    """ValueError naming the first bad argument of ``collectives()``."""
    if window is not None and not is_int(window):
        raise ValueError(f"window must be an int or None, got {window!r:.80}")
    if trainer_id is not None and (problem := trainer_id_problem(trainer_id)):
        raise ValueError(problem)
    if role is not None and (problem := role_problem(role)):
        raise ValueError(problem)
    if not is_int(shown) or not 0 <= shown <= MAX_SHOWN:
        raise ValueError(f"shown must be an int in 0..{MAX_SHOWN}, got {shown!r:.80}")


async def collectives(
    shell: CoordinatorShell,
    target: Run,
    window: int | None,
    trainer_id: str | None,
    role: str | None,
    shown: int = SHOWN,
) -> WindowCollectivesReply:
    """Window ``window`` (None: the latest closed) of ``target``'s trainer ``trainer_id`` (or
    the one with ``role``; neither: the stepping trainer), its collectives matched."""
    check_args(window, trainer_id, role, shown)
    st = target.state
    tid, rec, agg = trainer_window(st, window, trainer_id, role)
    blocks: dict[int, bytes | None] = {}
    if agg is not None:
        blocks = dict.fromkeys(agg.rank_totals, None)
        blocks.update(agg.collectives)
    nodes = {
        r: node
        for r in blocks
        if (found := st.ranks.get((tid or "", r))) is not None
        and isinstance(node := getattr(found, "node_id", None), str)
    }
    reply = await _matched(shell, agg, blocks, nodes, shown)
    out: WindowCollectivesReply = {
        **reply,
        "run": target.name,
        "window": rec.window.index if rec is not None else None,
        "steps": list(rec.steps) if rec is not None and rec.steps else None,
        "trainer_id": tid,
        "role": getattr(rec, "roles", {}).get(tid or "") if rec is not None and tid else None,
        "ranks_recorded": len(blocks),
        "ranks_without": sorted(r for r, b in blocks.items() if b is None),
    }
    if rec is not None and agg is not None and not agg.collectives:
        out["problems"] = [
            "no rank's summary of this window carried a collective (their traces had none, or "
            "the run's record was written before collectives were kept)",
            *out["problems"],
        ]
    return out


_MATCHED: weakref.WeakKeyDictionary[WindowAggregate, tuple[Any, CollectivesReply]] = (
    weakref.WeakKeyDictionary()
)
"""The last reply matched for each aggregate: a window page asks again every few seconds, and
matching a large window costs about 1 s of CPU; matched again when ranks came in since."""


async def _matched(
    shell: CoordinatorShell,
    agg: WindowAggregate | None,
    blocks: dict[int, bytes | None],
    nodes: dict[int, str],
    shown: int,
) -> CollectivesReply:
    """``window_collectives`` of ``agg``'s blocks on the reads thread, or as last matched."""
    key = (len(blocks), len(agg.collectives) if agg is not None else 0, shown, len(nodes))
    kept = _MATCHED.get(agg) if agg is not None else None
    if kept is not None and kept[0] == key:
        return kept[1]
    step = statistics.median(agg.rank_step_ms.values()) if agg and agg.rank_step_ms else None
    steps = dict(agg.rank_step_ms) if agg is not None else {}
    loop = asyncio.get_running_loop()
    reply = await loop.run_in_executor(
        shell.reads, window_collectives, blocks, nodes, shown, step, steps
    )
    if agg is not None:
        _MATCHED[agg] = (key, reply)
    return reply
