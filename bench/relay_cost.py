"""What a relay spends per node partial it takes: the decode, and the merge of its group's.

A relay decodes each node partial of its group (8 ranks x 2,000 kernels, about 220 KB) as it
arrives and keeps it until the group is in, then merges them; at 10,000 ranks that is 36 per
relay and 1,250 over the cluster per window. This times, in one process, on the same blobs:

- the decode of distinct blobs kept alive (as a relay keeps its group's), with the rows as
  garbage-collector-tracked structs (as before) and untracked (``gc=False``, now): every
  collection the decodes trigger walks the tracked rows of every partial held so far;
- the merge of a group's kernel rows, row by row (before) and inlined (now).

Run: .venv/bin/python bench/relay_cost.py [--nodes 36] [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from typing import Any

import msgspec

from coordinator.core.partial import RowFold, fold_summaries
from coordinator.protocol.partial_codec import (
    NS,
    DetailBlock,
    NodePartial,
    RankPart,
    TableRow,
    decode_partial,
    encode_partial,
)
from coordinator.protocol.summary_codec import Breakdown, KernelRow, RankSummary

KERNELS, PER_NODE = 2000, 8
NAMES = [
    f"void at::native::elementwise_kernel<{i}, 4, gemm_{i % 97}>(int, float*)"
    for i in range(KERNELS)
]


def node_blob(node: int) -> bytes:
    rnd = random.Random(node)
    summaries = [
        RankSummary(
            rank=r,
            window=0,
            steps=(0, 2),
            partial=False,
            device="cuda",
            kernels=[KernelRow(n, rnd.uniform(1, 5000), rnd.randint(1, 400), 0) for n in NAMES],
            step_us=[(s, rnd.uniform(9e5, 1.1e6)) for s in range(3)],
            breakdown=Breakdown(6e5, 3e5, 5e4, 5e4, 3e6),
        )
        for r in range(node * PER_NODE, (node + 1) * PER_NODE)
    ]
    return encode_partial(fold_summaries(f"node-{node}", summaries))


def tracked_decoder() -> msgspec.msgpack.Decoder[Any]:
    """A decoder of the same wire whose rows are tracked by the garbage collector (before)."""

    def like(cls: Any, **types: Any) -> Any:
        fields = [(f.name, types.get(f.name, f.type)) for f in msgspec.structs.fields(cls)]
        return msgspec.defstruct(f"Tracked{cls.__name__}", fields, array_like=True, gc=True)

    row, part = like(TableRow), like(RankPart)
    fields = [("v", int), ("source", str), ("window", int), ("ranks", list[part])]
    fields += [("kernels", list[row]), ("memory", list[row]), ("detail", list[DetailBlock])]
    return msgspec.msgpack.Decoder(msgspec.defstruct("TrackedNodePartial", fields))


def merge_rows(partials: list[NodePartial], inlined: bool) -> float:
    """ms to merge the kernel rows of ``partials``: row by row through ``RowFold._merge``
    (before), or ``RowFold.merge`` (now, inlined)."""
    fold, t0 = RowFold(NS), time.perf_counter()
    for p in partials:
        if inlined:
            fold.merge(p.kernels)
            continue
        for r in p.kernels:
            fold._merge(r.name, r.total, r.square_sum, r.count, r.present, r.min, r.max, r.max_rank)
    return (time.perf_counter() - t0) * 1e3


def decode_ms(blobs: list[bytes], decode: Any) -> float:
    """Per blob, decoding them all and keeping them (as a relay keeps its group's)."""
    gc.collect()
    held, t0 = [], time.perf_counter()
    for b in blobs:
        held.append(decode(b))
    ms = (time.perf_counter() - t0) * 1e3 / len(blobs)
    del held
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=36, help="node partials of one relay group")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    blobs = [node_blob(n) for n in range(args.nodes)]
    tracked = tracked_decoder()
    before, now, merge_before, merge_now = [], [], [], []
    for _ in range(args.rounds):
        before.append(decode_ms(blobs, tracked.decode))
        now.append(decode_ms(blobs, decode_partial))
        partials = [decode_partial(b) for b in blobs]
        merge_before.append(merge_rows(partials, inlined=False))
        merge_now.append(merge_rows(partials, inlined=True))
    med = statistics.median
    print(
        f"{args.nodes} node partials of {PER_NODE} ranks x {KERNELS} kernels "
        f"({len(blobs[0]) // 1024} KB each), medians of {args.rounds} rounds:\n"
        f"  decode per partial, rows tracked by the GC, no checks (before): {med(before):.2f} ms\n"
        f"  decode per partial, rows untracked, strict checks (now): {med(now):.2f} ms\n"
        f"  merge of the group's kernel rows: {med(merge_before):.1f} ms row by row (before), "
        f"{med(merge_now):.1f} ms inlined (now)",
        flush=True,
    )


if __name__ == "__main__":
    main()
