"""What an attached rank 0's step file costs its training thread (issue 54 item 5).

Rank 0's step reports (``StepReports.step``) with and without its step file
(``coordinator.protocol.step_tail``: two stores into a mapped page a step), on a clock that
never makes a report due (no Ray, no coordinator: the hot path alone). 15 rounds, each a run of
100,000 steps without the file and one with it (so a shared machine's drift hits both alike);
the medians, in nanoseconds a step, and the median of each round's difference: the file's cost.

Run: .venv/bin/python bench/step_file_cost.py [--steps 100000] [--rounds 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import timeit

from coordinator.client.rank_reports import StepReports
from coordinator.protocol.step_tail import StepTail


def per_step_ns(with_file: bool, steps: int) -> float:
    """One run of ``steps`` steps, in ns a step."""
    tick = [0.0]

    def clock() -> float:
        tick[0] += 1e-7  # (0.1 us a step: no report is due within a run)
        return tick[0]

    reports = StepReports(None, "bench", now=clock)  # (no report is sent: no coordinator)
    if with_file:
        path = os.path.join(tempfile.mkdtemp(prefix="step-file-bench-"), "1.step")
        reports.tail = StepTail.create(path, {"pid": os.getpid()})
    k = [0]

    def one() -> None:
        k[0] += 1
        reports.step(k[0], False)

    took = timeit.timeit(one, number=steps) / steps * 1e9
    if reports.tail is not None:
        reports.tail.close()
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    rounds = [(per_step_ns(False, args.steps), per_step_ns(True, args.steps))
              for _ in range(args.rounds)]  # fmt: skip
    without = statistics.median(a for a, _ in rounds)
    with_file = statistics.median(b for _, b in rounds)
    cost = statistics.median(b - a for a, b in rounds)
    print(f"rank 0's step report: {without:.0f} ns a step without the step file, "
          f"{with_file:.0f} ns with it; the file's cost {cost:+.0f} ns a step")  # fmt: skip


if __name__ == "__main__":
    main()
