"""What a window's collectives (issue 56) cost: the summary's bytes, the coordinator's CPU, the
reader's.

1. **Size**: one rank's summary (``bench/scale_sim.py``'s template: 2,000 kernels) with a
   ``CollectiveBlock`` of ``--calls`` collectives and without, as ``encode_summary`` writes it;
   the node partial of ``PER_NODE`` such ranks (``fold_summaries`` + ``encode_partial``) with and
   without; the block at the reader's default cap (``collective_reader.DEFAULT_CAP``).
2. **Coordinator CPU** (``time.process_time``, the best of ``--rounds``), a window of
   ``--ranks`` simulated ranks with ``--per-rank`` collectives each: the node partials' decode
   and fold into the window's aggregate (``decode_partial`` + ``WindowAggregate.add_partial``,
   what ``ingest_partial`` does) with the blocks and without, what the window's aggregate then
   holds (tracemalloc: each rank's collectives kept as their msgpack bytes) and its file in the
   store (``saved_aggregate``); one ``collectives()`` read's matching
   (``core.collectives.window_collectives``, decoding the bytes, on the coordinator's reads
   thread), against the budget of 1.5 s a window; and the window's last arriver
   (``aggregate.find_arriver``, what the stragglers' ``last_arriver`` matches once, off the
   event loop). The ranks' collectives:
   ``scale_sim.collective_blocks``.
3. **The reader**: ``summarise_trace`` on a real 2-rank gloo trace (torch.profiler, CPU) of
   ``--steps`` steps of small matmuls and 20 collectives each, against the collectives pass alone
   (``collectives_of`` on the read digest): what the pass adds to a summary.

Run: .venv/bin/python bench/collectives_cost.py [--ranks 1024] [--per-rank 200]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgspec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from scale_sim import PER_NODE, collective_blocks, node_ranks, template  # noqa: E402

from coordinator.core.aggregate import (  # noqa: E402
    WindowAggregate,
    find_arriver,
    saved_aggregate,
)
from coordinator.core.collectives import window_collectives  # noqa: E402
from coordinator.core.partial import fold_summaries  # noqa: E402
from coordinator.protocol.collective_replies import CollectiveBlock  # noqa: E402
from coordinator.protocol.partial_codec import decode_partial, encode_partial  # noqa: E402
from coordinator.protocol.summary_codec import RankSummary, encode_summary  # noqa: E402
from worker_ext.agent.collective_reader import DEFAULT_CAP  # noqa: E402


def best(fn: Callable[[], Any], rounds: int) -> tuple[float, Any]:
    """The least process CPU time of ``rounds`` calls, and the last call's result."""
    times, out = [], None
    for _ in range(rounds):
        t0 = time.process_time()
        out = fn()
        times.append(time.process_time() - t0)
    return min(times), out


def with_block(s: RankSummary, block: CollectiveBlock | None) -> RankSummary:
    s.collectives = block
    return s


def sizes(calls: int) -> None:
    """Part 1: bytes of a summary and a node partial with and without the block."""
    ranks = PER_NODE
    for n, label in ((calls, f"{calls} collectives"), (DEFAULT_CAP, f"the cap ({DEFAULT_CAP})")):
        bl = collective_blocks(ranks, n)
        bare = [template(r) for r in range(ranks)]
        full = [with_block(template(r), bl[r]) for r in range(ranks)]
        s0, s1 = len(encode_summary(bare[0])), len(encode_summary(full[0]))
        p0 = len(encode_partial(fold_summaries("n", bare)))
        p1 = len(encode_partial(fold_summaries("n", full)))
        print(
            f"size, {label} (groups '0' of {ranks} ranks and the node's): summary "
            f"{s0:,} -> {s1:,} B (+{s1 - s0:,} B, {(s1 - s0) / n:.1f} B a collective, "
            f"{s1 / s0:.2f}x); node partial of {ranks} ranks {p0:,} -> {p1:,} B "
            f"(+{(p1 - p0) / ranks:,.0f} B a rank, {p1 / p0:.2f}x)"
        )
    world = len(encode_summary(with_block(template(0), collective_blocks(1024, calls)[0])))
    print(
        f"size, {calls} collectives with group '0' of 1,024 ranks named in the block: {world:,} B"
    )


def partials(ranks: int, per_rank: int) -> dict[bool, list[bytes]]:
    """The window's node partials of ``ranks`` template ranks, without and with their blocks."""
    bl = collective_blocks(ranks, per_rank)
    return {
        on: [
            encode_partial(
                fold_summaries(
                    f"node-{n}",
                    [
                        with_block(template(r), bl[r] if on else None)
                        for r in node_ranks(first, ranks)
                    ],
                )
            )  # fmt: skip
            for n, first in enumerate(range(0, ranks, PER_NODE))
        ]
        for on in (False, True)
    }


def ingest(blobs: list[bytes]) -> WindowAggregate:
    """What ``ingest_partial`` does with each of a window's partials."""
    agg = WindowAggregate(0)
    for blob in blobs:
        agg.add_partial(decode_partial(blob))
    return agg


def retained(blobs: list[bytes]) -> tuple[float, WindowAggregate]:
    """MB the window's aggregate holds once ``blobs`` are in (tracemalloc), and it."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    agg = ingest(blobs)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / 2**20, agg


def coordinator(ranks: int, per_rank: int, rounds: int) -> WindowAggregate:
    """Part 2a: the coordinator's CPU and memory for a window's partials with and without the
    blocks, and the window's file in its store; the aggregate with them."""
    parts = partials(ranks, per_rank)
    ingest(parts[True])  # (warm)
    off_s, _ = best(lambda: ingest(parts[False]), rounds)
    on_s, _ = best(lambda: ingest(parts[True]), rounds)
    mb = [sum(map(len, parts[on])) / 2**20 for on in (False, True)]
    print(
        f"ingest, {ranks} ranks x {per_rank} collectives (2,000 kernels each), the node partials' "
        f"decode + fold: {off_s:.2f} s -> {on_s:.2f} s of CPU ({on_s / off_s:.2f}x, "
        f"+{(on_s - off_s) / ranks * 1e3:.2f} ms a rank); partials {mb[0]:.1f} -> {mb[1]:.1f} MB"
    )
    (mem0, agg0), (mem1, agg) = retained(parts[False]), retained(parts[True])
    n = ranks * per_rank
    files = [msgspec.msgpack.encode(saved_aggregate(a)) for a in (agg0, agg)]
    save = [
        best(lambda a=a: msgspec.msgpack.encode(saved_aggregate(a)), rounds)[0] for a in (agg0, agg)
    ]
    print(
        f"held, the window's aggregate: {mem0:.1f} -> {mem1:.1f} MB "
        f"(+{(mem1 - mem0) * 2**20 / n:.0f} B a collective); its file in the store "
        f"{len(files[0]) / 2**20:.1f} -> "
        f"{len(files[1]) / 2**20:.1f} MB, encoded in {save[0]:.2f} -> {save[1]:.2f} s of CPU"
    )
    return agg


def matching(agg: WindowAggregate, ranks: int, per_rank: int, rounds: int) -> None:
    """Part 2b: one ``collectives()`` read's matching, keyed by Seq and by step and order."""
    nodes = {r: f"node-{r // PER_NODE}" for r in range(ranks)}
    for seq in (True, False):
        bl = agg.collectives if seq else collective_blocks(ranks, per_rank, seq=False)
        cpu, reply = best(lambda b=bl: window_collectives(b, nodes, 500), rounds)
        size = len(json.dumps(reply)) / 2**20
        key = "Seq" if seq else "step and order (no Seq: gloo)"
        print(
            f"collectives() matching, {ranks} ranks x {per_rank}, keyed by {key}: {cpu:.2f} s of "
            f"CPU ({cpu / 1.5:.2f}x the 1.5 s budget), {reply['matched']:,} matched, "
            f"{reply['shown']} shown, {len(reply['problems'])} problem lines, reply {size:.1f} MB "
            "of JSON"
        )
    cpu, found = best(lambda: find_arriver(agg), rounds)
    print(
        f"last arriver (find_arriver: the window's stragglers' last_arriver, matched once off the "
        f"loop for a large window), keyed by Seq: {cpu:.2f} s of CPU, rank "
        f"{found['rank'] if found else None}"
    )


def _gloo_rank(rank: int, world: int, out: str, steps: int, port: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    g = dist.new_group(list(range(world)))
    x, t = torch.randn(64, 64), torch.ones(1000)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        for _ in range(steps):
            for i in range(20):
                for _ in range(10):
                    x = torch.tanh(x @ x)
                if i % 2 == 0:
                    dist.all_reduce(t)
                elif i % 4 == 1:
                    dist.all_gather([torch.zeros(1000) for _ in range(world)], t, group=g)
                else:
                    dist.broadcast(t, 0, group=g)
            p.step()
    p.export_chrome_trace(f"{out}/rank{rank}.json")
    dist.destroy_process_group()


def reader(steps: int, rounds: int) -> None:
    """Part 3: the collectives pass's share of a rank's summary."""
    import torch.multiprocessing as mp

    from worker_ext.agent.collective_reader import collectives_of
    from worker_ext.agent.trace_reader import read_trace
    from worker_ext.agent.trace_summary import summarise_trace

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_gloo_rank, args=(2, tmp, steps, random.randint(20000, 40000)), nprocs=2)
        path = f"{tmp}/rank0.json"
        mb = os.path.getsize(path) / 2**20
        whole, (s, _) = best(
            lambda: summarise_trace(path, rank=0, window=0, steps=(1, steps), partial=False,
                                    device="cpu", top_k=50), rounds,
        )  # fmt: skip
        digest = read_trace(path)
        alone, block = best(lambda: collectives_of(digest), rounds)
    n = len(block.calls) + block.cut if block is not None else 0
    print(
        f"reader, a real 2-rank gloo trace ({mb:.1f} MB, {steps} steps, {n} collectives, "
        f"{len(s.collectives.calls) if s.collectives else 0} kept): summarise_trace "
        f"{whole * 1e3:.0f} ms "
        f"of CPU, of which the collectives pass {alone * 1e3:.1f} ms ({alone / whole:.1%}; "
        f"without it {whole / (whole - alone):.3f}x faster)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--per-rank", type=int, default=200)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip", nargs="*", default=[], choices=["size", "coordinator", "reader"])
    args = ap.parse_args()
    if "size" not in args.skip:
        sizes(args.calls)
    if "coordinator" not in args.skip:
        agg = coordinator(args.ranks, args.per_rank, args.rounds)
        matching(agg, args.ranks, args.per_rank, args.rounds)
    if "reader" not in args.skip:
        reader(args.steps, args.rounds)


if __name__ == "__main__":
    main()
