"""Regression marks a user can trust: a window's kernel, or its step time, is marked only when it
rose beyond the spread the run's own earlier windows showed for it, by at least
``regression_threshold``, by a share of the step a user would act on, and in two windows in a
row. Pure.

What is compared, per trainer (role):

- A kernel's time is its per-step self time on the window's rank where it took least: a
  preemption of one rank (a busy host) does not mark a kernel, a regression on every rank does,
  and one rank slower than the others is a straggler (the straggler table names it).
- A kernel is compared **scaled by its window**: its time over its usual time (its median over
  the reference), divided by the window's scale without it, the median of every other kernel's
  such ratio, each weighted by its usual time (the median-of-ratios normalisation of RNA-seq
  counts, DESeq's size factors). A window whose every op ran 20% longer (a longer batch, a busy
  host) has a scale of 1.2 and keeps every kernel's scaled time; one op made 1.5x slower
  multiplies its own by 1.5 and moves no other's scale, however large it is; an allreduce
  waiting 28x longer on its peers moves the median little.
- ... or **as it is** (its time over its usual time), when that was clearly steadier over the
  reference (its bar within ``STEADIER`` of the scaled bar's distance from the median): an op
  that does not follow the window's other ops, as a compute-bound op does not when the
  window's matmuls and elementwise ops run 2x in one window of four (two ranks sharing cores
  side by side), or a wait, or a sleep. ``scaled`` in its row says which.
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

A kernel is **beyond its bar** (a suspect) when its compared time passes its bar and is at
least ``threshold`` times its median, and its time is above what the reference predicts for
this window by at least ``MIN_STEP_SHARE`` of the step and above its usual time by
``MIN_TIME_RISE`` of the step (an op whose time stayed put while the rest of the window shrank
is not slower). The step time is beyond its bar when it passes it and is at least
``threshold`` times its median. What is beyond its bar in two whole windows in a row is
**marked** in both (``confirm``): a busy neighbour, a preempted window or a page-cache flush
lasts one window, a regression does not. A mark therefore shows once the window after the
first slow one has settled. What a window marked stays marked in the next while it is at
least ``threshold`` times its median and matters, bar or not (``judge(previous=...)``). A
kernel new since the reference is not judged (it has no usual time).

Simulated (tests/test_marks.py: 200 runs of 40 windows, the batch +-20% from window to window,
each op +-5% of its own), a steady run gets no mark, and one op made 1.5x slower is marked in
every window from then on; with a slower mode of a third of the other ops' time in one window
of four, a steady op stays unmarked and its 1.5x is marked (50 runs; compared by its share of
the window, as marks first were, it was hidden in 49). On the real reference trainer
(tests/test_marks_real_run.py: 2 ranks sharing 2 cores; 13 recorded runs of each case, each
judged both ways): with the batch +-20%, no mark in any of the 22 windows of 13 runs; an op
made 1.5x slower (45% of the busy time) from window 10 was marked in all 12 windows from 10 on
in 12 runs (by its share of the window: 9), and in the 13th the host's own speed changed under
the run (the op's fixed work took 0.54-1.26x its median in windows 0-9, then 0.81-0.87x with
1.5x the work), which no rule sees through. The limit: with the batch +-20% in the slowed run
too, that op's time follows the batch more than the window's scale does (1.5x becomes
1.2-1.6x), and all 12 slowed windows were marked in 5 of 13 runs, 11 or more in 9, none in 1
(by its share: 3, 7 and 1).

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

from bisect import bisect_left
from itertools import accumulate
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
STEADIER = 0.5
"""A kernel is compared as it is, not scaled by its window, when its bar as it is lies within
this share of its scaled bar's distance from the median."""
MIN_STEP_SHARE = 0.03
"""A kernel's rise over what the reference predicts must be at least this share of the step."""
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
    with whether it passed its bar, the largest rise first."""
    usual = {n: median(p["us"].get(n, 0.0) for p in ref) for n in {n for p in ref for n in p["us"]}}
    names = sorted(n for n, us in usual.items() if us > 0)  # a kernel new here is not slower
    weights = [usual[n] for n in names]
    history = [_scaled(p, names, usual, weights) for p in ref]
    now = _scaled(this, names, usual, weights)
    step_us = this["step_ms"] * 1000.0 if this["step_ms"] else this["busy_us"]
    rows: list[tuple[RegressionKernel, bool]] = []
    for i, name in enumerate(names):
        us = this["us"].get(name, 0.0)
        scaled = [x for h in history if (x := h[i]) is not None]
        as_is = [p["us"].get(name, 0.0) / usual[name] for p in ref]
        view = _steadier(as_is, us / usual[name], scaled, now[i])
        if view is None:
            continue
        by_window, ratio, bar = view
        expected = us / ratio if ratio > 0 else 0.0
        rise = us - expected
        grew = us - usual[name] >= MIN_TIME_RISE * step_us  # not only against a shrunk window
        if ratio >= threshold and rise >= MIN_STEP_SHARE * step_us and grew:
            row: RegressionKernel = {
                "name": name,
                "us": round(us, 3),
                "reference_us": round(usual[name], 3),
                "expected_us": round(expected, 3),
                "ratio": round(ratio, 4),
                "bar": round(bar, 4),
                "step_share": round(rise / step_us, 4),
                "scaled": by_window,
            }
            rows.append((row, ratio > bar))
    return sorted(rows, key=lambda r: _largest_first(r[0]))


def _steadier(
    as_is: list[float], now_as_is: float, scaled: list[float], now_scaled: float | None
) -> tuple[bool, float, float] | None:
    """A kernel's comparison: scaled by its window, unless its time as it is was clearly
    steadier over the reference (its bar nearer its median by ``STEADIER``), as the time of an
    op that does not follow the window's other ops is. Whether scaled, this window's ratio to
    the reference's median, and the bar, as a ratio too; None when it cannot be judged."""
    views = []
    for by_window, values, now in ((True, scaled, now_scaled), (False, as_is, now_as_is)):
        if now is None or len(values) < MIN_REFERENCE:
            continue
        med = median(values)
        if med > 0:
            views.append((by_window, now / med, _bar(values, med, trim=True) / med))
    if len(views) == 2 and views[1][2] - 1 < STEADIER * (views[0][2] - 1):
        return views[1]
    return views[0] if views else None


def _scaled(
    p: WindowProfile, names: list[str], usual: dict[str, float], weights: list[float]
) -> list[float | None]:
    """Each kernel's time in window ``p`` over its usual time, divided by the window's scale
    without it (the weighted median of the other kernels' such ratios); None where that scale
    is 0 (most of the window's usual time missing from it)."""
    ratios = [p["us"].get(n, 0.0) / usual[n] for n in names]
    scales = _medians_without_each(ratios, weights)
    return [r / s if s > 0 else None for r, s in zip(ratios, scales, strict=True)]


def _medians_without_each(values: list[float], weights: list[float]) -> list[float]:
    """For each value, the weighted (lower) median of the others; 0 for a lone value.

    >>> _medians_without_each([1.0, 1.1, 0.9, 3.0], [1.0, 1.0, 1.0, 1.0])  # 3.0 moves none
    [1.1, 1.0, 1.1, 1.0]
    >>> _medians_without_each([1.0, 1.1, 0.9, 3.0], [1.0, 1.0, 1.0, 5.0])  # unless it weighs most
    [3.0, 3.0, 3.0, 1.0]
    """
    order = sorted(range(len(values)), key=values.__getitem__)
    position = {k: i for i, k in enumerate(order)}
    cumulative = list(accumulate(weights[k] for k in order))
    total = cumulative[-1] if cumulative else 0.0
    out = []
    for k, w in enumerate(weights):
        at, half = position[k], (total - w) / 2
        i = bisect_left(cumulative, half, 0, at)  # the others below it reach half
        if i == at:  # ... or those above it, once its own weight is taken out
            i = bisect_left(cumulative, half + w, at + 1)
        out.append(values[order[min(i, len(order) - 1)]] if len(order) > 1 else 0.0)
    return out


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
