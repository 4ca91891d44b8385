"""Compare a trace's summary with ``key_averages()`` of the same profiler (tests only)."""

from __future__ import annotations

from typing import Any

from worker_ext.agent.trace_reader import read_trace
from worker_ext.agent.trace_summary import normalise_name, summarise


def key_averages_table(prof: Any) -> dict[str, tuple[float, int, int]]:
    """name -> (self CPU us, count, flops) from ``key_averages()``, ProfilerStep rows dropped."""
    out: dict[str, list[float]] = {}
    for row in prof.key_averages():
        if row.key.startswith("ProfilerStep"):
            continue
        acc = out.setdefault(normalise_name(row.key), [0.0, 0, 0])
        acc[0] += row.self_cpu_time_total
        acc[1] += row.count
        acc[2] += int(row.flops or 0)
    return {k: (v[0], int(v[1]), int(v[2])) for k, v in out.items()}


def trace_table(path: str, flops: bool = False) -> dict[str, tuple[float, int, int]]:
    """The same table from the trace file, every row kept."""
    summary, _ = summarise(
        read_trace(path, flops=flops),
        rank=0,
        window=0,
        steps=(0, 2**62),
        partial=False,
        device="cpu",
        top_k=1_000_000,
    )
    return {k.name: (k.self_us, k.count, k.flops) for k in summary.kernels}


def differences(
    expected: dict[str, tuple[float, int, int]],
    got: dict[str, tuple[float, int, int]],
    rel: float = 1e-3,
    flops: bool = False,
) -> list[str]:
    """Rows whose self time differs by more than ``rel`` or whose count differs.

    torch 2.13 sometimes corrupts the names of Python frames in ``key_averages()`` with
    ``with_stack`` (it reads freed memory: at other times the same bug raises
    ``UnicodeDecodeError``), while the trace file holds the frame's real name. A key_averages
    row whose name is not printable is matched to an unmatched trace row by its numbers alone.
    """
    bad = []
    unmatched = {name: v for name, v in got.items() if name not in expected}
    for name, (us, count, fl) in expected.items():
        mine = got.get(name)
        if mine is None and not name.isprintable():
            twin = next(
                (
                    n
                    for n, (u, c, _) in unmatched.items()
                    if c == count and abs(u - us) <= rel * max(us, 1.0)
                ),
                None,
            )
            if twin is not None:
                del unmatched[twin]
                continue
        if mine is None:
            if us > 0:  # rows with no self time are not in a summary
                bad.append(f"{name}: missing (key_averages {us:.3f} us x {count})")
            continue
        if abs(mine[0] - us) > rel * max(us, 1.0) or mine[1] != count:
            bad.append(
                f"{name}: trace {mine[0]:.3f} us x {mine[1]}, key_averages {us:.3f} x {count}"
            )
        if flops and mine[2] != fl:
            bad.append(f"{name}: trace {mine[2]} flops, key_averages {fl}")
    bad += [f"{name}: not in key_averages" for name in unmatched]
    return bad
