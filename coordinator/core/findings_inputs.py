"""Which rules could not judge a window, and why (issue 57; docs/advise.md). Pure.

A rule whose figures no rank's summary carries is not "quiet" (it found nothing): it could not
look. That is so of a window read from a record, or from an agent, older than the rule: the
wire's newer rows are optional, so an old summary still decodes, without them. The agent
sends the host rules' row (``HostRow``) for every rank it reads, zeros included, and a CUDA
rank's ``GpuRow`` always, so their absence means "not measured", never "nothing found";
``host_contention``'s CPU wait is in the row only where a live rank measured it.

``advise_parts`` runs the rules (``findings.window_findings``) and moves each rule that could
not judge from its quiet list to ``not_judged`` (rule -> one line why).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coordinator.core.findings import window_findings
from coordinator.protocol.finding_replies import Finding

HOST_ROW_RULES = ("dataloader", "zero_grad", "optimizer_foreach")
"""The rules that read the ``HostRow`` figures every agent since them sends (its breakdown row;
``findings.HOST_RULES`` is another list: the host time a late rank's excess may be)."""
GPU_RULES = ("host_sync", "memcpy_pageable", "tf32_off", "matmul_alignment")
"""The rules of a CUDA rank's ``GpuRow`` (the table's ``gpu`` entries)."""
OLDER = "a summary (an agent's, or a record's) older than this rule has none"


def not_judged(
    table: Mapping[str, Any], settings: Mapping[str, Mapping[str, float]], memory_read: bool
) -> dict[str, str]:
    """The rules that could not judge ``table``'s window (a ``kernel_summary()`` table), each
    with why: no rank's host figures, no CUDA rank's GPU figures, no memory book
    (``memory_read`` False), or the device's memory not set for ``memory_peak``."""
    out: dict[str, str] = {}
    rows = (table.get("breakdown") or {}).get("ranks") or {}
    if rows and not any("dataloader_us_per_step" in row for row in rows.values()):
        out |= dict.fromkeys(HOST_ROW_RULES, f"no rank's host time in the window: {OLDER}")
    if rows and not any("cpu_wait_us_per_step" in row for row in rows.values()):
        out["host_contention"] = (
            "no rank's CPU wait in the window: measured by a live rank (its training thread's "
            "/proc schedstat), not in a trace read offline nor a summary older than this rule"
        )
    cuda = table.get("device") == "cuda" or bool(table.get("device_steps") or table.get("launch"))
    if cuda and not table.get("gpu"):
        out |= dict.fromkeys(GPU_RULES, f"no CUDA rank's GPU figures in the window: {OLDER}")
    elif cuda and not any(g.get("mm_ops_shaped") for g in table["gpu"].values()):
        out["matmul_alignment"] = (
            "no matmul op (aten::mm, bmm, addmm) in the window with its input types and "
            "shapes: none ran, or they were recorded without (torch.profiler.profile("
            "record_shapes=True) records them)"
        )
    if cuda and not (settings.get("memory_peak") or {}).get("device_gib"):
        out["memory_peak"] = (
            "the device's memory is not known: set advise.memory_peak.device_gib in the config"
        )
    if not memory_read:
        out["memory_leak"] = (
            "no memory book to read: a trace read offline has none, nor a run (or its record) "
            "whose coordinator sampled no memory"
        )
    return out


def advise_parts(
    table: Mapping[str, Any],
    collectives: Mapping[str, Any] | None,
    settings: Mapping[str, Mapping[str, float]] | None,
    memory: Mapping[str, Any] | None,
) -> tuple[list[Finding], list[str], dict[str, str]]:
    """``window_findings``' findings and quiet rules, less those that could not judge the
    window (``not_judged``; ``memory`` None: no memory book was read), and those."""
    found, quiet = window_findings(table, collectives, settings, memory)
    missing = not_judged(table, settings or {}, memory is not None)
    return (
        found,
        [r for r in quiet if r not in missing],
        {r: missing[r] for r in quiet if r in missing},
    )
