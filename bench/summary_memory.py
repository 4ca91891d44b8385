"""Peak memory of summarising a large trace, against the trace's size.

Builds a trace of about ``--mb`` MB in Kineto's layout by repeating the events of a real
40-step window (12 ``Linear(64, 64)``, ``record_shapes``), then summarises it in a fresh
process and reports that process's peak resident memory (its interpreter and imports included).
Target: at most 3x the trace's size for a 500 MB trace.

Run: .venv/bin/python bench/summary_memory.py --mb 500  (or `make bench`)
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = """
import sys, time
sys.path.insert(0, {root!r})
from worker_ext.agent.trace_summary import summarise_trace
t0 = time.perf_counter()
s, _ = summarise_trace({path!r}, rank=0, window=0, steps=(0, 10**9), partial=False,
                       device="cpu", top_k=50)
print(f"{{time.perf_counter() - t0:.1f}} s, {{len(s.kernels)}} rows")
"""


def real_window(path: str) -> None:
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(12)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 64)
    with torch.profiler.profile(record_shapes=True) as prof:
        for _ in range(40):
            for _ in range(4):
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            prof.step()
    prof.export_chrome_trace(path)


def enlarge(src: str, dst: str, mb: int) -> int:
    """Repeat the events of ``src`` until ``dst`` is about ``mb`` MB; returns its size."""
    with open(src, "rb") as f:
        data = f.read()
    first = data.index(b"\n  {\n")
    last = data.rindex(b"\n  {\n")
    head, body, tail = data[:first], data[first:last], data[last:]
    copies = max(1, (mb << 20) // len(body))
    with open(dst, "wb") as f:
        f.write(head)
        for _ in range(copies):
            f.write(body)  # each copy ends with "},", so the next one follows as JSON
        f.write(tail)
    return os.path.getsize(dst)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=500)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-summary-memory-")
    src, big = os.path.join(tmp, "window.json"), os.path.join(tmp, "big.json")
    try:
        real_window(src)
        size = enlarge(src, big, args.mb)
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", CHILD.format(root=ROOT, path=big)],
            capture_output=True,
            text=True,
            check=True,
        )
        wall = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
        print(f"trace {size / 2**20:.0f} MB; summarised in {out.stdout.strip()} ({wall:.1f} s)")
        print(f"peak resident memory {peak / 2**20:.0f} MB = {peak / size:.2f}x the trace (<= 3x)")
    finally:
        for p in (src, big):
            if os.path.exists(p):
                os.unlink(p)
        os.rmdir(tmp)


if __name__ == "__main__":
    main()
