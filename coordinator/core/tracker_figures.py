"""What a settled window logs to the trainer's tracker: flat ``{name: number}`` figures from its
cross-rank table, its regression marks and its findings (each rule's cost a step), and its
findings as a table of text for the trackers that take text. Pure: no Ray, no tracker.

Names start with ``profiler/`` (``profiler/<role>/`` for a role other than the policy) and keep
to the characters every tracker takes (TensorBoard, MLflow, W&B): others become ``_``.

>>> metric_name("policy", "kernel_share/aten::addmm")
'profiler/kernel_share/aten__addmm'
>>> metric_name("rollout", "step_ms_median")
'profiler/rollout/step_ms_median'
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from coordinator.core.records import WindowRecord
from coordinator.protocol.finding_replies import FindingsReply, StatusFindings

TOP_KERNELS = 5
SHARES = (("compute", "compute_share"), ("comm", "comm_share"), ("memcpy", "memcpy_share"),
          ("idle", "other_share"))  # fmt: skip
"""The breakdown's shares as logged: ``idle`` is the device idle (CUDA) or the time in no op
(CPU)."""
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-./]")
MAX_NAME = 200


def metric_name(role: str, name: str) -> str:
    """``profiler/[role/]name``, with characters a tracker refuses as ``_``."""
    prefix = "profiler/" if role == "policy" else f"profiler/{role}/"
    return _UNSAFE.sub("_", prefix + name)[:MAX_NAME]


def window_figures(summary: Any, marks: Any = None) -> dict[str, float]:
    """The figures of one role's part of a window: from its ``kernel_summary`` reply
    (``summary``) and its ``RegressionEntry`` (``marks``, None before it is judged).

    - ``step_ms_median`` and ``step_ms_slowest`` (the median rank's and the slowest rank's
      mean step time), ``slowest_rank``;
    - ``share/compute``, ``share/comm``, ``share/memcpy``, ``share/idle`` (the breakdown's
      mean over ranks);
    - ``kernel_share/<name>`` of the top kernels;
    - ``stragglers`` (ranks flagged), ``marked`` (1 when the window was marked slower, else 0)
      and ``marked_kernels``.
    """
    role = summary.get("role") or "policy"
    out: dict[str, float] = {}

    def put(name: str, value: float) -> None:
        out[metric_name(role, name)] = float(value)

    strag = summary["stragglers"]
    steps = {int(r): v["step_ms"] for r, v in strag["ranks"].items() if v.get("step_ms")}
    if steps:
        slow = max(steps, key=lambda r: (steps[r], -r))
        put("step_ms_median", strag["median_step_ms"])
        put("step_ms_slowest", steps[slow])
        put("slowest_rank", slow)
    mean = summary["breakdown"]["mean"]
    for name, key in SHARES:
        if key in mean:
            put(f"share/{name}", mean[key])
    for k in summary["kernels"][:TOP_KERNELS]:
        put(f"kernel_share/{k['name']}", k["share"])
    put("stragglers", len(strag["flagged"]))
    if marks is not None:
        kernels = marks.get("kernels") or []
        put("marked", 1.0 if kernels or marks.get("step_regressed") else 0.0)
        put("marked_kernels", len(kernels))
    return out


def finding_figures(reply: FindingsReply) -> dict[str, float]:
    """One role's findings of a window (its ``advise()`` reply) as figures: for every rule
    that ran, ``finding/<rule>_ms_per_step`` (its cost a step; 0 when it stayed quiet, so each
    rule's line is drawn on every window), and ``findings`` (how many fired). Bounded by the
    rules; none when no rule ran (a fault of the rules: its problem line is in the text)."""
    role = reply["role"] or "policy"
    costs = {f["rule"]: f["cost_ms_per_step"] for f in reply["findings"]}
    if not costs and not reply["quiet"]:
        return {}
    out = {metric_name(role, f"finding/{rule}_ms_per_step"): 0.0 for rule in reply["quiet"]}
    out |= {metric_name(role, f"finding/{rule}_ms_per_step"): float(c) for rule, c in costs.items()}
    out[metric_name(role, "findings")] = float(len(costs))
    return out


def findings_text(entries: list[StatusFindings]) -> str:
    """A window's findings as a Markdown table (the trackers that take text show it): each
    role's listed findings, costliest first, then what could not be judged.

    >>> print(findings_text([{"window": 3, "steps": [5, 8], "trainer_id": "sft",
    ...     "role": "policy", "findings": [{"rule": "straggler", "ranks": [1],
    ...     "ranks_total": 1, "all_ranks": False, "cost_ms_per_step": 12.5,
    ...     "advice": "Look at rank 1."}], "findings_total": 1, "problems": []}]))
    window 3: 1 finding(s)
    <BLANKLINE>
    | role | ms/step | rule | ranks | advice |
    |---|---|---|---|---|
    | policy | 12.5 | straggler | 1 | Look at rank 1. |
    """
    rows, problems, total = [], [], 0
    for e in entries:
        total += e["findings_total"]
        for f in e["findings"]:
            ranks = "all" if f["all_ranks"] else ", ".join(map(str, f["ranks"][:8]))
            ranks += " ..." * (len(f["ranks"]) > 8 and not f["all_ranks"])
            cells = (e["role"] or "policy", f"{f['cost_ms_per_step']:g}", f["rule"], ranks,
                     f["advice"])  # fmt: skip
            rows.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
        problems += [f"- {e['role'] or 'policy'}: {p}" for p in e["problems"]]
    window = entries[0]["window"] if entries else "?"
    lines = [f"window {window}: {total} finding(s)"]
    if rows:
        lines += ["", "| role | ms/step | rule | ranks | advice |", "|---|---|---|---|---|", *rows]
    if problems:
        lines += ["", *problems]
    return "\n".join(lines)


def settled_after(records: Iterable[WindowRecord], after: int) -> list[WindowRecord]:
    """The closed windows after window ``after`` whose figures can be logged now, in window
    order. It stops before the first one whose summaries are still coming, so a caller that
    asks again after the last window it got never skips one; a window that recorded nothing
    has no figures and is passed over."""
    out = []
    for rec in sorted(records, key=lambda r: r.window.index):
        if rec.window.index <= after or not rec.closed:
            continue
        if rec.summaries_pending:
            break
        if rec.aggregates and rec.steps is not None:
            out.append(rec)
    return out
