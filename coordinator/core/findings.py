"""A window's findings across ranks, in words (issue 57; docs/advise.md). Pure: no Ray, torch.

Each rule is a small function of one window's cross-rank figures, the ones the coordinator
already holds: the ``kernel_summary()`` table (stragglers with the last arriver, the time
breakdown per rank, launch statistics and device step times, memory peaks) and, where a read
has them, the window's matched collectives (``core.collectives.window_collectives``). No rule
reads a trace. A rule gives at most one ``Finding``: the ranks that show it, what it costs a
step (``cost_ms_per_step``, from the window's own figures), the numbers it used, one sentence
of advice naming the API to change, and where to look.

How costs are estimated: a rank's share of a category (``comm``, device idle) of its window's
breakdown, times its step time; a finding over several ranks costs the mean of theirs, but for
``straggler``, whose cost is its slowest rank's (a synchronous step waits for the slowest).

How overlapping lost time is resolved, so no time is reported twice (rules run in this order):

- ``host_contention`` (``core.findings_more``): each rank's training thread's wait for a CPU
  (on a CUDA rank at most its device's idle), counted first: the others take it off.
- ``dataloader``: each rank's time inside its DataLoader's ``__next__``, counted here only;
  on a CUDA rank at most its device's idle (loading while the device runs costs nothing).
- ``zero_grad``: each rank's time in the ops that zero its gradients, counted here only.
- ``optimizer_foreach`` (after ``zero_grad``, a host rule like it) and ``memory_leak`` (no
  time): ``core.findings_more`` says how they overlap the others.
- ``collective_wait``: the ranks' wait for the last arriver, less the late rank's time that
  ``host_contention``, ``dataloader`` and ``zero_grad`` counted beyond the waiting ranks' mean
  of it (the others wait for exactly that time: it is the CPU wait's, the data loading's or
  the zeroing's, not counted again).
- ``straggler``: a rank that is also the last arriver costs its excess minus that wait (the
  others' wait for it is the same time), and minus its ``host_contention``, ``dataloader``
  and ``zero_grad`` time beyond the other ranks' mean; nothing left, no finding. Where the
  ranks meet in collectives its excess is its step time over the median only: a compute
  excess there costs the step through the others' wait in the collectives, which is
  ``collective_wait``'s.
- ``exposed_comm``: each rank's exposed communication minus its own wait in collectives (a
  rank spinning in an all_reduce for a late peer is waiting, not communicating).
- ``launch_bound``: the device idle of each rank's launch-bound steps.
- ``gpu_idle``: each CUDA rank's device idle minus what ``launch_bound`` counted of it, and
  minus the time ``dataloader`` and ``host_contention`` counted on it (the device idles while
  its host loads data, or waits for a CPU).
- ``host_sync``, ``memcpy_pageable``, ``tf32_off``, ``matmul_alignment``
  (``core.findings_device``): the host's wait while its device runs, and busy device time
  (copies, fp32 kernels, fp16/bf16 matmul kernels: each kernel in one rule at most): none is
  counted by another rule.
- ``memory_peak``: costs no time (0 ms): it says how close a rank came to its device's memory.

Findings come costliest first (ties by rule order); every threshold can be set in the config
(``advise: {rule_id: {threshold: value}}``, ``checked_advise``).
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from coordinator.core import findings_device as device
from coordinator.core import findings_more as more
from coordinator.core.validate import check_known_keys
from coordinator.protocol.finding_replies import Finding

Settings = dict[str, dict[str, float]]
EVIDENCE_RANKS = 32
"""A finding's per-rank evidence lists its costliest ranks at most (its ``ranks`` lists all)."""


@dataclass(frozen=True)
class Threshold:
    """One settable number of a rule: its default, its range, and where it came from."""

    default: float
    low: float
    high: float
    source: str


@dataclass
class Figures:
    """One window's figures, as the rules read them (``figures_of``)."""

    window: int | None
    steps: list[int]
    ranks: list[int]
    step_ms: dict[int, float]  # each rank's step time (CUDA: its device span a step)
    median_step_ms: float
    stragglers: Mapping[str, Any]
    breakdown: dict[int, Mapping[str, float]]
    cuda: set[int]  # the ranks with device figures
    launch: Mapping[int, Mapping[str, Any]]
    device_steps: Mapping[int, list[list[float]]]
    peaks: Mapping[int, int]
    last_arriver: Mapping[str, Any] | None
    wait_ms: dict[int, float]  # each rank's wait in collectives a step
    spent: dict[str, dict[int, float]] = field(default_factory=dict)  # rule -> rank -> ms
    host_sums: dict[str, float] = field(default_factory=dict)  # a host key's sum over ranks
    memory: list[dict[str, Any]] | None = None  # memory_leak's marked ranks (findings_more)
    gpu: dict[int, Mapping[str, Any]] = field(default_factory=dict)  # a CUDA rank's GpuEntry
    idle: dict[int, float] | None = None  # each rank's device idle a step (``idles``), once
    scale: dict[int, float] = field(default_factory=dict)  # ``_scales``
    synced: bool = False  # its ranks meet in collectives (matched, or a last arriver known)


@dataclass(frozen=True)
class Rule:
    """A rule: its id, its thresholds, and its function of the figures."""

    id: str
    thresholds: dict[str, Threshold]
    judge: Callable[[Figures, dict[str, float]], Finding | None]
    what: str


def _finding(
    fig: Figures, rule: str, ranks: list[int], cost: float, evidence: dict[str, Any], advice: str
) -> Finding:
    ranks = sorted(ranks)
    page = f"#/window/{fig.window}" if fig.window is not None else None
    return {
        "rule": rule,
        "ranks": ranks,
        "all_ranks": bool(fig.ranks) and ranks == fig.ranks,  # (figures_of sorts them)
        "steps": list(fig.steps),
        "cost_ms_per_step": round(max(cost, 0.0), 3),
        "evidence": evidence,
        "advice": advice,
        "where": {"window": fig.window, "page": page},
    }


def _over_ranks(
    fig: Figures,
    rule: str,
    costs: dict[int, float],
    more: dict[str, Any],
    advice: str,
    top: list[int] | None = None,
) -> Finding:
    """A finding over the ranks of ``costs`` (rank -> its ms a step), costing their mean; its
    evidence each rank's ms a step and ``more``, for its ``EVIDENCE_RANKS`` costliest ranks
    when there are more (``ranks_in_evidence`` then says how many of how many; ``top``: those
    ranks, ``shown(costs)``, when the caller has them)."""
    top = shown(costs) if top is None else top
    if len(top) < len(costs):
        more["ranks_in_evidence"] = f"the {len(top)} costliest of {len(costs)}"
    ms = {r: round(costs[r], 3) for r in top}
    evidence = {"ms_per_step": ms, **more}
    return _finding(fig, rule, sorted(costs), statistics.fmean(costs.values()), evidence, advice)


def shown(costs: Mapping[int, float]) -> list[int]:
    """The ranks a finding's per-rank evidence lists: every one, or its ``EVIDENCE_RANKS``
    costliest (ascending)."""
    if len(costs) <= EVIDENCE_RANKS:
        return sorted(costs)
    return sorted(heapq.nlargest(EVIDENCE_RANKS, costs, key=costs.__getitem__))


def _names(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}" + (" ..." * (len(ranks) > 8))


def _per_step(fig: Figures, rank: int, part_us: float) -> float:
    """``part_us`` of a rank's window (a breakdown category) as ms a step: its share of the
    window times the rank's step time (else the window's steps share it evenly)."""
    scale = fig.scale.get(rank)
    return part_us * scale if scale is not None else part_us / 1e3 / step_count(fig.steps)


def step_count(steps: list[int]) -> int:
    """How many steps a window's ``steps`` span: a table gives its first and last (every
    step between counts), a list every one; at least 1."""
    return max(steps[-1] - steps[0] + 1, 1) if steps else 1


def _scales(rows: dict[int, Mapping[str, float]], step_ms: dict[int, float]) -> dict[int, float]:
    """Each rank's ms a step per us of its window (``_per_step``), where both are known."""
    out: dict[int, float] = {}
    for r, row in rows.items():
        window_us, step = row.get("window_us", 0.0), step_ms.get(r)
        if window_us > 0 and step:
            out[r] = step / window_us
    return out


ADVICE = {
    "launch_bound": "Kernels run shorter than their launches and the device waits for the "
    "host: launch fewer, larger kernels (torch.compile, CUDA graphs with torch.cuda.graphs or "
    "mode='reduce-overhead', a larger batch).",
    "dataloader": "The training loop waits for its DataLoader's __next__: load the batches "
    "ahead in worker processes (DataLoader(num_workers=N) with persistent_workers=True, "
    "prefetch_factor), and pin them for the copy (pin_memory=True).",
    "zero_grad": "Gradients are zeroed by kernels each step: set them to None instead "
    "(optimizer.zero_grad(set_to_none=True), the default since torch 2.0, or "
    "model.zero_grad(set_to_none=True)).",
    "gpu_idle": "The device idles between kernels while the host works: find the gap on the "
    "window's timeline (ray-profiler collect --merge) and overlap it (DataLoader "
    "pin_memory=True with .to(non_blocking=True), fewer .item() calls).",
}
"""The advice of the rules whose sentence names no figure."""


HOST_RULES = {
    "host_contention": "cpu_wait_us_per_step",
    "dataloader": "dataloader_us_per_step",
    "zero_grad": "zero_grad_us_per_step",
}
"""The rules of a rank's host time, and the key of its breakdown row each reads (the agent's
``HostRow``, as ``aggregate.HOST_KEYS`` puts it there): a late or slow rank's excess may be
that time."""


def host_excess(fig: Figures, rank: int, others: list[int] | None) -> float:
    """What ``dataloader`` and ``zero_grad`` counted on ``rank`` beyond ``others``' mean of the
    same time (None: every other rank's), in ms a step (0 where neither fired on it)."""
    excess, rows = 0.0, fig.breakdown
    own = fig.spent.get("optimizer_foreach", {})  # (its own estimate: the others' of it)
    if (mine_own := own.get(rank)) is not None:
        n = len(others) if others is not None else len(rows) - (rank in rows)
        total = sum(own.get(o, 0.0) for o in others or [r for r in own if r != rank])
        excess += max(mine_own - (total / n if n else 0.0), 0.0)
    for rule, key in HOST_RULES.items():
        mine = fig.spent.get(rule, {}).get(rank)
        if mine is None:
            continue
        if others is not None:
            n, total = len(others), sum(rows.get(o, {}).get(key, 0.0) for o in others)
        else:  # every other rank's: the sum over all (once a window) less its own
            if key not in fig.host_sums:
                fig.host_sums[key] = sum(row.get(key, 0.0) for row in rows.values())
            n = len(rows) - (rank in rows)
            total = fig.host_sums[key] - rows.get(rank, {}).get(key, 0.0)
        excess += max(mine - (total / n / 1e3 if n else 0.0), 0.0)
    return excess


def _host_rule(
    fig: Figures, rule: str, share: float, advice: str, at_most_idle: bool = False
) -> Finding | None:
    """A finding over the ranks whose host time of ``rule`` (``HOST_RULES``) is over ``share``
    of their step (``share`` 0: any), its cost their mean; what it counted in ``fig.spent``.
    ``at_most_idle``: on a CUDA rank the time costs at most its device's idle a step (the
    host's work while the device runs costs the step nothing; ``idle_ms``)."""
    costs: dict[int, float] = {}
    host: dict[int, float] = {}
    key, step_ms, median = HOST_RULES[rule], fig.step_ms, fig.median_step_ms
    waited = fig.spent.get("host_contention", {})
    for r, row in fig.breakdown.items():
        us = row.get(key)
        if us and us > share * (step_ms.get(r) or median) * 1e3:
            host[r] = costs[r] = us / 1e3
            if r in waited:  # (its CPU wait, spread over the step: this time's share of it)
                costs[r] -= waited[r] * min(costs[r] / (step_ms.get(r) or median or 1.0), 1.0)
            if at_most_idle and r in fig.cuda and row.get("window_us", 0.0) > 0:
                costs[r] = min(costs[r], idle_ms(fig, r))
    costs = {r: c for r, c in costs.items() if c > 0}
    if not costs:
        return None
    fig.spent[rule] = costs
    top = shown(costs)
    steps = {r: step_ms.get(r) or median for r in top}
    more = {
        "share_of_step": {r: round(host[r] / steps[r], 4) if steps[r] else None for r in top},
        "step_ms": {r: round(steps[r], 3) for r in top},
    }
    if any(costs[r] < host[r] for r in top):  # (less its CPU wait, or capped at the idle)
        more["host_ms"] = {r: round(host[r], 3) for r in top}
    return _over_ranks(fig, rule, costs, more, advice, top)


def dataloader(fig: Figures, th: dict[str, float]) -> Finding | None:
    return _host_rule(fig, "dataloader", th["share"], ADVICE["dataloader"], at_most_idle=True)


def zero_grad(fig: Figures, th: dict[str, float]) -> Finding | None:
    return _host_rule(fig, "zero_grad", th["min_share"], ADVICE["zero_grad"])


def collective_wait(fig: Figures, th: dict[str, float]) -> Finding | None:
    la = fig.last_arriver
    if la is None or not fig.median_step_ms:
        return None
    waiting = [int(r) for r in la["waiting_ranks"]]
    counted = host_excess(fig, int(la["rank"]), waiting)
    cost = float(la["wait_ms_per_step"]) - counted
    if cost <= 0 or cost < th["min_share"] * fig.median_step_ms:
        return None
    rank = int(la["rank"])
    fig.spent["collective_wait"] = {rank: cost}  # the time its lateness costs the step
    evidence = {
        "arrived_last": la["arrived_last"],
        "collectives": la["collectives"],
        "waiting_ranks": waiting,
        "wait_ms_per_step": cost,
        "host_subtracted_ms": round(counted, 3),
        "median_step_ms": fig.median_step_ms,
        "reason": la.get("reason"),
    }
    advice = (
        f"Rank {rank} arrives last at its collectives and the others wait {cost:.1f} ms a step "
        "for it: find what it does before them (its DataLoader's num_workers, host work, an "
        "uneven shard from its DistributedSampler) and even it out."
    )
    return _finding(fig, "collective_wait", [rank], cost, evidence, advice)


def straggler(fig: Figures, th: dict[str, float]) -> Finding | None:
    s = fig.stragglers
    med_step, med_compute = s.get("median_step_ms") or 0.0, s.get("median_compute_ms") or 0.0
    n = step_count(fig.steps)
    over: dict[int, float] = {}
    ratio = th["ratio"]
    for r, v in s.get("ranks", {}).items():
        sr, cr = v.get("step_ratio"), v.get("compute_ratio")
        if not ((sr is not None and sr > ratio) or (cr is not None and cr > ratio)):
            continue
        step_excess = (v["step_ms"] - med_step) if v.get("step_ms") is not None else 0.0
        # (ranks that meet in collectives: a compute excess costs the step only through the
        # others' wait, collective_wait's; its own step time over the median is its cost)
        compute_excess = (v["compute_ms"] - med_compute) / n
        excess = step_excess if fig.synced else max(step_excess, compute_excess)
        excess -= fig.spent.get("collective_wait", {}).get(int(r), 0.0)
        excess -= host_excess(fig, int(r), None)
        if excess > 0 and excess >= th["min_share"] * fig.median_step_ms:
            over[int(r)] = excess
    if not over:
        return None
    worst = max(over, key=lambda r: over[r])
    v = s["ranks"][worst]
    evidence = {
        "excess_ms": {r: round(c, 3) for r, c in sorted(over.items())},
        "step_ms": v.get("step_ms"),
        "median_step_ms": med_step,
        "compute_ms": v.get("compute_ms"),
        "median_compute_ms": med_compute,
        "compute_ratio": v.get("compute_ratio"),
        "step_ratio": v.get("step_ratio"),
    }
    advice = (
        f"{_names(sorted(over)).capitalize()} compute{'s' * (len(over) == 1)} longer than the "
        "median rank: compare its kernel table with a peer's (ray-profiler top --window N, "
        "kernel_summary(per_rank=True)) for extra work, a slower device or an uneven batch."
    )
    return _finding(fig, "straggler", sorted(over), over[worst], evidence, advice)


def exposed_comm(fig: Figures, th: dict[str, float]) -> Finding | None:
    costs: dict[int, float] = {}
    shares: dict[int, float] = {}
    cuda, scale, wait, step_ms = fig.cuda, fig.scale, fig.wait_ms, fig.step_ms
    even = 1 / 1e3 / step_count(fig.steps)  # (``_per_step`` without a scale)
    for r, row in fig.breakdown.items():
        comm = row.get("comm_us", 0.0)
        if not comm:
            continue
        on_cuda = r in cuda
        exposed = max(comm - row.get("overlap_us", 0.0) if on_cuda else comm, 0.0)
        ms = exposed * scale.get(r, even) - wait.get(r, 0.0)
        step = step_ms.get(r) or fig.median_step_ms
        if step and ms > (th["share_cuda"] if on_cuda else th["share_cpu"]) * step:
            costs[r], shares[r] = ms, ms / step
    if not costs:
        return None
    top = shown(costs)
    more = {
        "share_of_step": {r: round(shares[r], 4) for r in top},
        "wait_subtracted_ms": {r: round(fig.wait_ms.get(r, 0.0), 3) for r in top},
        "cuda": [r for r in top if r in fig.cuda],
    }
    advice = (
        f"Communication not hidden by compute takes {statistics.fmean(shares.values()):.0%} of "
        "the step: overlap it (DistributedDataParallel's bucket_cap_mb, FSDP's prefetch) or do "
        "it less often (gradient accumulation under DDP's no_sync(), a larger batch)."
    )
    return _over_ranks(fig, "exposed_comm", costs, more, advice, top)


def launch_bound(fig: Figures, th: dict[str, float]) -> Finding | None:
    costs: dict[int, float] = {}
    steps: dict[int, list[int]] = {}
    for r, entry in fig.launch.items():
        if not entry.get("launch_bound"):
            continue
        bound = set(entry["launch_bound"])
        recorded = fig.device_steps.get(r) or []
        if not recorded:
            continue
        idle_us = sum(span - busy for s, busy, span in recorded if int(s) in bound)
        ms = idle_us / 1e3 / len(recorded)
        ms -= fig.spent.get("optimizer_foreach", {}).get(r, 0.0)  # its loop's launches
        step = fig.step_ms.get(r) or fig.median_step_ms
        if step and ms >= th["min_share"] * step:
            costs[r], steps[r] = ms, sorted(bound)
    if not costs:
        return None
    fig.spent["launch_bound"] = costs
    top = shown(costs)
    more = {
        "launch_bound_steps": {r: steps[r] for r in top},
        "delay_p50_us": {r: fig.launch[r].get("delay_p50_us") for r in top},
        "short_share": {r: fig.launch[r].get("short_share") for r in top},
    }
    return _over_ranks(fig, "launch_bound", costs, more, ADVICE["launch_bound"], top)


def idles(fig: Figures) -> dict[int, float]:
    """Each rank's device idle a step (its breakdown's ``other_us``, as ``_per_step`` scales
    it), for the ranks with a window; made once a window (several rules read it)."""
    if fig.idle is None:
        fig.idle = {
            r: _per_step(fig, r, row.get("other_us", 0.0))
            for r, row in fig.breakdown.items()
            if row.get("window_us", 0.0) > 0
        }
    return fig.idle


def idle_ms(fig: Figures, rank: int) -> float:
    """A CUDA rank's device idle a step (``idles``); 0 when not known."""
    return idles(fig).get(rank, 0.0)


TAKEN_FROM_IDLE = (
    "launch_bound", "dataloader", "host_sync", "optimizer_foreach", "host_contention"
)  # fmt: skip
"""What ``gpu_idle`` takes off a rank's idle: the idle of its launch-bound steps, its host
loading data, the idle its syncs left (at most), its optimizer loop's launches, its host
thread's wait for a CPU (at most)."""


def gpu_idle(fig: Figures, th: dict[str, float]) -> Finding | None:
    costs: dict[int, float] = {}
    idle = idles(fig)
    left = {r: idle[r] for r in sorted(fig.cuda) if r in idle}
    for rule in TAKEN_FROM_IDLE:  # (each rule's counted ranks: fewer than the window's, often)
        for r, ms in fig.spent.get(rule, {}).items():
            if r in left:
                left[r] -= ms
    for r, ms in left.items():
        step = fig.step_ms.get(r) or fig.median_step_ms
        if step and ms > th["share"] * step:
            costs[r] = ms
    if not costs:
        return None
    spent = fig.spent.get("launch_bound", {})
    top = shown(costs)
    more = {
        "idle_share": {r: round(fig.breakdown[r].get("other_share", 0.0), 4) for r in top},
        "launch_bound_subtracted_ms": {r: round(spent.get(r, 0.0), 3) for r in top},
    }
    return _over_ranks(fig, "gpu_idle", costs, more, ADVICE["gpu_idle"], top)


def memory_peak(fig: Figures, th: dict[str, float]) -> Finding | None:
    device = th["device_gib"] * 2**30
    if device <= 0 or not fig.cuda:
        return None  # the device's memory is not known: quiet
    over = {r: p for r, p in fig.peaks.items() if r in fig.cuda and p > th["share"] * device}
    if not over:
        return None
    ranks = sorted(over)
    evidence = {
        "peak_bytes": {r: over[r] for r in ranks},
        "device_bytes": int(device),
        "share": {r: round(over[r] / device, 4) for r in ranks},
    }
    advice = (
        f"{_names(ranks).capitalize()} peak{'s' * (len(ranks) == 1)} over "
        f"{th['share']:.0%} of the device's memory: lower it before the allocator's retries or an "
        "OOM cost steps (torch.utils.checkpoint, torch.autocast, a smaller micro-batch)."
    )
    return _finding(fig, "memory_peak", ranks, 0.0, evidence, advice)


def _judged(
    rule: str, judge: Callable[[Figures, dict[str, float]], more.Judged]
) -> Callable[[Figures, dict[str, float]], Finding | None]:
    """A rule of ``findings_more``: what its judge costs counted in ``fig.spent``, its finding
    over their ranks (its evidence bounded as ``_gpu_rule``'s)."""
    return _gpu_rule(rule, judge, counted=True)


def _gpu_rule(
    rule: str,
    judge: Callable[[Figures, dict[str, float]], device.Judged],
    at_most_idle: bool = False,
    counted: bool = False,
) -> Callable[[Figures, dict[str, float]], Finding | None]:
    """A rule of ``findings_device``: its finding over the ranks its judge costs, each per-rank
    figure of its evidence bounded as ``ms_per_step`` is (``shown``). ``at_most_idle``: a host
    wait, costing a rank at most its device's idle a step (``idle_ms``: a wait while the device
    runs costs the step nothing), counted in ``fig.spent`` (``gpu_idle`` takes it off);
    ``counted``: its costs counted in ``fig.spent`` as they are."""

    def run(fig: Figures, th: dict[str, float]) -> Finding | None:
        got = judge(fig, th)
        if got is None:
            return None
        costs, more, advice = got
        judged = costs.keys()
        if at_most_idle:
            idle, waits = idles(fig), costs
            costs = {r: m for r, c in waits.items() if (m := min(c, idle.get(r, 0.0))) > 0}
            if not costs:
                return None
        if at_most_idle or counted:
            fig.spent[rule] = costs
        top = shown(costs)
        if len(top) < len(judged):  # (each per-rank figure of the judge's, for those shown)
            more = {k: {r: v[r] for r in top} if isinstance(v, dict) and v.keys() == judged
                    else v for k, v in more.items()}  # fmt: skip
        if at_most_idle:
            more["wait_ms"] = {r: round(waits[r], 3) for r in top}
        return _over_ranks(fig, rule, costs, more, advice, top)

    return run


TB = "torch-tb-profiler's recommendations"
MIN_SHARE = Threshold(0.02, 0.0, 1.0, "issue 57's no-false-alarm bound: 2% of the step")
PATTERNS = "PyTorch's pattern matcher (torch.profiler._pattern_matcher)"
NSYS = "nsys analyze"
QUIET_SHARE = Threshold(
    0.01,
    0.0,
    1.0,
    f"half issue 57's no-false-alarm bound (2% of the step); {NSYS} "
    "(cuda_api_sync, cuda_memcpy_async) flags any: 0 does too",
)
RULES: dict[str, Rule] = {
    r.id: r
    for r in (
        Rule("host_contention", {"min_share": MIN_SHARE},
             _judged("host_contention",
                     lambda fig, th: more.host_contention(fig, th, idles(fig))),
             "the training thread's wait for a CPU (Linux schedstat run_delay), per step"),
        Rule("dataloader", {
            "share": Threshold(0.05, 0.0, 1.0, f"{TB}: DataLoader over 5% of the step"),
        }, dataloader, "a rank's time inside its DataLoader's __next__, per step"),
        Rule("zero_grad", {
            "min_share": Threshold(0.0, 0.0, 1.0, f"{PATTERNS}: GradNotSetToNonePattern flags "
                                   "any aten::zero_ under a zero_grad (0: any time)"),
        }, zero_grad, "the ops that zero gradients under a zero_grad, per step"),
        Rule("optimizer_foreach", {
            "op_saving_us": Threshold(1.0, 0.0, 1e3, "what foreach=True saved a per-parameter "
                                      "op, measured: 1.2-1.9 us (core.findings_more)"),
            "max_op_us_cpu": Threshold(40.0, 0.0, 1e6, "a CPU rank's ops over this long each: "
                                       "foreach saved nothing, measured (core.findings_more)"),
            "min_share": MIN_SHARE,
        }, _judged("optimizer_foreach", more.optimizer_foreach),
             "an optimizer step's per-parameter ops where a foreach form exists, per step"),
        Rule("collective_wait", {"min_share": MIN_SHARE}, collective_wait,
             "the last arriver of the window's collectives and the others' wait for it"),
        Rule("straggler", {
            "ratio": Threshold(1.25, 1.0, 100.0, "the config's straggler_threshold (1.25)"),
            "min_share": MIN_SHARE,
        }, straggler, "a rank whose step or compute time is over ratio x the median"),
        Rule("exposed_comm", {
            "share_cuda": Threshold(0.05, 0.0, 1.0, "TraceLens: exposed communication over 5%"),
            "share_cpu": Threshold(0.10, 0.0, 1.0, f"{TB}: communication over 10% of the step"),
        }, exposed_comm, "communication not hidden by compute, less the wait in collectives"),
        Rule("launch_bound", {"min_share": MIN_SHARE}, launch_bound,
             "the device idle of launch-bound steps (HTA's launch statistics)"),
        Rule("host_sync", {"min_share": QUIET_SHARE},
             _gpu_rule("host_sync", device.host_sync, at_most_idle=True),
             "the host's wait in device synchronizations, by causing op"),
        Rule("gpu_idle", {
            "share": Threshold(0.15, 0.0, 1.0, "TraceLens: idle over 15% of the step"),
        }, gpu_idle, "a CUDA rank's device idle, less its launch-bound steps'"),
        Rule("memcpy_pageable", {"min_share": QUIET_SHARE},
             _gpu_rule("memcpy_pageable", device.memcpy_pageable),
             "the device time of copies from or to pageable memory"),
        Rule("tf32_off", {
            "min_share": MIN_SHARE,
            "speedup": Threshold(2.0, 1.0, 100.0, "a conservative TF32 over fp32 GEMM speedup "
                                 "(NVIDIA's A100: 156 over 19.5 TFLOPS, 8x)"),
        }, _gpu_rule("tf32_off", device.tf32_off),
             "fp32 GEMMs or convolutions without TF32 on Ampere+, each kind judged on its own"),
        Rule("matmul_alignment", {
            "min_share": MIN_SHARE,
            "speedup": Threshold(1.5, 1.0, 100.0, "a conservative aligned over misaligned "
                                 "fp16/bf16 GEMM speedup (NVIDIA's Matrix Multiplication "
                                 "Background guide, Tensor Core Requirements: dims multiples "
                                 "of 8 for full Tensor Core efficiency)"),
        }, _gpu_rule("matmul_alignment", device.matmul_alignment),
             "fp16/bf16 matmul kernels whose dims are not multiples of 8"),
        Rule("memory_peak", {
            "share": Threshold(0.90, 0.0, 1.0, f"{TB}: peak memory over 90% of the device"),
            "device_gib": Threshold(0.0, 0.0, 1e6, "the device's memory (0: not known, quiet)"),
        }, memory_peak, "a device memory peak near the device's memory"),
        Rule("memory_leak", {
            "min_mib_per_min": Threshold(0.0, 0.0, 1e9, "the memory book's leak marks "
                                         "(memory.leak_min_mib_per_min); 0: every mark"),
        }, _judged("memory_leak", more.memory_leak),
             "a rank the memory book marks as leaking, and its node's time left"),
    )
}  # fmt: skip
"""Every rule, in the order overlaps are resolved (the module docstring)."""


def checked_advise(value: Any) -> Settings:
    """The config's ``advise`` mapping checked: ``{rule_id: {threshold: number}}``; ValueError
    naming the rule, the threshold and the value (an unknown one with the closest valid)."""
    if value is None or not hasattr(value, "keys"):
        raise ValueError(
            "profiler config: 'advise' must be a mapping of rule ids to their thresholds, "
            f"got {type(value).__name__}: {value!r:.80}"
        )
    keys = list(value.keys())
    check_known_keys(keys, list(RULES), prefix="advise.")
    out: Settings = {}
    for rule in keys:
        given = value[rule]
        if given is None or not hasattr(given, "keys"):
            raise ValueError(
                f"profiler config: 'advise.{rule}' must be a mapping of thresholds "
                f"({', '.join(RULES[rule].thresholds)}), got {type(given).__name__}: {given!r:.80}"
            )
        names = list(given.keys())
        check_known_keys(names, list(RULES[rule].thresholds), prefix=f"advise.{rule}.")
        out[str(rule)] = {str(n): _threshold(rule, n, given[n]) for n in names}
    return out


def _threshold(rule: str, name: str, v: Any) -> float:
    t = RULES[rule].thresholds[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(
            f"profiler config: 'advise.{rule}.{name}' must be a finite number, "
            f"got {type(v).__name__}: {v!r:.80}"
        )
    if not t.low <= v <= t.high:
        raise ValueError(
            f"profiler config: 'advise.{rule}.{name}' must be in {t.low:g}..{t.high:g}, got {v}"
        )
    return float(v)


def figures_of(table: Mapping[str, Any], collectives: Mapping[str, Any] | None) -> Figures:
    """The rules' figures from a ``kernel_summary()`` table and, when given, the window's
    ``collectives()`` reply (its last arriver and each rank's own wait are then exact)."""
    s = table.get("stragglers") or {}
    step_ms = {int(r): v["step_ms"] for r, v in s.get("ranks", {}).items() if v.get("step_ms")}
    la = (collectives or {}).get("last_arriver") or s.get("last_arriver")
    wait: dict[int, float] = {}
    if la is not None:
        wait = {int(r): float(la["wait_ms_per_step"]) for r in la["waiting_ranks"]}
    for rc in (collectives or {}).get("ranks", []):
        per = rc["wait_us_per_step"]
        if per:
            wait[int(rc["rank"])] = sum(per.values()) / len(per) / 1e3
    rows = _by_rank((table.get("breakdown") or {}).get("ranks", {}))
    if not step_ms:  # no step marker: the window is one step
        n = step_count(list(table.get("steps") or []))
        step_ms = {r: v["window_us"] / 1e3 / n for r, v in rows.items() if v.get("window_us")}
    median = s.get("median_step_ms") or (statistics.median(step_ms.values()) if step_ms else 0.0)
    device_steps = table.get("device_steps") or {}
    cuda = {int(r) for r in device_steps} | {int(r) for r in table.get("launch") or {}}
    if table.get("device") == "cuda":
        cuda |= {int(r) for r in (table.get("breakdown") or {}).get("ranks", {})}
    memory = table.get("memory") or {}
    return Figures(
        window=table.get("window"),
        steps=list(table.get("steps") or []),
        ranks=sorted(int(r) for r in table.get("ranks") or s.get("ranks", {})),
        step_ms=step_ms,
        median_step_ms=float(median),
        stragglers=s,
        breakdown=rows,
        cuda=cuda,
        launch=_by_rank(table.get("launch") or {}),
        device_steps=_by_rank(device_steps),
        peaks={int(r): int(p) for r, p in (memory.get("peak_bytes") or {}).items()},
        last_arriver=la,
        wait_ms=wait,
        gpu=_by_rank(table.get("gpu") or {}),
        scale=_scales(rows, step_ms),
        synced=la is not None or bool((collectives or {}).get("matched")),
    )


def _by_rank(d: Mapping[Any, Any]) -> dict[int, Any]:
    """``d`` keyed by int ranks: a live table's already are (a copy), one read back from JSON
    has them as text (each converted)."""
    if not d or type(next(iter(d))) is int:
        return dict(d)
    return {int(r): v for r, v in d.items()}


def window_findings(
    table: Mapping[str, Any],
    collectives: Mapping[str, Any] | None = None,
    settings: Mapping[str, Mapping[str, float]] | None = None,
    memory: Mapping[str, Any] | None = None,
) -> tuple[list[Finding], list[str]]:
    """Every rule's finding of one window (``figures_of``), the costliest first, and the ids
    of the rules that stayed quiet. ``settings``: the config's ``advise`` (checked);
    ``memory``: the run's ``memory()`` reply (``memory_leak``'s marks; None: none)."""
    fig = figures_of(table, collectives)
    fig.memory = more.leak_figures(memory, table.get("trainer_id"))
    found: list[tuple[float, int, Finding]] = []
    quiet: list[str] = []
    for order, rule in enumerate(RULES.values()):
        th = {n: t.default for n, t in rule.thresholds.items()}
        th.update((settings or {}).get(rule.id, {}))
        if rule.id == "straggler" and "ratio" not in (settings or {}).get(rule.id, {}):
            th["ratio"] = float(fig.stragglers.get("threshold") or th["ratio"])
        f = rule.judge(fig, th)
        if f is None:
            quiet.append(rule.id)
        else:
            found.append((-f["cost_ms_per_step"], order, f))
    return [f for *_, f in sorted(found, key=lambda x: (x[0], x[1]))], quiet
