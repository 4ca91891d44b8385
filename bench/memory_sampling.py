"""What sampling every rank's memory costs: the node agent's CPU, and the training step.

1. The agent's CPU per sampled rank per second: 8 real rank-like processes (torch imported, a
   model of about 200 MB resident), sampled by the agent's own ``MemorySampler`` for
   ``--seconds`` at ``memory.sample_s`` 1.0 (the default) and at 0.2; the sampler thread's CPU
   time (``time.thread_time``) over ranks x seconds.
2. The coordinator at ``--coordinator-ranks`` (10,000): the CPU of one pull's fold (5 samples a
   rank) and of one leak evaluation (every pull by default), over 600 s of history a rank, one
   rank in 100 leaking; and the memory the series take (``tracemalloc``).
3. The training step with sampling on and off: one rank-like process trains (one thread, the
   step of ``rank_profiler_overhead.py``) in blocks of steps while this process plays the agent,
   sampling it (at 0.2 s, five times the default rate) in every other block. Off and on blocks
   alternate, so the machine's drift falls on both; the noise is the spread between the off
   blocks themselves.

Run: .venv/bin/python bench/memory_sampling.py
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import textwrap
import time

from coordinator.core.memory import MemoryBook
from coordinator.core.memory_config import Memory
from worker_ext.agent.memory_sampler import MemorySampler

RANK = textwrap.dedent(
    """
    import sys, time, torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 512)
    ballast = torch.ones(50_000_000)  # ~200 MB resident, like a rank's weights
    def step():
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    for _ in range(20):
        step()
    print("ready", flush=True)
    for line in sys.stdin:  # each line: train that many steps, print their median in ms
        n = int(line)
        if n == 0:
            time.sleep(3600)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        print(statistics.median(times) * 1e3, flush=True)
    """
).replace("import sys, time, torch", "import statistics, sys, time, torch")


def start_rank() -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", RANK], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def agent_cpu(ranks: int, sample_s: float, seconds: float) -> tuple[float, int]:
    """The sampler's CPU ms per sampled rank per second, and the samples taken."""
    procs = [start_rank() for _ in range(ranks)]
    try:
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("0\n")  # idle: the machine's two cores stay with the sampler
            p.stdin.flush()
        sampler = MemorySampler("bench")
        watch = {"targets": [{"pid": p.pid} for p in procs], "sample_s": sample_s}
        first = sampler.watch(watch)  # type: ignore[arg-type]
        time.sleep(seconds)
        last = sampler.watch(watch)  # type: ignore[arg-type]
        sampler.close()
        cpu_s = last["cpu_s"] - first["cpu_s"]
        return cpu_s * 1e3 / (ranks * seconds), last["sampled"]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def coordinator_cost(ranks: int) -> tuple[float, float, float, float]:
    """ms of CPU to fold one pull (median and most of 12), to evaluate the marks, and the MB
    the series hold."""
    import tracemalloc

    book, t0 = MemoryBook(), 1.7e9
    tracemalloc.start()
    for r in range(ranks):
        rate = 2**20 if r % 100 == 0 else 0
        samples = [(t0 + s, 10**9 + rate * s, 9 * 10**8, None) for s in range(600)]
        book.add(("t", r), r + 1, samples, None)  # type: ignore[arg-type]
    held = tracemalloc.get_traced_memory()[0] / 1e6
    tracemalloc.stop()
    folds = []
    for p in range(12):  # a minute of pulls: the spills into buckets fall in some of them
        at = t0 + 600 + 5 * p
        pull = {
            r: [(at + s, 10**9 + (2**20 if r % 100 == 0 else 0) * (at + s - t0), 9 * 10**8, None)
                for s in range(5)]
            for r in range(ranks)
        }  # fmt: skip
        c0 = time.process_time()
        for r, samples in pull.items():
            book.add(("t", r), r + 1, samples, None)  # type: ignore[arg-type]
        folds.append((time.process_time() - c0) * 1e3)
    fold_ms, fold_max = statistics.median(folds), max(folds)
    c0 = time.process_time()
    cfg = Memory()  # the default spans: 600 s, and 90 s for a steep leak
    book.evaluate(t0 + 659, cfg.leak_span_s, cfg.leak_min_bytes_per_s, cfg.leak_fast())
    evaluate_ms = (time.process_time() - c0) * 1e3
    assert sum(1 for rm in book.ranks.values() if rm.growth) == ranks // 100  # the leakers
    return fold_ms, fold_max, evaluate_ms, held


def step_on_off(blocks: int, steps: int, sample_s: float) -> tuple[list[float], list[float]]:
    """Median step ms of each off block and each on block, alternating."""
    rank = start_rank()
    assert rank.stdin is not None and rank.stdout is not None
    off: list[float] = []
    on: list[float] = []
    try:
        for b in range(2 * blocks):
            sampling = b % 2 == 1
            sampler = MemorySampler("bench")
            if sampling:
                sampler.watch({"targets": [{"pid": rank.pid}], "sample_s": sample_s})
            rank.stdin.write(f"{steps}\n")
            rank.stdin.flush()
            ms = float(rank.stdout.readline())
            (on if sampling else off).append(ms)
            if sampling:
                got = sampler.watch({"targets": [{"pid": rank.pid}], "sample_s": sample_s})
                assert got["processes"][0]["samples"], "no sample taken while training"
                sampler.close()
        return off, on
    finally:
        rank.kill()
        rank.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--coordinator-ranks", type=int, default=10_000)
    args = ap.parse_args()
    fold_ms, fold_max, evaluate_ms, held = coordinator_cost(args.coordinator_ranks)
    print(
        f"coordinator, {args.coordinator_ranks} ranks with 600 s of samples each: a pull's fold "
        f"{fold_ms:.0f} ms (median of 12 pulls, most {fold_max:.0f}), a leak evaluation "
        f"{evaluate_ms:.0f} ms of CPU (on its reads "
        f"thread); the series hold {held:.0f} MB"
    )
    for sample_s in (1.0, 0.2):
        ms, n = agent_cpu(args.ranks, sample_s, args.seconds)
        print(
            f"agent CPU, {args.ranks} ranks sampled every {sample_s:g} s for {args.seconds:g} s: "
            f"{ms:.3f} ms per rank per second ({ms / 10:.4f}% of a core per rank), "
            f"{n} samples"
        )
    off, on = step_on_off(args.blocks, args.steps, 0.2)
    m_off, m_on = statistics.median(off), statistics.median(on)
    noise = (max(off) - min(off)) / m_off
    print(f"step ms, sampling off, per block: {', '.join(f'{x:.2f}' for x in off)}")
    print(f"step ms, sampling on (0.2 s), per block: {', '.join(f'{x:.2f}' for x in on)}")
    print(
        f"on / off: {m_on / m_off:.3f} (medians {m_on:.2f} / {m_off:.2f} ms); "
        f"spread of the off blocks themselves: {noise:.1%}"
    )


if __name__ == "__main__":
    main()
