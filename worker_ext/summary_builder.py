"""Reduce ``key_averages()`` rows to a ``RankSummary``: self time per op or kernel, top_k."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from coordinator.summary_codec import MAX_NAME_CHARS, KernelRow, RankSummary

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_STEP_EVENT = re.compile(r"^ProfilerStep#(\d+)$")
_STEP_ROW = re.compile(r"^ProfilerStep[#*]")


def normalise_name(name: str) -> str:
    """Drop memory addresses (``<built-in method ... at 0x7f..>``) and cap the length."""
    name = _ADDRESS.sub("0x?", name)
    if len(name) > MAX_NAME_CHARS:
        name = name[: MAX_NAME_CHARS - 1] + "…"
    return name or "<unnamed>"


def step_times(events: Iterable[Any]) -> list[tuple[int, float]]:
    """Wall time of each ``ProfilerStep#N`` range on the CPU, in microseconds, by step."""
    out = []
    for ev in events:
        m = _STEP_EVENT.match(str(getattr(ev, "trace_name", None) or ev.name))
        if m and _is_cpu_row(ev):
            out.append((int(m.group(1)), float(ev.cpu_time_total)))
    return sorted(out)


def build_summary(
    rows: Iterable[Any],
    *,
    step_us: Iterable[tuple[int, float]] = (),
    rank: int,
    window: int,
    steps: tuple[int, int],
    partial: bool,
    device: str,
    top_k: int,
) -> RankSummary:
    """Summarise ``key_averages()`` rows.

    ``device == "cuda"``: kernels are the rows with self device time, timed by it.
    ``device == "cpu"``: every op row, timed by self CPU time. ``ProfilerStep#N`` rows become
    per-step wall times (``step_us``, from ``step_times``), not kernels.
    """
    merged: dict[str, list[float]] = {}  # name -> [self_us, count, flops]
    for row in rows:
        key = str(row.key)
        if _STEP_ROW.match(key):
            continue
        if device == "cuda":
            if getattr(row, "is_user_annotation", False):
                continue  # GPU-side annotation spans would double count their kernels
            self_us = float(getattr(row, "self_device_time_total", 0.0) or 0.0)
        else:
            self_us = float(row.self_cpu_time_total)
        if self_us <= 0.0:
            continue
        acc = merged.setdefault(normalise_name(key), [0.0, 0, 0])
        acc[0] += self_us
        acc[1] += int(row.count)
        acc[2] += int(getattr(row, "flops", 0) or 0)
    ordered = sorted(merged.items(), key=lambda kv: (-kv[1][0], kv[0]))
    kept, dropped = ordered[:top_k], ordered[top_k:]
    kernels = [KernelRow(name, v[0], int(v[1]), int(v[2])) for name, v in kept]
    return RankSummary(
        rank=rank,
        window=window,
        steps=steps,
        partial=partial,
        device=device,
        kernels=kernels,
        dropped_rows=len(dropped),
        dropped_us=sum(v[0] for _, v in dropped),
        step_us=[(s, us) for s, us in sorted(step_us) if steps[0] <= s <= steps[1]],
    )


def _is_cpu_row(row: Any) -> bool:
    return "CPU" in str(getattr(row, "device_type", "CPU"))
