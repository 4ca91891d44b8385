"""What changed between two windows: each kernel's per-step self time, new and vanished kernels,
the breakdown's shift and the step time (the regression marks are ``marks``). Pure: works on
two ``kernel_summary()`` replies.

A kernel's per-step time is its self time summed over the window's ranks, divided by the ranks
and by the recorded steps: windows of different lengths and rank counts compare.

>>> a = _summary(0, [1, 2], 2, {"mm": 400.0, "add": 40.0}, step_ms=10.0)
>>> b = _summary(1, [5, 6], 2, {"mm": 800.0, "relu": 20.0}, step_ms=12.5)
>>> d = kernel_diff(a, b, top_k=10)
>>> [(k["name"], k["status"], k["a_us"], k["b_us"]) for k in d["kernels"]]
[('mm', 'changed', 100.0, 200.0), ('add', 'vanished', 10.0, 0.0), ('relu', 'new', 0.0, 5.0)]
>>> d["step_ms"], d["step_ratio"]
([10.0, 12.5], 1.25)
"""

from __future__ import annotations

from typing import Any

from coordinator.protocol.replies import (
    BreakdownShift,
    KernelChange,
    KernelDiffReply,
    KernelSummaryReply,
)

BREAKDOWN = ("compute", "comm", "memcpy", "other")


def per_step_us(summary: KernelSummaryReply) -> dict[str, float]:
    """Each kernel's self time per step and per rank, in us."""
    n = _per(summary)
    return {k["name"]: k["total_us"] / n for k in summary["kernels"]} if n else {}


def _per(summary: KernelSummaryReply) -> float:
    steps = summary["steps"]
    n_steps = steps[1] - steps[0] + 1 if len(steps) == 2 else 0
    return float(len(summary["ranks"]) * n_steps)


def kernel_diff(a: KernelSummaryReply, b: KernelSummaryReply, top_k: int = 50) -> KernelDiffReply:
    """Window ``b`` against window ``a`` (see the module docstring); kernels ordered by the
    absolute change of their per-step time, the ``top_k`` largest."""
    ka, kb = per_step_us(a), per_step_us(b)
    changes: list[KernelChange] = []
    for name in ka.keys() | kb.keys():
        x, y = ka.get(name, 0.0), kb.get(name, 0.0)
        status = "new" if name not in ka else "vanished" if name not in kb else "changed"
        changes.append(
            {
                "name": name,
                "status": status,  # type: ignore[typeddict-item]
                "a_us": round(x, 3),
                "b_us": round(y, 3),
                "change_us": round(y - x, 3),
                "ratio": round(y / x, 4) if x > 0 and status == "changed" else None,
            }
        )
    changes.sort(key=lambda c: (-abs(c["change_us"]), c["name"]))
    sa, sb = _step_ms(a), _step_ms(b)
    return {
        "a": _ref(a),
        "b": _ref(b),
        "kernels": changes[:top_k],
        "new": sorted(n for n in kb if n not in ka),
        "vanished": sorted(n for n in ka if n not in kb),
        "total_us": [round(sum(ka.values()), 3), round(sum(kb.values()), 3)],
        "breakdown": _shift(a, b),
        "step_ms": [sa, sb],
        "step_ratio": round(sb / sa, 4) if sa and sb else None,
        "device": b["device"] or a["device"],
    }


def _ref(s: KernelSummaryReply) -> dict[str, Any]:
    return {"run": s["run"], "window": s["window"], "steps": s["steps"], "ranks": len(s["ranks"])}


def _step_ms(s: KernelSummaryReply) -> float | None:
    med = s["stragglers"]["median_step_ms"]
    return round(med, 3) if med else None


def _shift(a: KernelSummaryReply, b: KernelSummaryReply) -> list[BreakdownShift]:
    ma, mb = a["breakdown"]["mean"], b["breakdown"]["mean"]
    if not ma or not mb:
        return []
    pa, pb = _steps(a), _steps(b)
    return [
        {
            "category": cat,
            "a_us": round(ma.get(f"{cat}_us", 0.0) / pa, 3),
            "b_us": round(mb.get(f"{cat}_us", 0.0) / pb, 3),
            "a_share": round(ma.get(f"{cat}_share", 0.0), 4),
            "b_share": round(mb.get(f"{cat}_share", 0.0), 4),
        }
        for cat in BREAKDOWN
    ]


def _steps(s: KernelSummaryReply) -> int:
    steps = s["steps"]
    return max(1, steps[1] - steps[0] + 1) if len(steps) == 2 else 1


def _summary(
    window: int, steps: list[int], ranks: int, totals: dict[str, float], step_ms: float
) -> Any:
    """A minimal ``kernel_summary()`` reply, for the examples above."""
    return {
        "run": "r",
        "window": window,
        "steps": steps,
        "ranks": list(range(ranks)),
        "device": "cpu",
        "kernels": [{"name": n, "total_us": t, "min_us": t / ranks} for n, t in totals.items()],
        "stragglers": {"median_step_ms": step_ms},
        "breakdown": {"mean": {}},
    }
