"""What a settled window logs to the trainer's tracker: flat ``{name: number}`` figures from its
cross-rank table and its regression marks. Pure: no Ray, no tracker.

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
