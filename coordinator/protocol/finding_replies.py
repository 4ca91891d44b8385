"""A window's findings across ranks (issue 57): what each rule of ``core.findings`` says of a
window, in words, with the rank it names, what it costs a step and the figures it used. The
JSON names are public (docs/advise.md): a top-level ``findings`` list, each entry with
``rule``, ``ranks``, ``cost_ms_per_step``, ``advice`` and ``evidence``. Keys may be added.
"""

from __future__ import annotations

from typing import Any, TypedDict


class FindingWhere(TypedDict):
    """Where to look: the window, and its page in ``ray-profiler serve``."""

    window: int | None
    page: str | None  # "#/window/3"


class Finding(TypedDict):
    """One rule's finding in one window."""

    rule: str  # the rule's id: collective_wait, straggler, exposed_comm, ...
    ranks: list[int]  # the ranks that show it (the rank to fix first)
    all_ranks: bool  # every rank of the window shows it
    steps: list[int]  # the window's steps it was seen in
    cost_ms_per_step: float  # what it costs each step, estimated from the window's figures
    evidence: dict[str, Any]  # the numbers the rule used
    advice: str  # one sentence: what to change, naming the API
    where: FindingWhere


class FindingsReply(TypedDict):
    """``advise()``: one window's findings, the costliest first, and what could not be judged
    (``problems``: one line each; the rest still answers)."""

    run: str
    window: int | None
    steps: list[int] | None
    trainer_id: str | None
    role: str | None
    findings: list[Finding]
    quiet: list[str]  # the rules that ran and found nothing
    not_judged: dict[str, str]  # rule -> why it could not judge the window (no figures)
    problems: list[str]


class StatusFinding(TypedDict):
    """One finding as ``status()`` and the tracker carry it: ``Finding`` without its evidence
    and its steps, its ranks bounded as the evidence is (``ranks_total`` says how many)."""

    rule: str
    ranks: list[int]  # every rank, or the 32 costliest (ascending) when there are more
    ranks_total: int  # the ranks that show it
    all_ranks: bool
    cost_ms_per_step: float
    advice: str


class StatusFindings(TypedDict):
    """``status()["findings"]``: one trainer's part of the latest closed window, its costliest
    findings (at most 3; ``advise()`` has every one with its evidence). ``problems``: what
    could not be judged, a fault of the rules included (``status()`` still answers)."""

    window: int
    steps: list[int] | None
    trainer_id: str
    role: str | None
    findings: list[StatusFinding]
    findings_total: int  # the window's findings for this trainer, listed or not
    problems: list[str]
