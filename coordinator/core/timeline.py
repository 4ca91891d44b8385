"""Every rank of a window on one timeline: one rank's Chrome trace made a process of a merged
trace. Pure: the caller reads each rank's trace and writes what this returns
(``coordinator/ops/timeline.py``), one rank at a time.

- **One process per rank**, named ``rank R · role · node``; its CPU threads and its GPU streams
  (Kineto writes a GPU's events as a process of their own, ``pid`` the device) become its
  tracks, ``thread`` or ``GPU d stream s``, CPU threads first.
- **One clock.** Kineto's ``ts`` plus the trace's ``baseTimeNanoseconds`` is the rank's wall
  clock in microseconds (a trace without it, from an older Kineto, already has wall-clock
  ``ts``). The merged file's ``ts`` are those minus its own ``baseTimeNanoseconds``, so the
  same sum holds in it. Ranks on one node share a clock, so they line up exactly; ranks on two
  nodes line up as well as the nodes' clocks agree (NTP: typically well under a millisecond in
  a data centre; unsynchronised clocks are off by what they are off). A rank whose clock the
  window's collectives set by an offset (``core/collectives.py``: across nodes, or far off) has
  it taken off its times (``offset_us``), so the ranks line up by their collectives. Each
  step's start spread over the ranks is recorded in the file
  (``rayProfiler.step_start_spread_us``): the clocks' disagreement plus the ranks' real skew,
  so an upper bound on the first.
- **Bounded.** Events with a duration under ``min_us`` are left out, and at most
  ``max_events`` per rank are kept, the longest first; a rank's ``ProfilerStep`` spans are
  always kept, events without a duration (flows, instants, counters) go first. What was left
  out is counted per rank in the file (``rayProfiler.ranks``).
- Flow ids are made unique per rank, so no arrow joins two ranks' events.
- **Nothing dropped by Perfetto.** Complete events on one track must nest; Perfetto drops
  one that starts inside another and ends after it (``slice_drop_overlapping_complete_event``:
  an attached job's ``ProfilerStep#N`` ends inside ``Optimizer.step``, where the optimizer hook
  counts the step). Such an event, and what nests in it, goes to a lane of its own
  (``overlap_lanes``): one more track of the same thread, named ``thread 9 · lane 2``. A flow
  event (a ``fwdbwd`` or ``ac2g`` arrow's end) goes with the innermost complete event open at
  its time (``enclosing_lanes``), the slice Perfetto binds it to, so no arrow loses its slice.

>>> t = {"baseTimeNanoseconds": 2_000_000_000, "traceEvents": [
...     {"ph": "X", "name": "ProfilerStep#3", "cat": "user_annotation", "pid": 9, "tid": 9,
...      "ts": 10.0, "dur": 50.0},
...     {"ph": "X", "name": "aten::mm", "pid": 9, "tid": 9, "ts": 12.0, "dur": 30.0},
...     {"ph": "X", "name": "aten::add", "pid": 9, "tid": 9, "ts": 45.0, "dur": 1.0},
...     {"ph": "X", "name": "gemm", "cat": "kernel", "pid": 0, "tid": 7, "ts": 20.0,
...      "dur": 8.0},
...     {"ph": "M", "name": "process_labels", "pid": 0, "tid": 0, "args": {"labels": "GPU 0"}}]}
>>> events, count, steps = rank_process(t, {"rank": 1, "role": "policy", "node": "n1"},
...                                     pid=2, origin=2_000_000.0, min_us=2.0)
>>> [(e["name"], e["pid"], e["tid"], e["ts"]) for e in events if e["ph"] == "X"]
[('ProfilerStep#3', 2, 1, 10.0), ('aten::mm', 2, 1, 12.0), ('gemm', 2, 2, 20.0)]
>>> [e["args"]["name"] for e in events if e["name"] in ("process_name", "thread_name")]
['rank 1 · policy · n1', 'thread 9', 'GPU 0 stream 7']
>>> count["kept"], count["below_min_us"], steps
(3, 1, {3: 10.0})
"""

from __future__ import annotations

import heapq
import math
from typing import Any, TypeGuard

from coordinator.protocol.timeline import RankCount, RankLabel

DEFAULT_MAX_EVENTS = 100_000
"""Events kept per rank unless asked otherwise: a 64-rank window stays under 200 MB gzipped."""
MARGIN_US = 60_000_000.0
"""The merged clock starts this long before the first rank's first event, on a whole second, so
that ranks whose clocks are a little behind still get positive times."""
STEP_PREFIX = "ProfilerStep#"
_METADATA = {"process_name", "process_labels", "process_sort_index", "thread_name",
             "thread_sort_index"}  # fmt: skip


def wall_us(trace: dict[str, Any]) -> tuple[float, str]:
    """What to add to a trace's ``ts`` for wall-clock microseconds, and where it came from."""
    base = trace.get("baseTimeNanoseconds")
    if isinstance(base, int | float) and not isinstance(base, bool) and base > 0:
        return base / 1000.0, "baseTimeNanoseconds"
    return 0.0, "ts"


def origin_us(trace: dict[str, Any]) -> float:
    """The merged clock's zero for a window whose first rank read is ``trace``: a whole second
    ``MARGIN_US`` before its first event, in wall-clock microseconds."""
    shift, _ = wall_us(trace)
    first = min((e["ts"] for e in _events(trace) if _number(e.get("ts"))), default=0.0)
    return math.floor((first + shift - MARGIN_US) / 1e6) * 1e6


def rank_process(
    trace: dict[str, Any],
    label: RankLabel,
    *,
    pid: int,
    origin: float,
    min_us: float = 0.0,
    max_events: int = DEFAULT_MAX_EVENTS,
    offset_us: float = 0.0,
) -> tuple[list[dict[str, Any]], RankCount, dict[int, float]]:
    """One rank's trace as process ``pid`` of the merged trace whose clock starts at
    ``origin`` (wall-clock microseconds), ``offset_us`` (its clock's offset) taken off its
    times: its events, what was kept and left out, and its steps' start times (step -> merged
    ``ts``) (see the module's example)."""
    shift, clock = wall_us(trace)
    delta = shift - origin - offset_us  # (first: the two are ~1.7e15 us, where a float keeps
    # 0.25 us only)
    gpus, names, body = _kineto_names(trace)
    kept, below, over = _bounded(body, min_us, max_events)
    out = [dict(e, ts=round(e["ts"] + delta, 3)) if _number(e.get("ts")) else dict(e)
           for e in kept]  # fmt: skip
    tracks: dict[tuple[Any, Any, int], int] = {}
    steps: dict[int, float] = {}
    scope = (label["rank"] + 1) << 32  # flow ids: unique per rank
    for e, lane in zip(out, _lanes(out), strict=True):
        key = (e.get("pid"), e.get("tid"), lane)
        e["pid"], e["tid"] = pid, tracks.setdefault(key, len(tracks) + 1)
        if "id" in e and e.get("ph") in ("s", "t", "f"):
            e["id"] = scope + e["id"] if isinstance(e["id"], int) else f"{label['rank']}:{e['id']}"
        step = _step(e)
        if step is not None:
            steps[step] = e["ts"]
    count = RankCount(
        rank=label["rank"],
        role=label["role"],
        node=label["node"],
        pid=pid,
        events=len(body),
        kept=len(out),
        below_min_us=below,
        over_max_events=over,
        clock=clock,
        clock_offset_us=offset_us,
    )
    return _track_names(pid, label, tracks, gpus, names) + out, count, steps


def _kineto_names(
    trace: dict[str, Any],
) -> tuple[dict[Any, str], dict[tuple[Any, Any], str], list[dict[str, Any]]]:
    """A trace's GPU processes (device pid -> "GPU d"), its thread names, and its other
    events (Kineto's process and thread names left out: the merged trace has its own)."""
    gpus: dict[Any, str] = {}
    names: dict[tuple[Any, Any], str] = {}
    body: list[dict[str, Any]] = []
    for e in _events(trace):
        if e.get("ph") == "M" and e.get("name") in _METADATA:
            args = e.get("args") or {}
            if e["name"] == "process_labels" and str(args.get("labels", "")).startswith("GPU"):
                gpus[e.get("pid")] = str(args["labels"])
            elif e["name"] == "thread_name" and args.get("name"):
                names[(e.get("pid"), e.get("tid"))] = str(args["name"])
        else:
            body.append(e)
    return gpus, names, body


def _track_names(
    pid: int,
    label: RankLabel,
    tracks: dict[tuple[Any, Any, int], int],
    gpus: dict[Any, str],
    names: dict[tuple[Any, Any], str],
) -> list[dict[str, Any]]:
    """The rank's process and track names, its CPU threads first, then its GPU streams; a
    thread's extra lanes right after it, named for it."""
    title = f"rank {label['rank']} · {label['role']} · {label['node']}"
    meta = [_meta(pid, 0, "process_name", name=title),
            _meta(pid, 0, "process_sort_index", sort_index=pid)]  # fmt: skip
    first: dict[tuple[Any, Any], int] = {}  # each thread's first track
    for (src, tid, _), track in tracks.items():
        first.setdefault((src, tid), track)
    ordered = sorted(tracks, key=lambda k: (k[0] in gpus, first[k[:2]], k[2]))
    for order, (src, tid, lane) in enumerate(ordered):
        gpu = gpus.get(src)
        name = f"{gpu} stream {tid}" if gpu else names.get((src, tid), f"thread {tid}")
        name += f" · lane {lane + 1}" if lane else ""
        track = tracks[(src, tid, lane)]
        meta += [_meta(pid, track, "thread_name", name=name),
                 _meta(pid, track, "thread_sort_index", sort_index=order)]  # fmt: skip
    return meta


def overlap_lanes(spans: list[tuple[int, int]]) -> list[int]:
    """A lane for each (start, end) span of one track, so that the spans of each lane nest
    (none starts inside another and ends after it; Perfetto drops such a span). Lane 0 unless
    a span cannot nest there; a span goes where its innermost container is (the latest
    started), else to the first free lane, else to a new one. Deterministic: the spans'
    order breaks ties.

    >>> overlap_lanes([(0, 10), (2, 4), (8, 14), (9, 12), (10, 20), (15, 16)])
    [0, 0, 1, 1, 0, 0]
    """
    order = sorted((start, -end, i) for i, (start, end) in enumerate(spans))
    stacks: list[list[tuple[int, int]]] = []  # per lane, the open spans, innermost last
    lanes = [0] * len(spans)
    for start, minus_end, i in order:
        end = -minus_end
        best, best_start = -1, -1
        for lane, stack in enumerate(stacks):
            while stack and stack[-1][1] <= start:
                stack.pop()
            if stack and stack[-1][1] >= end and stack[-1][0] > best_start:
                best, best_start = lane, stack[-1][0]
        if best < 0:
            best = next((k for k, stack in enumerate(stacks) if not stack), len(stacks))
        if best == len(stacks):
            stacks.append([])
        stacks[best].append((start, end))
        lanes[i] = best
    return lanes


def enclosing_lanes(spans: list[tuple[int, int]], lanes: list[int], times: list[int]) -> list[int]:
    """For each time, the lane of the innermost of ``spans`` open at it (the latest started,
    then the shortest; open from its start to its end, both included), 0 where none is: where
    Perfetto binds a flow event (to the innermost slice open on its track), so an arrow goes
    to the lane its slice went to.

    >>> enclosing_lanes([(0, 100), (80, 130), (85, 95)], [0, 1, 1], [5, 85, 120, 200])
    [0, 1, 1, 0]
    """
    order = sorted(range(len(spans)), key=lambda i: (spans[i][0], -spans[i][1]))
    stacks: dict[int, list[tuple[int, int]]] = {}  # per lane, its open spans, innermost last
    out, k = [0] * len(times), 0
    for j in sorted(range(len(times)), key=times.__getitem__):
        t = times[j]
        while k < len(order) and spans[order[k]][0] <= t:
            stacks.setdefault(lanes[order[k]], []).append(spans[order[k]])
            k += 1
        inner: tuple[int, int] = (-1, 0)  # the innermost open span's (start, -end)
        for lane, stack in stacks.items():
            while stack and stack[-1][1] < t:
                stack.pop()
            if stack and (stack[-1][0], -stack[-1][1]) > inner:
                inner, out[j] = (stack[-1][0], -stack[-1][1]), lane
    return out


def _lanes(events: list[dict[str, Any]]) -> list[int]:
    """Each event's lane on its track: a complete event's from ``overlap_lanes`` (over the
    track's complete events in whole nanoseconds, as Perfetto reads them), a flow event's
    (``s``, ``t``, ``f``) that of the innermost complete event open at its time
    (``enclosing_lanes``); 0 for any other event."""
    tracks: dict[tuple[Any, Any], tuple[list[int], list[tuple[int, int]], list[int]]] = {}
    for i, e in enumerate(events):
        ts, dur, ph = e.get("ts"), e.get("dur"), e.get("ph")
        if not _number(ts) or not (ph in ("s", "t", "f") or ph == "X" and _number(dur)):
            continue
        members, spans, flows = tracks.setdefault((e.get("pid"), e.get("tid")), ([], [], []))
        start = round(ts * 1000)
        if _number(dur) and ph == "X":
            members.append(i)
            spans.append((start, start + max(round(dur * 1000), 0)))
        else:
            flows.append(i)
    lanes = [0] * len(events)
    for members, spans, flows in tracks.values():
        of_spans = overlap_lanes(spans)
        times = [round(events[i]["ts"] * 1000) for i in flows]
        for i, lane in zip(members + flows, of_spans + enclosing_lanes(spans, of_spans, times),
                           strict=True):  # fmt: skip
            lanes[i] = lane
    return lanes


def step_spread(starts: list[dict[int, float]]) -> dict[int, float]:
    """Each step's start spread over the ranks that recorded it (two or more), microseconds:
    the clocks' disagreement plus the ranks' real skew.

    >>> step_spread([{3: 10.0, 4: 60.0}, {3: 10.4, 4: 61.0}, {3: 9.9}])
    {3: 0.5, 4: 1.0}
    """
    by_step: dict[int, list[float]] = {}
    for ranks in starts:
        for step, ts in ranks.items():
            by_step.setdefault(step, []).append(ts)
    return {s: round(max(v) - min(v), 3) for s, v in sorted(by_step.items()) if len(v) > 1}


def _bounded(
    body: list[dict[str, Any]], min_us: float, max_events: int
) -> tuple[list[dict[str, Any]], int, int]:
    """The events kept (in their order), and how many were under ``min_us`` and over
    ``max_events``. Steps are always kept; then the longest; events without a duration last."""
    long = [e for e in body if _step(e) is not None or _at_least(_dur(e), min_us)]
    below = len(body) - len(long)
    if len(long) <= max_events:
        return long, below, 0
    rank = heapq.nlargest(max_events, range(len(long)), key=lambda i: _priority(long[i]))
    return [long[i] for i in sorted(rank)], below, len(long) - max_events


def _priority(e: dict[str, Any]) -> tuple[bool, float]:
    d = _dur(e)
    return _step(e) is not None, -1.0 if d is None else d


def _at_least(d: float | None, min_us: float) -> bool:
    return d is None or d >= min_us


def _dur(e: dict[str, Any]) -> float | None:
    d = e.get("dur")
    return float(d) if e.get("ph") == "X" and isinstance(d, int | float) else None


def _step(e: dict[str, Any]) -> int | None:
    name = e.get("name")
    if e.get("ph") == "X" and isinstance(name, str) and name.startswith(STEP_PREFIX):
        tail = name[len(STEP_PREFIX) :]
        return int(tail) if tail.isdigit() else None
    return None


def _number(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        raise ValueError("not a Chrome trace: no traceEvents list")
    return [e for e in events if isinstance(e, dict)]


def _meta(pid: int, tid: int, kind: str, **args: Any) -> dict[str, Any]:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "ts": 0, "args": args}
