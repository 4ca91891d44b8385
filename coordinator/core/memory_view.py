"""What the memory replies show of a run's ``MemoryBook``: the marks, the culprits' lines, a
rank's entry and ``status()["memory"]``. Pure: no Ray, no I/O.

>>> from coordinator.core.memory import MemoryBook
>>> book = MemoryBook()
>>> for r, rate in ((0, 0), (1, 2 << 20)):
...     samples = [(float(s), 10**9 + rate * s, None, None) for s in range(400)]
...     book.add(("t", r), 100 + r, samples, None)
>>> book.evaluate(399.0, 300.0, 1e5)
>>> [(m["rank"], m["culprit"]) for m in marks(book, {})]
[(1, True)]
"""

from __future__ import annotations

import time
from typing import Any

from coordinator.core.memory import Key, MemoryBook
from coordinator.protocol.memory_replies import (
    MemoryMark,
    MemoryRankEntry,
    MemoryStatusEntry,
    SnapshotEntry,
)

MiB = 1 << 20
Where = tuple["str | None", "int | None", "str | None"]
"""Where a rank runs: its node, its pid, and why it is not sampled (None: it is)."""


def marks(book: MemoryBook, roles: dict[Key, str]) -> list[MemoryMark]:
    """The ranks marked as leaking, in (trainer, rank) order; ``roles``: each rank's role."""
    culprits = book.culprits(roles)
    return [
        {"trainer_id": k[0], "rank": k[1], "bytes_per_min": rm.growth["bytes_per_min"],
         "since": rm.growth["since"], "culprit": k in culprits,
         "span_s": rm.growth["span_s"], "time_left_s": rm.growth["time_left_s"]}
        for k, rm in sorted(book.ranks.items()) if rm.growth is not None
    ]  # fmt: skip


def culprit_lines(marked: list[MemoryMark], roles: dict[Key, str]) -> list[str]:
    """One line a culprit: its role, rank, rate and since when."""
    out = []
    for m in marked:
        if m["culprit"]:
            role = roles.get((m["trainer_id"], m["rank"]), "policy")
            when = time.strftime("%H:%M:%S", time.localtime(m["since"]))
            out.append(
                f"{role} rank {m['rank']} grows {m['bytes_per_min'] / MiB:.1f} MiB/min since "
                f"{when}; the other ranks of its role stay flat" + left_text(m.get("time_left_s"))
            )
    return out


def left_text(seconds: float | None) -> str:
    """``; its node's memory is gone in about ...`` for a mark's ``time_left_s`` ('' if None).

    >>> left_text(90.0)
    "; its node's memory is gone in about 2 min at this rate"
    >>> left_text(5400.0)[-24:], left_text(None)
    ('about 1.5 h at this rate', '')
    """
    if seconds is None:
        return ""
    return f"; its node's memory is gone in about {how_long(seconds)} at this rate"


def how_long(seconds: float) -> str:
    """``45 s``, ``38 min`` or ``1.5 h``."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def status_entry(
    book: MemoryBook, roles: dict[Key, str], sample_s: float, snapshots: list[SnapshotEntry]
) -> MemoryStatusEntry:
    """``status()["memory"]``."""
    marked = marks(book, roles)
    return {
        "sample_s": float(sample_s),
        "sampled_ranks": sum(1 for rm in book.ranks.values() if rm.lost is None and rm.last),
        "lost_ranks": sum(1 for rm in book.ranks.values() if rm.lost is not None),
        "marked": marked,
        "culprits": culprit_lines(marked, roles),
        "snapshots": snapshots[-8:],
    }


def rank_entry(
    book: MemoryBook, key: Key, role: str, where: Where | None, series: bool, culprit: bool
) -> MemoryRankEntry:
    """One rank of ``memory()``: now, its peaks, its mark, its series when asked."""
    rm = book.ranks.get(key)
    node, pid, why = where or (None, None, "not placed yet")
    last = rm.last if rm is not None else None
    state: Any = (
        "lost" if rm is not None and rm.lost is not None
        else "sampled" if last is not None and why is None
        else "unreachable" if why is not None and "not known yet" not in why
        else "waiting"
    )  # fmt: skip
    return {
        "trainer_id": key[0], "role": role, "rank": key[1], "node_id": node,
        "pid": rm.pid if rm is not None and rm.pid is not None else pid, "state": state,
        "reason": (rm.lost if rm is not None and rm.lost else None) or why
        or (rm.error if rm is not None else None),
        "rss_bytes": last[1] if last else None, "uss_bytes": last[2] if last else None,
        "gpu_bytes": last[3] if last else None,
        "peak_rss_bytes": rm.peak_rss if rm is not None else None,
        "peak_gpu_bytes": rm.peak_gpu if rm is not None else None,
        "growth": {**rm.growth} if rm is not None and rm.growth else None,
        "culprit": culprit, "samples": rm.samples if rm is not None else 0,
        "last_at": last[0] if last else None,
        "series": rm.series() if series and rm is not None else None,
    }  # fmt: skip
