"""Regression marks a user can trust: a window's kernel, or its step time, is marked only when it
rose beyond the spread the run's own earlier windows showed for it, by at least
``regression_threshold``, by a share of the step a user would act on, and in two windows in a
row. Pure.

What is compared, per trainer (role):

- A kernel's time is its per-step self time on the window's rank where it took least: a
  preemption of one rank (a busy host) does not mark a kernel, a regression on every rank does,
  and one rank slower than the others is a straggler (the straggler table names it).
- A kernel's **odds**: its per-step self time over the rest of the window's per-step self time
  (every other kernel summed). A window whose every op ran 20% longer (a longer batch, a busy
  host) keeps every kernel's odds; one op made 1.5x slower multiplies its odds by 1.5 exactly.
- The window's **step time** (the median rank's ``ProfilerStep`` time), as it is.

The reference: up to ``REFERENCE_WINDOWS`` of the run's earlier settled windows of that trainer,
from the baseline on (the pinned window, else the run's first complete scheduled window), not
partial, not ``auto`` (an auto capture is taken because the run was slow), and with nothing
beyond its bar (so a lasting regression stays marked instead of becoming the norm, and a
one-off spike does not widen the spread; pin a later window to accept a change). With fewer
than ``MIN_REFERENCE`` such windows the spread is not known yet, and nothing is judged
(``judged`` is False).

The bar: the reference's median ``m`` plus ``SPREAD_K`` spreads ``s``; ``s`` is the largest of
``1.4826 * MAD`` (the median absolute deviation, scaled to a standard deviation for normal
noise), a quarter of the reference's range (a few windows can show a MAD near 0 by chance: with
this term a value must pass the median by the whole range at least; for a kernel, the range
without its lowest and highest window) and ``NOISE_FLOOR * m``.

A kernel is **beyond its bar** (a suspect) when its odds pass their bar, are at least
``threshold`` times their median, and its time is above what those median odds predict by at
least ``MIN_STEP_SHARE`` of the step and above its median time by ``MIN_TIME_RISE`` of the step
(an op whose time stayed put while the rest of the window shrank is not slower). The step time
is beyond its bar when it passes it and is at least ``threshold`` times its median. What is
beyond its bar in two whole windows in a row is **marked** in both (``confirm``): a busy
neighbour, a preempted window or a page-cache flush lasts one window, a regression does not.
A mark therefore shows once the window after the first slow one has settled. What a window
marked stays marked in the next while it is at least ``threshold`` times its median and matters,
bar or not (``judge(previous=...)``). Kernels beyond their bar leave their excess out of the
rest of the window for the others (two passes).

Simulated (tests/test_marks.py: 200 runs of 40 windows, the batch +-20% from window to window,
each op +-5% of its own), a steady run gets no mark, and one op made 1.5x slower is marked in
every window from then on. On the real reference trainer (tests/test_marks_real_run.py: 2
ranks sharing 2 cores), a steady run with the batch +-20% got no mark in 22 windows, 5 runs in a
row; an op made 1.5x slower (45% of the busy time) was marked in every window from then on, 6
runs in a row. The limit: with the batch jitter in the slowed run too, that op's share of the
window grows with the batch (it scales with it, the rest less), its odds spread +-20% across the
reference, and 1.5x is within its bar in 2 of 3 runs (the third marked 11 of its 12 slowed
windows). The odds take out what scales with the whole window, not what scales differently.

>>> ref = [_profile(w, {"mm": 300.0, "add": 700.0}, step_ms=1.0) for w in range(8)]
>>> slow = judge(_profile(8, {"mm": 450.0, "add": 700.0}, step_ms=1.15), ref, threshold=1.25,
...              baseline=0, run="r", trainer_id="t")
>>> [(k["name"], k["ratio"]) for k in slow["suspects"]], slow["kernels"], slow["step_suspect"]
([('mm', 1.5)], [], False)
>>> again = judge(_profile(9, {"mm": 460.0, "add": 700.0}, step_ms=1.16), ref, threshold=1.25,
...               baseline=0, run="r", trainer_id="t")
>>> confirm(slow, again), [k["name"] for k in slow["kernels"] + again["kernels"]]
(True, ['mm', 'mm'])
>>> busy = _profile(10, {"mm": 360.0, "add": 840.0}, step_ms=1.2)  # everything 20% longer
>>> judge(busy, ref, threshold=1.25, baseline=0, run="r", trainer_id="t")["suspects"]
[]
"""

from __future__ import annotations

from statistics import median
from typing import TypedDict

from coordinator.protocol.replies import KernelSummaryReply, RegressionEntry, RegressionKernel

MIN_REFERENCE = 8
"""Earlier windows needed before anything is marked: the spread of fewer is not known."""
REFERENCE_WINDOWS = 64
"""At most this many earlier windows (the most recent) make a window's reference: enough that a
step time with two modes (two ranks sharing cores run side by side or one after the other) shows
both in the spread, few enough to follow a slow drift."""
SPREAD_K = 4.0
"""How many spreads above the reference median a value must be."""
NOISE_FLOOR = 0.05
"""The spread is taken as at least this share of the median (a reference of identical values)."""
MIN_STEP_SHARE = 0.03
"""A kernel's rise over what its usual share predicts must be at least this share of the step."""
MIN_TIME_RISE = 0.01
"""... and its time over its usual time at least this share (it took longer, not only a larger
share of a window whose other ops shrank)."""
MARKED_KERNELS = 10
"""At most this many kernels are listed in a window's marks, the largest rise first."""
KEPT_KERNELS = 256
"""A window's profile keeps its largest kernels, at most this many ..."""
KEPT_SHARE = 0.0005
"""... and only those of at least this share of its busy time (a smaller one counts as 0)."""
MAD_SCALE = 1.4826


class WindowProfile(TypedDict):
    """What a settled window's marks need of one trainer's part, kept on its record."""

    window: int
    us: dict[str, float]  # per-step self time on its least rank, of its largest kernels
    busy_us: float  # every kernel's, summed
    step_ms: float | None  # the median rank's step time


def profile(summary: KernelSummaryReply) -> WindowProfile:
    """A window's profile from its ``kernel_summary()`` reply (every kernel listed)."""
    window, steps = summary["window"], summary["steps"]
    if window is None:
        raise ValueError("a profile is made of one window's table, not of no window")
    n = steps[1] - steps[0] + 1 if len(steps) == 2 else 0
    us = {k["name"]: k["min_us"] / n for k in summary["kernels"]} if n else {}
    busy = sum(us.values())
    kept = sorted(us.items(), key=lambda kv: (-kv[1], kv[0]))[:KEPT_KERNELS]
    med = summary["stragglers"]["median_step_ms"]
    return {
        "window": window,
        "us": {k: round(v, 3) for k, v in kept if v >= KEPT_SHARE * busy and v > 0},
        "busy_us": round(busy, 3),
        "step_ms": round(med, 3) if med else None,
    }


def slower(entry: RegressionEntry | None) -> bool:
    """Whether a window's marks say it was slower (a kernel or its step, confirmed)."""
    return entry is not None and bool(entry["kernels"] or entry["step_regressed"])


def beyond(entry: RegressionEntry | None) -> bool:
    """Whether anything of a window was beyond its bar or marked."""
    return entry is not None and bool(entry["suspects"] or entry["step_suspect"] or slower(entry))


def pick_reference(
    index: int, base: int, earlier: list[tuple[int, WindowProfile, RegressionEntry | None]]
) -> list[WindowProfile]:
    """The reference of window ``index``: of the ``earlier`` windows (index, profile, marks;
    oldest first, already whole and not ``auto``), those from the baseline on, before it,
    with nothing beyond its bar, the most recent ``REFERENCE_WINDOWS``."""
    ref = [p for i, p, m in earlier if base <= i < index and not beyond(m)]
    return ref[-REFERENCE_WINDOWS:]


def judge(
    this: WindowProfile,
    reference: list[WindowProfile],
    *,
    threshold: float,
    baseline: int | None,
    run: str,
    trainer_id: str,
    previous: RegressionEntry | None = None,
) -> RegressionEntry:
    """Window ``this`` against its ``reference`` windows (see the module docstring; the caller
    picks the reference): what is beyond its bar goes to ``suspects`` and ``step_suspect``, and
    becomes a mark once ``confirm`` finds it in the next or the previous window too. What
    ``previous`` (the window judged just before) marked stays marked here while it is at least
    ``threshold`` times its median and matters, bar or not."""
    ref = reference[-REFERENCE_WINDOWS:]
    judged = len(ref) >= MIN_REFERENCE
    before = {k["name"] for k in previous["kernels"]} if previous else set()
    rows = _kernels(this, ref, threshold) if judged else []
    steps = [p["step_ms"] for p in ref if p["step_ms"]]
    s, med, bar = this["step_ms"], None, None
    if steps:
        med = median(steps)
        bar = _bar(steps, med) / med if len(steps) >= MIN_REFERENCE else None
    ratio = round(s / med, 4) if s and med else None
    risen = bool(judged and ratio and ratio >= threshold)
    return {
        "baseline": baseline,
        "baseline_run": run,
        "trainer_id": trainer_id,
        "reference": [p["window"] for p in ref],
        "judged": judged,
        "threshold": threshold,
        "kernels": [k for k, past_bar in rows if k["name"] in before][:MARKED_KERNELS],
        "suspects": [k for k, past_bar in rows if past_bar][:MARKED_KERNELS],
        "step_ms": [round(med, 3) if med else None, s],
        "step_ratio": ratio,
        "step_bar": round(bar, 4) if bar else None,
        "step_regressed": risen and bool(previous and previous["step_regressed"]),
        "step_suspect": bool(risen and bar and ratio and ratio > bar),
    }


def confirm(previous: RegressionEntry | None, this: RegressionEntry) -> bool:
    """Marks what both windows found beyond its bar, in both (``previous``: the window of the
    same trainer judged just before ``this``). True when ``previous`` gained a mark."""
    if previous is None:
        return False
    gained = False
    names = {k["name"] for k in previous["suspects"]} & {k["name"] for k in this["suspects"]}
    for entry in (previous, this):
        have = {k["name"] for k in entry["kernels"]}
        new = [k for k in entry["suspects"] if k["name"] in names and k["name"] not in have]
        entry["kernels"] = sorted(entry["kernels"] + new, key=_largest_first)
        gained |= entry is previous and bool(new)
    if previous["step_suspect"] and this["step_suspect"]:
        gained |= not previous["step_regressed"]
        previous["step_regressed"] = this["step_regressed"] = True
    return gained


def _largest_first(k: RegressionKernel) -> tuple[float, str]:
    return -k["step_share"], k["name"]


def _kernels(
    this: WindowProfile, ref: list[WindowProfile], threshold: float
) -> list[tuple[RegressionKernel, bool]]:
    """Every kernel that rose by ``threshold`` or more and by a share of the step that matters,
    with whether it passed its bar, the largest rise first. Two passes: the second leaves the
    first's suspects' excess out of the rest of the window (one op waiting 28x longer on its
    peers must not hide another's rise)."""
    rows = _kernel_rows(this, ref, threshold, excess=0.0)
    suspects = {k["name"]: k["us"] - k["expected_us"] for k, past_bar in rows if past_bar}
    if suspects:
        total = sum(suspects.values())
        rows = [
            row
            for name in this["us"]
            for row in _kernel_rows(
                this, ref, threshold, excess=total - suspects.get(name, 0.0), only=name
            )
        ]
    return sorted(rows, key=lambda r: _largest_first(r[0]))


def _kernel_rows(
    this: WindowProfile,
    ref: list[WindowProfile],
    threshold: float,
    excess: float,
    only: str | None = None,
) -> list[tuple[RegressionKernel, bool]]:
    busy = this["busy_us"]
    step_us = this["step_ms"] * 1000.0 if this["step_ms"] else busy
    rows: list[tuple[RegressionKernel, bool]] = []
    names = [only] if only is not None else list(this["us"])
    for name in names:
        us = this["us"][name]
        rest = busy - us - excess
        history = [_odds(p["us"].get(name, 0.0), p["busy_us"]) for p in ref]
        if rest <= 0 or None in history:
            continue
        odds = [h for h in history if h is not None]
        med = median(odds)
        if med <= 0:  # absent from most of the reference: a new kernel, not a slower one
            continue
        expected = med * rest
        ratio, bar = us / expected, _bar(odds, med, trim=True) / med
        usual = median(p["us"].get(name, 0.0) for p in ref)
        rise = us - expected
        grew = us - usual >= MIN_TIME_RISE * step_us  # not only its share, as the rest shrank
        if ratio >= threshold and rise >= MIN_STEP_SHARE * step_us and grew:
            row: RegressionKernel = {
                "name": name,
                "us": round(us, 3),
                "reference_us": round(usual, 3),
                "expected_us": round(expected, 3),
                "ratio": round(ratio, 4),
                "bar": round(bar, 4),
                "step_share": round(rise / step_us, 4),
            }
            rows.append((row, ratio > bar))
    return rows


def _odds(us: float, busy: float) -> float | None:
    rest = busy - us
    return us / rest if rest > 0 else None


def _bar(values: list[float], med: float, trim: bool = False) -> float:
    """The value a new one must pass: the median plus ``SPREAD_K`` spreads (``trim``: the
    range without its lowest and highest value)."""
    mad = median(abs(v - med) for v in values)
    ordered = sorted(values)
    inner = ordered[1:-1] if trim and len(ordered) >= 4 else ordered
    quarter_range = (inner[-1] - inner[0]) / 4
    return med + SPREAD_K * max(MAD_SCALE * mad, quarter_range, NOISE_FLOOR * med)


def _profile(window: int, us: dict[str, float], step_ms: float | None) -> WindowProfile:
    """A profile, for the examples above."""
    return {"window": window, "us": us, "busy_us": sum(us.values()), "step_ms": step_ms}
