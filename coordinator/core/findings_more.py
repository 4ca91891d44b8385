"""Three more of a window's findings (issue 57; docs/advise.md): ``host_contention``,
``optimizer_foreach`` and ``memory_leak``. Pure: no Ray, no torch. ``core.findings``
registers them in its rule table (``RULES``) and makes their findings (``_judged``): each
judge here gives the ranks' costs in ms a step, the evidence beyond them and the advice, or
None (quiet).

``host_contention``: a rank whose training thread (the one driving its profiler) was ready
to run but waited for a CPU over ``min_share`` of its step, a mean over the recorded steps (the
summary's ``cpu_wait_us_per_step``: Linux's schedstat ``run_delay``, read by the rank as the
recorded steps begin and end, ``worker_ext.rank.cpu_wait``). That is real lost time, but the
host's: more runnable threads than cores (DataLoader workers, intra-op threads, other jobs).
Its cost is that wait a step; on a CUDA rank at most its device's idle a step (``idle``: the
device runs its queued kernels while the host waits).

``optimizer_foreach`` (PyTorch's pattern matcher flags an optimizer without ``foreach``): a
rank whose torch optimizer step (``Optimizer.step#AdamW.step`` ...: the optimizers with a
foreach form) ran per-parameter math (``aten::add_``, ``mul_``, ``addcdiv_`` ... outermost
under the step) and no ``aten::_foreach_*`` / ``aten::_fused_*`` op. Its cost, conservative:
``op_saving_us`` for each per-parameter op a step, at most the step's own inclusive time. The
saving an op, measured on this project's CPU machine (AdamW and SGD over 100 ``Linear(64,
64)`` layers, 200 parameters, ``foreach=False`` against ``foreach=True``, unprofiled): 1.2 to
1.9 us an op (AdamW: 15.9 ms against 12.1 ms a step, 2,000 ops); profiled, 3.5 us. On a CPU
rank the foreach form saves nothing once the ops are long (256-wide layers, 16 us an op:
foreach was slower), so a CPU rank whose ops take over ``max_op_us_cpu`` each is quiet; on a
CUDA rank each op is a kernel launch, which the foreach form batches whatever the size.

``memory_leak``: a rank the coordinator's memory book marks as leaking (steady growth of its
resident memory over ``memory.leak_span_s``, ``core.memory``), with its rate a second and a
step, its memory now, its node's memory and the time left before the node's available memory
is gone at the rates of its marked ranks. It costs no step time (0 ms): a leak costs nothing
until the node runs out, then the run. Its figures are the memory book's as of the read (the
live run's; a trace read offline has none).

Overlaps (the rules run in ``RULES``' order): ``host_contention`` runs first (a thread that
could not run is the cause of whatever it was doing late) and is one of ``findings.HOST_RULES``:
``collective_wait`` and ``straggler`` take off the late or slow rank's CPU wait beyond the
others' mean, ``gpu_idle`` what it counted on a CUDA rank. A wait that fell inside the
DataLoader's ``__next__`` or a gradient zeroing is in that rule's time too (the wait is not
located within the step). ``optimizer_foreach`` runs with the host rules,
after ``zero_grad`` (the zeroing is its own span, not the step's), and is one of
``findings.HOST_RULES``: ``collective_wait`` and ``straggler`` take off what it counted on a
late or slow rank beyond the others' mean (ranks alike take nothing off); ``launch_bound`` and
``gpu_idle`` take off what it counted on a CUDA rank (the device idles while the loop
launches). ``memory_leak`` costs no time, so it overlaps none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

MiB = 1 << 20
Judged = tuple[dict[int, float], dict[str, Any], str] | None
"""A judge's answer: each rank's cost in ms a step, the evidence beyond it, the advice."""


class Window(Protocol):
    """What the judges read of ``findings.Figures``."""

    step_ms: dict[int, float]
    median_step_ms: float
    breakdown: dict[int, Mapping[str, float]]
    cuda: set[int]
    memory: list[dict[str, Any]] | None


CONTENTION_ADVICE = (
    "The training thread waits for a CPU: the host runs more busy threads than it has cores. "
    "Run fewer a core: fewer DataLoader workers (DataLoader(num_workers=N)), fewer intra-op "
    "threads (OMP_NUM_THREADS, torch.set_num_threads), the ranks' cores apart (one rank per "
    "GPU's cores: taskset, os.sched_setaffinity), and no other jobs on the node."
)


def host_contention(fig: Window, th: dict[str, float], idle: Mapping[int, float]) -> Judged:
    """Each rank's wait for a CPU a step over ``min_share`` of its step (a CUDA rank's at most
    its device's idle a step, ``idle``)."""
    costs: dict[int, float] = {}
    waits: dict[int, float] = {}
    steps: dict[int, float] = {}
    for r, row in fig.breakdown.items():
        wait = row.get("cpu_wait_us_per_step", 0.0) / 1e3
        step = fig.step_ms.get(r) or fig.median_step_ms
        ms = min(wait, idle.get(r, 0.0)) if r in fig.cuda else min(wait, step or wait)
        if ms > 0 and step and ms > th["min_share"] * step:
            costs[r], waits[r], steps[r] = ms, wait, step
    if not costs:
        return None
    more = {
        "cpu_wait_ms": {r: round(waits[r], 3) for r in costs},
        "share_of_step": {r: round(waits[r] / steps[r], 4) for r in costs},
        "step_ms": {r: round(steps[r], 3) for r in costs},
    }
    return costs, more, CONTENTION_ADVICE


def optimizer_foreach(fig: Window, th: dict[str, float]) -> Judged:
    costs: dict[int, float] = {}
    ops: dict[int, float] = {}
    step_us: dict[int, float] = {}
    for r, row in fig.breakdown.items():
        opt_us = row.get("optimizer_us_per_step", 0.0)
        loop = row.get("optimizer_loop_ops_per_step", 0.0)
        if not opt_us or not loop or row.get("optimizer_foreach_ops_per_step", 0.0) > 0:
            continue
        if r not in fig.cuda and opt_us / loop > th["max_op_us_cpu"]:
            continue  # (long ops on a CPU rank: foreach saves nothing there)
        ms = min(loop * th["op_saving_us"], opt_us) / 1e3
        if ms > th["min_share"] * (fig.step_ms.get(r) or fig.median_step_ms):
            costs[r], ops[r], step_us[r] = ms, loop, opt_us
    if not costs:
        return None
    more = {
        "per_parameter_ops_per_step": {r: round(ops[r], 1) for r in sorted(costs)},
        "optimizer_step_ms": {r: round(step_us[r] / 1e3, 3) for r in sorted(costs)},
        "op_saving_us": th["op_saving_us"],
    }
    advice = (
        "The optimizer step runs a loop of per-parameter kernels: use its multi-tensor form "
        "(torch.optim.AdamW(..., foreach=True), the CUDA default when foreach is not set to "
        "False) or, on CUDA, the fused one (torch.optim.AdamW(..., fused=True))."
    )
    return costs, more, advice


def leak_figures(memory: Mapping[str, Any] | None, trainer_id: str | None) -> list[dict[str, Any]]:
    """The ranks of ``trainer_id`` a ``memory()`` reply marks as leaking, each with its
    node's memory (``nodes``); none without a reply."""
    if not memory:
        return []
    nodes = memory.get("nodes") or {}
    return [
        {**e, "node": nodes.get(e.get("node_id") or "")}
        for e in memory.get("ranks") or []
        if e.get("growth") and (trainer_id is None or e.get("trainer_id") == trainer_id)
    ]


def memory_leak(fig: Window, th: dict[str, float]) -> Judged:
    marked = [
        e for e in fig.memory or [] if e["growth"]["bytes_per_min"] / MiB >= th["min_mib_per_min"]
    ]
    if not marked:
        return None
    ev: dict[str, dict[int, Any]] = {k: {} for k in EVIDENCE}
    for e in sorted(marked, key=lambda e: -e["growth"]["bytes_per_min"])[:32]:
        r, g, node = int(e["rank"]), e["growth"], e.get("node") or {}
        per_s, step = g["bytes_per_min"] / 60.0, fig.step_ms.get(r) or fig.median_step_ms
        left = g["time_left_s"]
        got = (
            *(_mb(per_s, 3), _mb(per_s * step / 1e3, 3) if step else None, _mb(e.get("rss_bytes"))),
            *(_mb(node.get("total_bytes")), _mb(node.get("available_bytes"))),
            *(round(left, 1) if left is not None else None, g["since"], e.get("culprit")),
        )
        for key, v in zip(EVIDENCE, got, strict=True):
            ev[key][r] = v
    ranks = sorted(int(e["rank"]) for e in marked)
    left = [e["growth"]["time_left_s"] for e in marked if e["growth"]["time_left_s"] is not None]
    soon = f"; its node's memory is gone in about {min(left) / 60:.0f} min" if left else ""
    names = ", ".join(map(str, ranks[:8])) + (" ..." * (len(ranks) > 8))
    advice = (
        f"Rank{'s' * (len(ranks) > 1)} {names} grow{'s' * (len(ranks) == 1)} steadily in "
        f"host memory{soon}: look for objects kept across steps (a list of outputs or losses "
        "that keeps their graphs: keep loss.detach() instead; caches that only grow) with "
        "tracemalloc or memray in that process; where its GPU memory grows too, take a CUDA "
        "memory snapshot (ray-profiler memory --snapshot)."
    )
    return {r: 0.0 for r in ranks}, ev, advice


def _mb(v: float | None, digits: int = 1) -> float | None:
    return round(v / 1e6, digits) if v is not None else None


EVIDENCE = (
    *("mb_per_s", "mb_per_step", "rss_mb", "node_total_mb", "node_available_mb"),
    *("time_left_s", "since", "culprit"),
)
"""``memory_leak``'s evidence, each per rank (MB: 10**6 bytes; since: epoch seconds)."""
