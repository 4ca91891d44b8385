"""What the windows of one ``status()`` cost the coordinator's event loop, as the history grows.

A run of N ranks (10,000 by default) keeps W closed windows (8 and 64: the config's default
``max_windows``), each with every rank's closing reply, summary and trace. ``status()`` lists
every window kept; this times building those entries (``WindowRecord.to_dict(False)``, what a
large run's default ``status()`` does), with each window's role parts rebuilt on every call
(as before they were kept) and kept while nothing in them changes (now), in the same process.

Run: .venv/bin/python bench/status_cost.py [--ranks 10000] [--windows 8 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

from coordinator.core.records import TrainerRecord
from coordinator.core.schedule import Window
from coordinator.core.state import CoordinatorState
from coordinator.protocol.replies import rank_reply
from coordinator.protocol.summary_codec import Breakdown, KernelRow, RankSummary, encode_summary


def run_with_windows(n: int, windows: int) -> CoordinatorState:
    st = CoordinatorState(max_windows=windows)
    keys = [("t", r) for r in range(n)]
    trainer = TrainerRecord("t", "policy", list(range(n)), {}, "/run")
    st.register(trainer, True, lambda r: True)
    for w in range(windows):
        first, last = 10 * w + 1, 10 * w + 2
        rec = st.open_window(Window(w, first - 1, first, last), keys)
        closed = {"window": w, "steps": [first, last], "partial": False, "trace_path": "/run/x"}
        for key in keys:
            st.apply_reply(key, dict(rank_reply(rank=key[1], closed=closed)))
            rows = [KernelRow("gemm", 5.0 + key[1] % 7, 1, 0)]
            s = RankSummary(key[1], w, (first, last), False, "cuda", rows)
            s.step_us, s.breakdown = [(first, 1e5), (last, 1e5)], Breakdown(1, 1, 1, 1, 10)
            st.ingest_summary(key, encode_summary(s))
            st.trace_stored(key, w, f"/run/rank{key[1]}.pt.trace.json.gz", None)
        st.close_window(rec)
    return st


def entries_ms(st: CoordinatorState, rebuild: bool) -> float:
    t0 = time.perf_counter()
    for rec in st.closed_windows():
        if rebuild:
            rec.__dict__.pop("_parts_cache", None)
        rec.to_dict(False)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=10_000)
    ap.add_argument("--windows", type=int, nargs="+", default=[8, 64])
    args = ap.parse_args()
    for windows in args.windows:
        st = run_with_windows(args.ranks, windows)
        entries_ms(st, False)
        before = statistics.median(entries_ms(st, True) for _ in range(5))
        now = statistics.median(entries_ms(st, False) for _ in range(5))
        print(
            f"{args.ranks} ranks, {windows} windows kept: the windows of one status() "
            f"{before:.1f} ms rebuilt each call (before), {now:.2f} ms kept (now)",
            flush=True,
        )


if __name__ == "__main__":
    main()
