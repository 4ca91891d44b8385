"""``ray-profiler advise`` (and ``summarise --advise``): a window's findings as text
(docs/advise.md). Pure.

One line a finding, the costliest first: its cost a step, its rule, its ranks and its advice;
then the figures it used, indented, each line cut at ``EVIDENCE_WIDTH`` characters (``--json``
has them whole). Texts that may come from a record go through ``printable``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from coordinator.core.printable import printable
from coordinator.core.stacks import ranges

EVIDENCE_WIDTH = 160


def render_findings(reply: Mapping[str, Any]) -> str:
    """An ``advise()`` reply (``FindingsReply``; an offline one has the same keys) as lines."""
    steps = reply.get("steps") or []
    span = f" (steps {steps[0]}-{steps[-1]})" if steps else ""
    found = reply.get("findings") or []
    lines = [
        f"run {printable(str(reply.get('run')))}, window {reply.get('window')}{span}: "
        f"{len(found)} finding(s)"
    ]
    for f in found:
        who = "every rank" if f["all_ranks"] else f"rank {ranges(f['ranks'])}"
        lines.append(
            f"{f['cost_ms_per_step']:>9.1f} ms/step  {f['rule']:<16} {who}: "
            f"{printable(str(f['advice']))}"
        )
        for key, value in f["evidence"].items():
            text = printable(f"{key}: {json.dumps(value, default=str)}")
            cut = text[: EVIDENCE_WIDTH - 3] + "..." if len(text) > EVIDENCE_WIDTH else text
            lines.append(f"{'':>20}{cut}")
    if reply.get("quiet"):
        lines.append(f"quiet: {', '.join(reply['quiet'])}")
    for rule, why in (reply.get("not_judged") or {}).items():
        lines.append(f"not judged: {rule}: {printable(str(why))}")
    lines += [f"problem: {printable(str(p))}" for p in reply.get("problems") or []]
    return "\n".join(lines)
