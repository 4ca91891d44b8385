"""pandas views of ``status()`` and ``kernel_summary()`` (the ``notebook`` extra).

import ray
from coordinator.ops import notebook as nb
ray.init(address="auto", namespace="profiler")
h = ray.get_actor("profiler")
nb.kernels_frame(ray.get(h.kernel_summary.remote(top_k=20)))
"""

from __future__ import annotations

from typing import Any


def _pd() -> Any:
    try:
        import pandas as pd
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the notebook helpers need pandas: pip install 'ray-profiler-coordinator[notebook]'"
        ) from exc
    return pd


def kernels_frame(summary: dict[str, Any]) -> Any:
    """One row per kernel: total/mean/min/max/std self time (us), max rank, calls, share;
    with ``kernel_summary(by="op")`` one row per op (CUDA: device time), with its ``cpu_us``
    and its largest ``kernels`` too."""
    pd = _pd()
    cols = [
        "name",
        "total_us",
        "mean_us",
        "min_us",
        "max_us",
        "std_us",
        "max_rank",
        "count",
        "share",
    ]
    frame = pd.DataFrame(summary["kernels"], columns=cols)
    ops = summary.get("ops")
    if ops is not None:
        frame["cpu_us"] = [ops.get(n, {}).get("cpu_us", 0.0) for n in frame["name"]]
        frame["kernels"] = [ops.get(n, {}).get("kernels", []) for n in frame["name"]]
    frame.attrs.update(
        window=summary["window"],
        steps=summary["steps"],
        unit=summary["unit"],
        device=summary["device"],
        by=summary.get("by", "kernel"),
    )
    return frame


def rank_kernel_frame(summary: dict[str, Any]) -> Any:
    """Ranks x kernels of self time (us); needs ``kernel_summary(per_rank=True)``."""
    pd = _pd()
    per_rank = summary.get("per_rank")
    if not per_rank:
        raise ValueError(
            "this summary has no per-rank values: ask kernel_summary(per_rank=True) "
            "(kept for the most recent detail_windows windows)"
        )
    frame = pd.DataFrame(
        {name: {int(r): v for r, v in by_rank.items()} for name, by_rank in per_rank.items()}
    )
    frame.index.name = "rank"
    return frame.sort_index()


def stragglers_frame(summary: dict[str, Any]) -> Any:
    """Per rank: step and kernel time, and their ratio to the median over ranks; the rank the
    others waited for in collectives (and why) in ``attrs["last_arriver"]``."""
    pd = _pd()
    ranks = summary["stragglers"]["ranks"]
    frame = pd.DataFrame.from_dict({int(r): v for r, v in ranks.items()}, orient="index")
    frame.index.name = "rank"
    frame = frame.sort_index()
    frame.attrs["last_arriver"] = summary["stragglers"].get("last_arriver")
    return frame


def breakdown_frame(summary: dict[str, Any]) -> Any:
    """Per rank: compute, comm, memcpy and other time (us) and their shares of the window."""
    pd = _pd()
    ranks = (summary.get("breakdown") or {}).get("ranks") or {}
    frame = pd.DataFrame.from_dict({int(r): v for r, v in ranks.items()}, orient="index")
    frame.index.name = "rank"
    return frame.sort_index()


def memory_frame(summary: dict[str, Any]) -> Any:
    """Top allocating ops across ranks (with ``profile_memory``); ``attrs`` holds the peaks."""
    pd = _pd()
    mem = summary.get("memory")
    if not mem:
        raise ValueError("this window has no memory data: profile with profile_memory: true")
    cols = ["name", "total_bytes", "mean_bytes", "max_bytes", "max_rank", "count", "share"]
    frame = pd.DataFrame(mem["ops"], columns=cols)
    frame.attrs.update(window=summary["window"], peak_bytes=dict(mem["peak_bytes"]))
    return frame


def collectives_frame(reply: dict[str, Any]) -> Any:
    """One row per rank of a ``collectives()`` reply (index: the rank): the collectives it was
    matched in, how often it arrived last, its wait in them (us, all together and
    ``wait_us_per_step``: the mean over the steps it waited in), its clock offset against
    ``clock_reference`` with its spread, whether its times were corrected, and its collectives
    past its summary's cap (``cut``). ``attrs``: the window, ``matched``, ``shown`` and the
    reply's ``problems``.

    Example::

        c = ray.get(h.collectives.remote(window=3))
        nb.collectives_frame(c).sort_values("arrived_last", ascending=False).head()
    """
    pd = _pd()
    rows = {
        r["rank"]: {
            **{k: v for k, v in r.items() if k not in ("rank", "wait_us_per_step")},
            "wait_us_per_step": _mean(r["wait_us_per_step"].values()),
        }
        for r in reply["ranks"]
    }
    cols = ["collectives", "arrived_last", "wait_us", "wait_us_per_step", "clock_reference",
            "clock_offset_us", "clock_spread_us", "clock_corrected", "cut"]  # fmt: skip
    frame = pd.DataFrame.from_dict(rows, orient="index", columns=cols)
    frame.index.name = "rank"
    frame.attrs.update({k: reply.get(k) for k in _COLLECTIVES_ATTRS})
    return frame.sort_index()


def matched_collectives_frame(reply: dict[str, Any]) -> Any:
    """One row per matched collective of a ``collectives()`` reply (those it lists: the
    ``shown`` largest skews), in the reply's order: group, seq, name, step, the ranks matched
    and missing, the last to arrive, the skew, the transfer, bytes, bandwidths (GB/s), and each
    rank's wait as a column ``wait_us_<rank>`` (NaN: not in that collective's group)."""
    pd = _pd()
    cols = ["group", "seq", "name", "step", "ranks", "missing", "last_rank", "skew_us",
            "transfer_us", "bytes", "algbw_gbps", "busbw_gbps"]  # fmt: skip
    ranks = sorted({int(r) for m in reply["collectives"] for r in m["wait_us"]})
    rows = [
        {**{c: m[c] for c in cols}, **{f"wait_us_{r}": m["wait_us"].get(str(r)) for r in ranks}}
        for m in reply["collectives"]
    ]
    frame = pd.DataFrame(rows, columns=[*cols, *(f"wait_us_{r}" for r in ranks)])
    frame.attrs.update({k: reply.get(k) for k in _COLLECTIVES_ATTRS})
    return frame


_COLLECTIVES_ATTRS = ("run", "window", "steps", "trainer_id", "role", "matched", "shown",
                      "problems", "ranks_without")  # fmt: skip


def _mean(values: Any) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def ranks_frame(status: dict[str, Any]) -> Any:
    """One row per rank of a ``status()`` (or a ``ranks()`` page): state, reason, windows
    captured, last trace. A default ``status()`` of a run of over 256 ranks lists only the
    ranks that are not ok (``attrs["complete"]`` is then False): pass ``status(ranks="all")``."""
    pd = _pd()
    rows = []
    for r in status["ranks"]:
        reason = r["reason"] or {}
        rows.append(
            {
                **{k: v for k, v in r.items() if k != "reason"},
                "reason": reason.get("message"),
                "where": reason.get("where"),
            }
        )
    frame = pd.DataFrame(rows)
    frame.attrs["complete"] = status.get("ranks_complete", True)
    return frame


def windows_frame(status: dict[str, Any]) -> Any:
    """One row per closed window; an auto capture's row says why it was taken (``ratio`` of its
    slow steps over the run's baseline, ``baseline_ms``, ``recent_ms``, ``trigger_step``)."""
    pd = _pd()
    rows = [
        {
            "index": w["index"],
            "kind": w.get("kind"),
            "ratio": (w.get("trigger") or {}).get("ratio"),
            "baseline_ms": (w.get("trigger") or {}).get("baseline_ms"),
            "recent_ms": (w.get("trigger") or {}).get("recent_ms"),
            "trigger_step": (w.get("trigger") or {}).get("step"),
            "first": w["steps"][0] if w["steps"] else None,
            "last": w["steps"][1] if w["steps"] else None,
            "partial": w["partial"],
            "ranks": w["ranks"],
            "stragglers": w.get("stragglers", []),
            "trace_dir": w["trace_dir"],
        }
        for w in status["windows"]
    ]
    return pd.DataFrame(rows).set_index("index") if rows else pd.DataFrame()


def roles_frame(status: dict[str, Any], value: str = "step_ms") -> Any:
    """Roles x global steps of every closed window: each role's step time (``step_ms``, the
    mean over its profiled ranks) or its ``busy_ms_per_step`` (self time of every op per
    step, one value per window), side by side on the same steps.

    Example::

        nb.roles_frame(ray.get(h.status.remote()))   # rows policy, rollout; columns steps
    """
    pd = _pd()
    if value not in ("step_ms", "busy_ms_per_step"):
        raise ValueError(f"value must be 'step_ms' or 'busy_ms_per_step', got {value!r}")
    data: dict[str, dict[int, float]] = {}
    for w in status["windows"]:
        for part in (w.get("roles") or {}).values():
            row = data.setdefault(part["role"], {})
            if value == "step_ms":
                row.update({int(k): v for k, v in part["step_ms"].items()})
            elif w["steps"] and part["busy_ms_per_step"] is not None:
                row.update(
                    dict.fromkeys(range(w["steps"][0], w["steps"][1] + 1), part["busy_ms_per_step"])
                )
    frame = pd.DataFrame.from_dict(data, orient="index")
    frame.index.name, frame.columns.name = "role", "step"
    return frame.sort_index(axis=1)


def step_times_frame(summaries: list[dict[str, Any]]) -> Any:
    """Windows x ranks of mean step time (ms), from one ``kernel_summary`` per window."""
    pd = _pd()
    data = {
        s["window"]: {int(r): v["step_ms"] for r, v in s["stragglers"]["ranks"].items()}
        for s in summaries
        if s["window"] is not None
    }
    frame = pd.DataFrame.from_dict(data, orient="index")
    frame.index.name = "window"
    return frame.sort_index().sort_index(axis=1)


def stacks_frame(stacks: dict[str, Any]) -> Any:
    """One row per process of a ``stacks()`` reply: trainer, role, rank (None: the driver),
    node, pid, how its stack was read, what it does (``kind``), its short stack, its group
    and whether that group is the likely culprit, or why it has no stack."""
    pd = _pd()
    group_of = {}
    for g in stacks["groups"]:
        for r in g["ranks"] if g["who"] == "rank" else [None]:
            group_of[(g["trainer_id"], g["who"], r)] = g
    rows = []
    for e in stacks["entries"]:
        g = group_of.get((e["trainer_id"], e["who"], e["rank"]))
        rows.append(
            {
                **{k: e[k] for k in ("trainer_id", "role", "who", "rank", "node_id", "pid")},
                **{k: e[k] for k in ("method", "kind", "stack", "error")},
                "group": g["label"] if g else None,
                "culprit": bool(g and g["culprit"]),
            }
        )
    return pd.DataFrame(rows)


def phases_frame(phases: dict[str, Any]) -> Any:
    """One row per step of a ``phase_times()`` reply (index: the step), one column per region
    and ``other`` (the time in no region), in ms; the columns add up to the step's wall time."""
    pd = _pd()
    names = [r["region"] for r in phases["regions"]]
    rows = {
        s["step"]: {**{n: s["regions"].get(n, 0.0) for n in names}, "other": s["other_ms"]}
        for s in phases["steps"]
    }
    frame = pd.DataFrame.from_dict(rows, orient="index", columns=[*names, "other"])
    frame.index.name = "step"
    return frame


def diff_frame(
    diff: dict[str, Any] | str,
    b: str | None = None,
    top_k: int = 30,
    coordinator: Any = None,
    save_path: str | None = None,
) -> Any:
    """One row per kernel of a ``kernel_diff()`` reply, largest change first: its per-step
    self time per rank (us) in window a and b, the change, the ratio and its status.

    Or of two sides, as ``ray-profiler diff`` takes them, across jobs::

        nb.diff_frame("s3://bucket/profiles/job-0405:3", "job-0412:3", coordinator=h)

    each ``WINDOW`` or ``RUN:WINDOW`` (a record's path or URL, a run's directory, or a run's
    name: kept by ``coordinator``, else recorded under ``save_path`` or the coordinator's)."""
    if isinstance(diff, str):
        diff = dict(_diff_across(diff, b, top_k, coordinator, save_path))
    pd = _pd()
    cols = ["name", "status", "a_us", "b_us", "change_us", "ratio"]
    return pd.DataFrame([{c: k[c] for c in cols} for k in diff["kernels"]], columns=cols)


def _diff_across(a: str, b: str | None, top_k: int, coordinator: Any, save_path: str | None) -> Any:
    from coordinator.ops.cross_diff import diff_across

    if b is None:
        raise ValueError("diff_frame(a, b): two sides, each WINDOW or RUN:WINDOW")
    live = None
    if coordinator is not None:
        import ray

        def live(method: str, *args: Any, **kw: Any) -> Any:
            return ray.get(getattr(coordinator, method).remote(*args, **kw))

        save_path = save_path or live("get_config").get("save_path")
    return diff_across(a, b, top_k, live, save_path)
