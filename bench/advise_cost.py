"""What a window's findings (issue 57) cost the coordinator: the rules at 1,024 ranks.

``advise()`` (``coordinator/service/advise_reads.py``) reuses two reads: the window's
``kernel_summary()`` table and its ``collectives()`` reply. This times what it adds once it has
both, on the coordinator's reads thread: ``core.findings.window_findings`` (``figures_of`` and
the six rules), against the budget of 5 ms a window (issue 57, item 6); and the whole
``advise()`` once its two reads have answered (the executor hop, the problem lines, the reply).

The window: ``--ranks`` ranks of ``bench/scale_sim.py``'s template (2,000 kernels, device
"cuda" with a breakdown but no device figures), ``--per-rank`` collectives each
(``scale_sim.collective_blocks``), folded into node partials and a ``WindowAggregate`` as
``ingest_partial`` does; its last arriver found as ``StragglerRefresh`` finds it; the table
``WindowAggregate.to_dict`` as ``kernel_summary()`` answers it (``top_k`` 0, not per rank);
the reply ``window_collectives`` as ``collectives()`` matches it (``shown`` 0). Two windows:

- ``template``: the template's ranks as they are (communication 10% of every rank's window,
  less its wait: ``exposed_comm`` names 607 ranks; no launch statistics, device steps or peaks);
- ``cuda``, the worst case, every rule but ``collective_wait`` and ``straggler`` firing on many
  ranks: each rank also with its device steps, launch statistics and a peak of memory (one in
  8 launch-bound in every step, one in 16 at 95% of an 80 GiB device: ``memory_peak``'s
  ``device_gib`` set to 80), its host time (``HostRow``: one rank in 32 in its DataLoader for
  30% of its step, the others 1%; every rank zeroing its gradients for 2%; one in 8 stepping
  its optimizer in a per-parameter loop; one in 32 waiting for a CPU 5% of its step, the
  others 0.5%, ``host_contention``'s ``min_share`` set to 1% as the template's ranks idle 1.7%
  of their step), its GPU figures (``GpuRow``: every rank waiting 2% of its step in 6 syncs of
  2 causing ops, one in 4 copying pageable memory for 2%, one in 16 running its GEMMs in fp32
  without TF32 for 10% and another its convolutions for 8%, one in 16 its fp16 matmuls with
  dims not multiples of 8 for 5%), and the memory book's marks (``memory_marks``: one rank in
  64 leaking): ``host_contention`` names 32 ranks, ``dataloader`` 32, ``zero_grad`` 1,024,
  ``optimizer_foreach`` 128, ``exposed_comm`` 607, ``launch_bound`` 128, ``host_sync`` 1,024,
  ``memcpy_pageable`` 256, ``tf32_off`` 128, ``matmul_alignment`` 64, ``memory_peak`` 64,
  ``memory_leak`` 16.

CPU time is ``time.process_time`` (every thread of the process), the best of ``--rounds``.

Run: .venv/bin/python bench/advise_cost.py [--ranks 1024] [--per-rank 200] [--rounds 50]

Last figures (2026-12-08, the commit that wrote them; this shared 2-core machine at a load of
0.9-1.0, 3 runs of 40 rounds): ``window_findings`` 2.0-2.1 ms a window on the template
(0.40-0.42x the 5 ms budget; ``figures_of`` 0.6-0.7 ms), 5.4-5.8 ms on the CUDA window
(1.08-1.17x: over the budget; ``figures_of`` 0.9-1.0 ms; each rule 0.1-0.7 ms). The rank's two
CPU-wait reads a window (``rank_reads``): 5.4-5.5 us at its start, 5.6-6.1 us at its stop, on
the training thread, with no thread of their own: the closing step pays about 6 us, no later
step anything.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
import timeit
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from collectives_cost import best  # noqa: E402
from scale_sim import PER_NODE, collective_blocks, node_ranks, template  # noqa: E402

from coordinator.core.aggregate import WindowAggregate, find_arriver, keep_arriver  # noqa: E402
from coordinator.core.collectives import window_collectives  # noqa: E402
from coordinator.core.findings import RULES, figures_of, window_findings  # noqa: E402
from coordinator.core.findings_more import leak_figures  # noqa: E402
from coordinator.core.partial import fold_summaries  # noqa: E402
from coordinator.protocol.partial_codec import decode_partial, encode_partial  # noqa: E402
from coordinator.protocol.summary_codec import (  # noqa: E402
    GpuRow,
    HostRow,
    LaunchRow,
    RankSummary,
    SyncCause,
)
from coordinator.service.advise_reads import advise  # noqa: E402

BUDGET_MS = 5.0
DEVICE_GIB = 80.0


def with_device(s: RankSummary) -> RankSummary:
    """``s`` with a CUDA rank's device figures: device steps, launch statistics, a peak."""
    rnd = random.Random(s.rank)
    bound = s.rank % 8 == 0
    s.step_device = [
        (step, us * (0.4 if bound else 0.9), us) for step, us in s.step_us
    ]  # fmt: skip
    s.launch = LaunchRow(50_000, rnd.uniform(5.0, 40.0), rnd.uniform(40.0, 400.0), 0.7 * bound)
    s.launch_bound = [step for step, _ in s.step_us] if bound else []
    share = 0.95 if s.rank % 16 == 0 else rnd.uniform(0.3, 0.8)
    s.peak_bytes = int(share * DEVICE_GIB * 2**30)
    step = sum(us for _, us in s.step_us) / max(len(s.step_us), 1)
    loop = s.rank % 8 == 4  # one in 8: an optimizer's per-parameter loop, 1 op a 20 us of step
    s.host = HostRow(
        (0.3 if s.rank % 32 == 0 else 0.01) * step, 4, 0.02 * step, 64,
        0.05 * step, step / 20.0 * loop, 0.0 if loop else 12.0,
        (0.05 if s.rank % 32 == 16 else 0.005) * step,  # waiting for a CPU
    )  # fmt: skip
    causes = (SyncCause("aten::item", 0.016 * step, 4), SyncCause("aten::nonzero", 0.004 * step, 2))
    page = 0.02 * step if s.rank % 4 == 0 else 0.0
    fp32, tf32 = (0.1 * step, 0.0) if s.rank % 16 == 0 else (0.01 * step, 0.3 * step)
    odd = s.rank % 16 == 8  # one in 16: fp16 matmuls not multiples of 8 for 5% of its step
    shapes = ("aten::mm [4095, 1024] [1024, 50257]", "aten::addmm [50257] [4095, 1024]") * odd
    s.gpu = GpuRow(
        0.02 * step, 6, causes, page, 8 * (page > 0), fp32, tf32,
        misaligned_mm_us=0.05 * step * odd, misaligned_mm_ops=48 * odd,
        misaligned_mm_shapes=shapes,
        fp32_conv_us=(0.08 if s.rank % 16 == 4 else 0.005) * step,
        tf32_conv_us=0.0 if s.rank % 16 == 4 else 0.1 * step, mm_ops_shaped=96,
    )  # fmt: skip
    return s


def window(ranks: int, per_rank: int, cuda: bool) -> WindowAggregate:
    """The window's aggregate, its node partials folded in and its last arriver found."""
    bl = collective_blocks(ranks, per_rank)

    def rank(r: int) -> RankSummary:
        s = template(r)
        s.collectives = bl[r]
        return with_device(s) if cuda else s

    agg = WindowAggregate(0)
    for n, first in enumerate(range(0, ranks, PER_NODE)):
        part = fold_summaries(f"node-{n}", [rank(r) for r in node_ranks(first, ranks)])
        agg.add_partial(decode_partial(encode_partial(part)))
    snap = agg.snapshot()
    keep_arriver(agg, snap, find_arriver(snap))  # (what StragglerRefresh does off the loop)
    return agg


def reads(agg: WindowAggregate) -> tuple[dict[str, Any], dict[str, Any]]:
    """What ``kernel_summary()`` and ``collectives()`` answer for the window (the parts the
    rules read: the service adds the run, trainer and window's names)."""
    table = dict(agg.snapshot().to_dict(0, 1.25, False, "kernel"))
    blocks: dict[int, bytes | None] = dict.fromkeys(agg.rank_totals, None)
    blocks.update(agg.collectives)
    nodes = {r: f"node-{r // PER_NODE}" for r in blocks}
    step = sorted(agg.rank_step_ms.values())[len(agg.rank_step_ms) // 2]
    coll = dict(window_collectives(blocks, nodes, 0, step, dict(agg.rank_step_ms)))
    return table, coll


def memory_marks(ranks: int) -> dict[str, Any]:
    """The run's ``memory()`` reply as ``advise()`` reads it (its marks, no series): every
    rank sampled, one in 64 marked as leaking 30 MiB a minute on its node of 64 GiB."""
    nodes = {f"node-{n}": {"total_bytes": 64 << 30, "available_bytes": 20 << 30}
             for n in range(0, ranks // PER_NODE + 1)}  # fmt: skip
    entries = []
    for r in range(ranks):
        growth = {"bytes_per_min": 30.0 * 2**20, "time_left_s": 4e3, "since": 1e6}
        entries.append({
            "rank": r, "trainer_id": "policy", "node_id": f"node-{r // PER_NODE}",
            "rss_bytes": 6 << 30, "culprit": r % 64 == 0, "growth": growth if r % 64 == 0 else None,
        })  # fmt: skip
    return {"ranks": entries, "nodes": nodes}


class Answered:
    """Stands in for ``service.readers.Readers`` once its two reads have answered: ``advise()``
    gets the finished table and reply back (and the memory book's marks), and runs the rules
    on a reads thread of its own."""

    def __init__(
        self, table: dict[str, Any], coll: dict[str, Any], memory: dict[str, Any] | None
    ) -> None:
        self.table, self.coll, self.memory = {**table, "run": "bench"}, coll, memory
        self.shell = self
        self.reads = ThreadPoolExecutor(1)

    async def memory_recorded(self, *_: Any) -> dict[str, Any] | None:
        return self.memory

    def find_run(self, run: str | None) -> None:
        return None

    async def kernel_summary(self, *_: Any) -> dict[str, Any]:
        return self.table

    async def collectives(self, *_: Any) -> dict[str, Any]:
        return self.coll


def advise_cpu(
    table: dict[str, Any], coll: dict[str, Any], memory: dict[str, Any] | None, rounds: int
) -> float:
    """The least CPU time of ``rounds`` ``advise()`` calls on answered reads."""
    readers = Answered(table, coll, memory)

    async def go() -> float:
        times = []
        for _ in range(rounds):
            t0 = time.process_time()
            await advise(readers)  # type: ignore[arg-type]
            times.append(time.process_time() - t0)
        return min(times)

    try:
        return asyncio.run(go())
    finally:
        readers.reads.shutdown()


def per_rule(
    table: dict[str, Any], coll: dict[str, Any], settings: Any, memory: Any, rounds: int
) -> str:
    """Each rule's least CPU time over ``rounds`` runs of all of them in order (they share
    the figures: an earlier rule's time is subtracted by a later one)."""
    least: dict[str, float] = {}
    for _ in range(rounds):
        fig = figures_of(table, coll)
        fig.memory = leak_figures(memory, None)
        for rule in RULES.values():
            th = {n: t.default for n, t in rule.thresholds.items()}
            th.update(settings.get(rule.id, {}))
            t0 = time.process_time()
            rule.judge(fig, th)
            least[rule.id] = min(least.get(rule.id, 1.0), time.process_time() - t0)
    return ", ".join(f"{r} {s * 1e3:.2f}" for r, s in least.items())


def run(ranks: int, per_rank: int, rounds: int, cuda: bool) -> None:
    agg = window(ranks, per_rank, cuda)
    table, coll = reads(agg)
    settings: dict[str, dict[str, float]] = {}
    if cuda:  # (the template's ranks idle 1.7% of their step: host_contention's cap, at 1%)
        settings = {
            "memory_peak": {"device_gib": DEVICE_GIB},
            "host_contention": {"min_share": 0.01},
        }
    memory = memory_marks(ranks) if cuda else None
    window_findings(table, coll, settings, memory)  # (warm)
    rules, (found, quiet) = best(lambda: window_findings(table, coll, settings, memory), rounds)
    figs, _ = best(lambda: figures_of(table, coll), rounds)
    whole = advise_cpu(table, coll, memory, rounds)
    each = per_rule(table, coll, settings, memory, rounds)
    names = ", ".join(f"{f['rule']} ({len(f['ranks'])} ranks)" for f in found)
    label = "cuda (device steps, launch, peaks)" if cuda else "template (breakdown only)"
    parts = [
        f"{label}, {ranks} ranks x {per_rank} collectives: window_findings {rules * 1e3:.2f} ms "
        f"of CPU a window ({rules * 1e3 / BUDGET_MS:.2f}x the {BUDGET_MS:g} ms budget), of "
        f"which figures_of {figs * 1e3:.2f} ms",
        f"the whole advise() once its two reads answered {whole * 1e3:.2f} ms "
        f"(+{(whole - rules) * 1e3:.2f} ms)",
        f"findings: {names or 'none'}",
        f"quiet: {', '.join(quiet) or 'none'}",
        f"each rule, ms: {each}",
    ]
    print("; ".join(parts))


def rank_reads(rounds: int = 20_000) -> None:
    """What ``host_contention`` costs a rank's training thread: its two schedstat reads a
    window (``worker_ext.rank.cpu_wait``), wall time each, the best of 5 batches."""
    from worker_ext.rank.cpu_wait import per_step, run_delay_ns, waited_ns

    start = run_delay_ns()
    first = min(timeit.repeat(run_delay_ns, number=rounds, repeat=5)) / rounds
    end = min(timeit.repeat(lambda: per_step(waited_ns(start), (1, 10)), number=rounds, repeat=5))
    print(f"the rank's CPU-wait reads: {first * 1e6:.1f} us at a window's start, "
          f"{end / rounds * 1e6:.1f} us at its stop (no thread; no other step pays)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in (("--ranks", 1024), ("--per-rank", 200), ("--rounds", 50)):
        ap.add_argument(flag, type=int, default=default)
    args = ap.parse_args()
    for cuda in (False, True):
        run(args.ranks, args.per_rank, args.rounds, cuda)
    rank_reads()


if __name__ == "__main__":
    main()
