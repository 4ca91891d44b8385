"""What a run's record in save_path costs: bytes and time per window at 1,024 ranks.

A window of N ranks (1,024 by default) whose summaries are the two real GPU ranks' of
``../shared/data/gpu-traces/two-ranks`` (rank r: rank r % 2's, its times scaled by a few
percent so that the ranks differ), folded as the coordinator folds them (node partials of 8
ranks), with each rank's trace recorded. Reported, against baselines measured in the same run:

- the window's record file: bytes, and bytes per rank, against the bytes of the node partials
  the coordinator received for it (what the window cost the network already);
- encoding it (the record writer's thread) and reading it back into the window (``--from``),
  against pickling the same window (what the coordinator's checkpoint did before the one
  store; ``bench/state_store_cost.py`` measures the store's own files);
- a phase chunk of 1,000 steps with 4 regions.

Run: .venv/bin/python bench/record_cost.py [--ranks 1024]
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from coordinator.core import record_codec as codec  # noqa: E402
from coordinator.core.aggregate import WindowAggregate  # noqa: E402
from coordinator.core.partial import fold_summaries  # noqa: E402
from coordinator.core.records import WindowRecord  # noqa: E402
from coordinator.core.schedule import Window  # noqa: E402
from coordinator.ops import offline  # noqa: E402
from coordinator.protocol.partial_codec import decode_partial, encode_partial  # noqa: E402
from coordinator.protocol.summary_codec import (  # noqa: E402
    KernelRow,
    RankSummary,
    decode_summary,
    encode_summary,
)
from worker_ext.agent.trace_reader import read_trace  # noqa: E402
from worker_ext.agent.trace_summary import summarise  # noqa: E402

TRACES = os.path.join(ROOT, "..", "shared", "data", "gpu-traces", "two-ranks")
NODE = 8  # ranks per node partial


def real_summaries() -> list[RankSummary]:
    out = []
    for r in (0, 1):
        d = read_trace(os.path.join(TRACES, f"sampled_rank-{r}.json.gz"))
        steps = offline._steps(d, None, "trace", [])
        s, _ = summarise(d, rank=r, window=3, steps=steps, partial=False, device="cuda", top_k=50)
        out.append(s)
    return out


def rank_summary(base: RankSummary, rank: int) -> RankSummary:
    """``base`` as rank ``rank``: each kernel's time scaled by 1 + (rank % 17) / 100."""
    f = 1 + (rank % 17) / 100
    s = decode_summary(encode_summary(base))
    s.rank = rank
    s.kernels = [KernelRow(k.name, k.self_us * f, k.count, k.flops) for k in s.kernels]
    return s


def window(n: int) -> tuple[WindowRecord, int]:
    """The window of ``n`` ranks, and the bytes of the node partials that made it."""
    base = real_summaries()
    agg, received = WindowAggregate(3), 0
    for first in range(0, n, NODE):
        sums = [rank_summary(base[r % 2], r) for r in range(first, min(n, first + NODE))]
        blob = encode_partial(fold_summaries(f"node{first // NODE}", sums))
        received += len(blob)
        agg.add_partial(decode_partial(blob))
    keys = {("policy", r) for r in range(n)}
    rec = WindowRecord(window=Window(3, 10, 11, 12), participants=keys, acked=set(keys))
    rec.steps, rec.closed, rec.primary = agg.steps, True, "policy"
    rec.roles = {"policy": "policy"}
    rec.aggregates["policy"] = agg
    rec.trace_dirs = {"policy": "s3://bucket/profiles/job/window_0003_steps_11-12/policy"}
    rec.traces = {
        k: {"path": f"{rec.trace_dirs['policy']}/rank{k[1]}.pt.trace.json.gz",
            "local_path": None, "node": f"node{k[1] // NODE:04d}", "error": None}
        for k in keys
    }  # fmt: skip
    return rec, received


def timed(fn, repeat: int = 5) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=1024)
    args = ap.parse_args()
    rec, received = window(args.ranks)
    snap = rec.snapshot()
    enc_ms, blob = timed(lambda: codec.encode(codec.window_file("job", snap)))
    assert isinstance(blob, bytes)
    dec_ms, _ = timed(lambda: codec.window_record(codec.decode(blob)))  # type: ignore[arg-type]
    pk_ms, pickled = timed(lambda: pickle.dumps(snap, protocol=pickle.HIGHEST_PROTOCOL))
    assert isinstance(pickled, bytes)
    chunk = codec.PhaseChunk(
        codec.VERSION, "job", 0,
        [(k, 0.1 + k % 7 / 100, {"generate": 0.05, "train": 0.03, "ref": 0.01, "log": 0.001})
         for k in range(1000)],
    )  # fmt: skip
    chunk_bytes = len(codec.encode(chunk))
    kernels = len(rec.aggregates["policy"].top(100_000))
    print(f"window of {args.ranks} ranks, {kernels} kernels (two real GPU ranks' summaries):")
    print(f"  record file        {len(blob) / 1e6:8.2f} MB  ({len(blob) / args.ranks:,.0f} B/rank)")
    print(f"  received partials  {received / 1e6:8.2f} MB  -> record/received = "
          f"{len(blob) / received:.2f}x")  # fmt: skip
    print(f"  pickled            {len(pickled) / 1e6:8.2f} MB  -> record/pickle = "
          f"{len(blob) / len(pickled):.2f}x")  # fmt: skip
    print(f"  encode {enc_ms:.1f} ms, read back {dec_ms:.1f} ms; pickle {pk_ms:.1f} ms -> "
          f"encode/pickle = {enc_ms / pk_ms:.2f}x")  # fmt: skip
    print(f"phase chunk of 1,000 steps, 4 regions: {chunk_bytes / 1e3:.1f} KB")


if __name__ == "__main__":
    main()
