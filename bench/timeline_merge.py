"""What merging a window's ranks into one Chrome trace costs (``collect --merge``): time, size
and memory at 8, 64 and 1,024 ranks.

Each rank is HTA's real NCCL rank trace (tests/data/gpu-traces: 40,553 events, 3,774 on the
GPU, 0.75 MB gzipped), its clock moved by up to 5 ms, written N times: a simulated window of N
ranks. Each size runs in a fresh process, twice: **read** (decompress and decode every rank's
trace, the least any merge must do: the baseline) and **merge** (``write_timeline`` into a
gzipped file, the default limits). Reported: seconds and their ratio, the merged file's size,
events kept per rank, and the process's peak memory (max RSS) for each.

    .venv/bin/python bench/timeline_merge.py [--ranks 8 64 1024]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SOURCE = os.path.join(
    ROOT, "tests", "data", "gpu-traces", "one-rank-nccl", "nccl_rank0_of_2.json.gz"
)


VARIANTS = 8


def make_window(n: int, where: str) -> list[str]:
    """N ranks of the real rank trace: 8 copies, each its clock a little off (up to 5 ms),
    linked round-robin (writing 1,024 copies would take longer than merging them)."""
    with gzip.open(SOURCE) as f:
        trace = json.load(f)
    rng, copies = random.Random(n), []
    base = trace["baseTimeNanoseconds"]
    for v in range(min(n, VARIANTS)):
        trace.update(rank=v, baseTimeNanoseconds=base + rng.randrange(5_000_000))
        path = os.path.join(where, f"copy{v}.json.gz")
        with gzip.open(path, "wt", compresslevel=1) as f:
            json.dump(trace, f)
        copies.append(path)
    paths = [os.path.join(where, f"rank{r}.pt.trace.json.gz") for r in range(n)]
    for r, path in enumerate(paths):
        os.link(copies[r % len(copies)], path)
    return paths


def inner(mode: str, where: str) -> None:
    """One measurement in this (fresh) process; prints JSON."""
    import msgspec

    from coordinator.core.timeline import RankLabel
    from coordinator.ops.timeline import write_timeline

    paths = sorted(
        (os.path.join(where, p) for p in os.listdir(where) if p.startswith("rank")),
        key=lambda p: int(os.path.basename(p)[4:].split(".")[0]),
    )
    t0 = time.perf_counter()
    out: dict = {"mode": mode, "ranks": len(paths)}
    if mode == "read":
        for p in paths:
            with open(p, "rb") as f:
                msgspec.json.decode(gzip.decompress(f.read()))
    else:
        target = os.path.join(where, "merged.json.gz")
        labels = [
            RankLabel(rank=r, role="policy", node=f"10.0.{r // 8}.1") for r in range(len(paths))
        ]
        res = write_timeline(zip(labels, paths, strict=True), target)
        first = res["ranks"][0]
        out |= {"bytes": res["bytes"], "kept": first["kept"], "of": first["events"]}
        os.unlink(target)
    out["s"] = time.perf_counter() - t0
    out["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))


def measure(n: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="timeline-bench-") as where:
        make_window(n, where)
        got = {}
        for mode in ("read", "merge"):
            proc = subprocess.run(
                [sys.executable, __file__, "--inner", mode, where],
                capture_output=True, text=True, check=True, cwd=ROOT,
            )  # fmt: skip
            got[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 1024])
    ap.add_argument("--inner", nargs=2, metavar=("MODE", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:
        inner(*args.inner)
        return
    print("| ranks | read (baseline) | merge | merge / read | merged file | events kept per rank "
          "| peak memory read / merge |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for n in args.ranks:
        m = measure(n)
        r, g = m["read"], m["merge"]
        print(
            f"| {n} | {r['s']:.1f} s | {g['s']:.1f} s | {g['s'] / r['s']:.2f}x | "
            f"{g['bytes'] / 2**20:.1f} MB | {g['kept']:,} of {g['of']:,} | "
            f"{r['max_rss_mb']:.0f} / {g['max_rss_mb']:.0f} MB |",
            flush=True,
        )


if __name__ == "__main__":
    main()
