"""A window's ranks merged into one Chrome trace (coordinator/core/timeline.py and
coordinator/ops/timeline.py), on real GPU traces (tests/data/gpu-traces): HTA's two-rank
window (wall-clock ``ts``, no ``baseTimeNanoseconds``) and its NCCL rank
(``baseTimeNanoseconds``, flow arrows)."""

from __future__ import annotations

import gzip
import json
import os
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.timeline import DEFAULT_MAX_EVENTS, RankLabel
from coordinator.ops.timeline import MIN_PER_RANK, TOTAL_EVENTS, write_timeline
from tests.conftest import ROOT

TRACES = os.path.join(ROOT, "tests", "data", "gpu-traces")
TWO = [os.path.join(TRACES, "two-ranks", f"sampled_rank-{r}.json.gz") for r in (0, 1)]
NCCL = os.path.join(TRACES, "one-rank-nccl", "nccl_rank0_of_2.json.gz")
KINETO_NAMES = {"process_name", "process_labels", "process_sort_index", "thread_name",
                "thread_sort_index"}  # fmt: skip


def load(path: str) -> dict:
    with gzip.open(path) if path.endswith(".gz") else open(path, "rb") as f:
        return json.load(f)


def body(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if not (e["ph"] == "M" and e["name"] in KINETO_NAMES)]


def label(rank: int, role: str = "policy", node: str = "10.0.0.1") -> RankLabel:
    return RankLabel(rank=rank, role=role, node=node)


def test_two_real_gpu_ranks_become_two_processes_on_one_clock_with_every_event(tmp_path):
    out = str(tmp_path / "window.json.gz")
    res = write_timeline([(label(0), TWO[0]), (label(1, node="10.0.0.2"), TWO[1])], out)
    merged = load(out)
    assert res["bytes"] == os.path.getsize(out) and res["events"] == len(merged["traceEvents"])
    events = merged["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {1: "rank 0 · policy · 10.0.0.1", 2: "rank 1 · policy · 10.0.0.2"}
    base_us = merged["baseTimeNanoseconds"] / 1000
    for pid, path in ((1, TWO[0]), (2, TWO[1])):
        original = body(load(path))
        mine = [e for e in events if e["pid"] == pid and e["ph"] != "M"]
        # every event kept, in its order, on the wall clock (these traces' ts are wall clock)
        assert [e["name"] for e in mine] == [e["name"] for e in original]
        assert all(
            abs(m["ts"] + base_us - o["ts"]) < 0.002 for m, o in zip(mine, original, strict=True)
        )
        assert [e.get("dur") for e in mine] == [e.get("dur") for e in original]
        # its GPU streams are tracks of its process, after its CPU threads
        tracks = {e["tid"]: e["args"]["name"] for e in events if e["pid"] == pid
                  and e["name"] == "thread_name"}  # fmt: skip
        order = {e["tid"]: e["args"]["sort_index"] for e in events if e["pid"] == pid
                 and e["name"] == "thread_sort_index"}  # fmt: skip
        gpu = {t for t, n in tracks.items() if n.startswith("GPU ")}
        devices = {e["pid"] for e in load(path)["traceEvents"] if e["name"] == "process_labels"
                   and e["args"]["labels"].startswith("GPU")}  # fmt: skip
        streams = {(e["pid"], e["tid"]) for e in original if e["pid"] in devices}
        assert len(gpu) == len(streams) >= 1
        assert max(order[t] for t in tracks if t not in gpu) < min(order[t] for t in gpu)
        assert all(
            (m["tid"] in gpu) == (o["pid"] in devices) for m, o in zip(mine, original, strict=True)
        )
    about = merged["rayProfiler"]
    assert [(r["rank"], r["kept"], r["below_min_us"], r["over_max_events"]) for r in
            about["ranks"]] == [(0, len(body(load(TWO[0]))), 0, 0),
                                (1, len(body(load(TWO[1]))), 0, 0)]  # fmt: skip
    assert [r["clock"] for r in about["ranks"]] == ["ts", "ts"]
    # Both ranks recorded steps 551 and 552: their start spread is there, and small.
    assert set(about["step_start_spread_us"]) == {"551", "552"}
    assert res["step_start_spread_us"][551] == about["step_start_spread_us"]["551"]


def test_base_time_aligns_and_flow_ids_stay_within_their_rank(tmp_path):
    out = str(tmp_path / "w.json")
    write_timeline([(label(0), NCCL), (label(1), NCCL)], out)  # two ranks, the same recording
    merged = load(out)
    original = load(NCCL)
    shift = original["baseTimeNanoseconds"] / 1000 - merged["baseTimeNanoseconds"] / 1000
    first = next(e for e in body(original) if e["ph"] == "X")
    copies = [e for e in merged["traceEvents"] if e["ph"] == "X" and e["name"] == first["name"]
              and e.get("dur") == first.get("dur")]  # fmt: skip
    assert {e["pid"] for e in copies} == {1, 2}
    assert all(abs(e["ts"] - (first["ts"] + shift)) < 0.002 for e in copies)
    assert merged["rayProfiler"]["ranks"][0]["clock"] == "baseTimeNanoseconds"
    flows = [e for e in merged["traceEvents"] if e["ph"] in ("s", "f")]
    assert len(flows) == 2 * sum(e["ph"] in ("s", "f") for e in original["traceEvents"])
    by_id = {}
    for e in flows:
        by_id.setdefault(e["id"], set()).add(e["pid"])
    assert all(len(pids) == 1 for pids in by_id.values())  # no arrow joins two ranks


def test_short_events_and_events_over_the_limit_are_left_out_and_counted(tmp_path):
    original = body(load(NCCL))
    timed = [e for e in original if e["ph"] == "X"]
    steps = [e for e in timed if e["name"].startswith("ProfilerStep#")]
    short = [e for e in timed if e["dur"] < 10 and e not in steps]
    out = str(tmp_path / "w.json.gz")
    res = write_timeline([(label(0), NCCL)], out, min_us=10)
    (count,) = res["ranks"]
    assert count["below_min_us"] == len(short) > 0
    assert count["kept"] == len(original) - len(short)
    kept = [e for e in load(out)["traceEvents"] if e["ph"] == "X"]
    assert min(e["dur"] for e in kept if not e["name"].startswith("ProfilerStep#")) >= 10
    # At most 500 events: the steps, then the longest.
    res = write_timeline([(label(0), NCCL)], out, max_events=500)
    (count,) = res["ranks"]
    assert count["kept"] == 500 and count["over_max_events"] == len(original) - 500
    kept = [e for e in load(out)["traceEvents"] if e["ph"] != "M"]
    assert {e["name"] for e in steps} <= {e["name"] for e in kept}
    others = sorted((e["dur"] for e in timed if e not in steps), reverse=True)
    cut = others[500 - len(steps) - 1]
    assert all(e["dur"] >= cut for e in kept if e["ph"] == "X")
    assert sum(e["ph"] == "X" for e in kept) == 500  # flows and instants went first
    assert load(out)["rayProfiler"]["max_events_per_rank"] == 500
    # A limit of as many events as steps keeps the steps, not the longer profiler span around
    # them; and no --min-us drops a step.
    write_timeline([(label(0), NCCL)], out, max_events=len(steps))
    kept = [e["name"] for e in load(out)["traceEvents"] if e["ph"] == "X"]
    assert sorted(kept) == sorted(e["name"] for e in steps)
    write_timeline([(label(0), NCCL)], out, min_us=1e9)
    kept = [e["name"] for e in load(out)["traceEvents"] if e["ph"] == "X"]
    assert sorted(kept) == sorted(e["name"] for e in steps)  # (untimed events stay)


def test_the_default_limit_shares_a_budget_over_the_ranks():
    from coordinator.ops.timeline import _per_rank

    assert _per_rank(None, 2) == DEFAULT_MAX_EVENTS
    assert _per_rank(None, 64) == TOTAL_EVENTS // 64 == DEFAULT_MAX_EVENTS
    assert _per_rank(None, 1024) == TOTAL_EVENTS // 1024
    assert _per_rank(None, 100_000) == MIN_PER_RANK
    assert _per_rank(7, 1024) == 7


def test_bad_input_is_refused_with_a_reason(tmp_path):
    bad = tmp_path / "rank0.json"
    bad.write_text(json.dumps({"not": "a trace"}))
    with pytest.raises(ValueError, match="no traceEvents"):
        write_timeline([(label(0), str(bad))], str(tmp_path / "out.json"))
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a Chrome trace"):
        write_timeline([(label(0), str(bad))], str(tmp_path / "out.json"))
    with pytest.raises(ValueError, match="min_us"):
        write_timeline([(label(0), NCCL)], str(tmp_path / "out.json"), min_us=-1)
    with pytest.raises(ValueError, match="max_events"):
        write_timeline([(label(0), NCCL)], str(tmp_path / "out.json"), max_events=0)
    with pytest.raises(ValueError, match="no trace"):
        write_timeline([], str(tmp_path / "out.json"))


def test_a_rank_whose_clock_is_behind_still_gets_positive_times(tmp_path):
    trace = load(NCCL)
    behind = dict(trace, baseTimeNanoseconds=trace["baseTimeNanoseconds"] - 30_000_000_000)
    path = tmp_path / "behind.json"
    path.write_text(json.dumps(behind))
    out = str(tmp_path / "w.json")
    write_timeline([(label(0), NCCL), (label(1), str(path))], out)
    events = load(out)["traceEvents"]
    assert min(e["ts"] for e in events if e["ph"] != "M") > 0
    starts = Counter(e["pid"] for e in events if e["ph"] == "X")
    assert starts[1] == starts[2]


def test_pieces_on_two_clocks_are_joined_on_one(tmp_path):
    # Two nodes' pieces whose first events are 90 s apart have origins 90 s apart: joined, each
    # event still reads its rank's own wall-clock time.
    from worker_ext.agent.timeline_file import join_pieces, write_piece

    trace = load(NCCL)
    ahead = dict(trace, baseTimeNanoseconds=trace["baseTimeNanoseconds"] + 90_000_000_000)
    (tmp_path / "ahead.json").write_text(json.dumps(ahead))
    pieces = [
        write_piece([{"label": label(r), "pid": r + 1, "path": path}],
                    str(tmp_path / f"piece{r}.json.gz"), min_us=0.0, max_events=100_000)
        for r, path in ((0, NCCL), (1, str(tmp_path / "ahead.json")))
    ]  # fmt: skip
    assert pieces[1]["origin"] - pieces[0]["origin"] == 90_000_000.0
    out = str(tmp_path / "joined.json")
    size, events, spread = join_pieces(pieces, out, min_us=0.0, max_events=100_000)
    joined = load(out)
    assert size == os.path.getsize(out) and events == len(joined["traceEvents"])
    base = joined["baseTimeNanoseconds"] / 1000
    first = next(e for e in body(trace) if e["ph"] == "X")
    for pid, src in ((1, trace), (2, ahead)):
        mine = next(e for e in joined["traceEvents"] if e["pid"] == pid and e["ph"] == "X")
        wall = first["ts"] + src["baseTimeNanoseconds"] / 1000
        assert abs(mine["ts"] + base - wall) < 0.002
    assert all(abs(v - 90_000_000.0) < 1.0 for v in spread.values()) and spread
    assert [c["pid"] for c in joined["rayProfiler"]["ranks"]] == [1, 2]


def test_a_rank_whose_clock_the_collectives_set_lines_up_by_its_offset(tmp_path):
    # The same recording on a node whose clock reads 90 s ahead, its offset (from the window's
    # collectives) given: joined, its events line up with the first rank's, and the offset is
    # said in its count. Without it, they stay 90 s apart (the test above).
    from worker_ext.agent.timeline_file import join_pieces, write_piece

    trace = load(NCCL)
    ahead = dict(trace, baseTimeNanoseconds=trace["baseTimeNanoseconds"] + 90_000_000_000)
    (tmp_path / "ahead.json").write_text(json.dumps(ahead))
    pieces = [
        write_piece([{"label": label(0), "pid": 1, "path": NCCL}], str(tmp_path / "p0.json"),
                    min_us=0.0, max_events=100_000),
        write_piece([{"label": label(1), "pid": 2, "path": str(tmp_path / "ahead.json"),
                      "clock_offset_us": 90_000_000.0}], str(tmp_path / "p1.json"),
                    min_us=0.0, max_events=100_000),
    ]  # fmt: skip
    out = str(tmp_path / "joined.json")
    _, _, spread = join_pieces(pieces, out, min_us=0.0, max_events=100_000)
    joined = load(out)
    first = next(e for e in body(trace) if e["ph"] == "X")
    ts = [
        next(e for e in joined["traceEvents"] if e["pid"] == pid and e["ph"] == "X")["ts"]
        for pid in (1, 2)
    ]
    assert abs(ts[0] - ts[1]) < 0.002 and first["name"]
    assert all(v < 1.0 for v in spread.values()) and spread
    counts = joined["rayProfiler"]["ranks"]
    assert [c["clock_offset_us"] for c in counts] == [0.0, 90_000_000.0]


def test_clock_shifts_are_the_offsets_a_collectives_reply_applied():
    from coordinator.ops.timeline import clock_shifts

    reply = {
        "ranks": [
            {"rank": 0, "clock_offset_us": 0.0, "clock_corrected": False},
            {"rank": 1, "clock_offset_us": 250.0, "clock_corrected": False},  # same node, jitter
            {"rank": 2, "clock_offset_us": -4_200.5, "clock_corrected": True},
        ]
    }
    assert clock_shifts(reply) == {2: -4_200.5}
    assert clock_shifts({}) == {}


def partial_overlaps(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The pairs of spans where one starts inside the other and ends after it (what Perfetto
    drops on one track), checked pair by pair."""
    return [(a, b) for a in spans for b in spans if a[0] < b[0] < a[1] < b[1]]


def test_spans_that_nest_all_stay_on_lane_0():
    from coordinator.core.timeline import overlap_lanes

    nested = [(0, 100), (0, 100), (10, 40), (10, 20), (20, 40), (40, 40), (60, 100), (100, 120)]
    assert overlap_lanes(nested) == [0] * len(nested)
    assert overlap_lanes([]) == []


def test_an_attached_job_s_steps_and_optimizer_steps_get_two_lanes():
    # The optimizer hook ends ProfilerStep#3 and begins #4 inside Optimizer.step: the steps
    # on lane 0, the optimizer's steps on lane 1; an op goes with its innermost container
    # (the optimizer's before #4 began, then #4's).
    from coordinator.core.timeline import overlap_lanes

    spans = [(0, 100), (10, 50), (80, 130), (85, 95), (100, 200), (110, 125), (150, 160),
             (180, 230), (185, 190), (200, 300)]  # fmt: skip
    assert overlap_lanes(spans) == [0, 0, 1, 1, 0, 0, 0, 1, 1, 0]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 30)), max_size=40))
def test_every_lane_nests_and_lanes_are_added_only_when_needed(raw):
    from coordinator.core.timeline import overlap_lanes

    spans = [(s, s + d) for s, d in raw]
    lanes = overlap_lanes(spans)
    assert len(lanes) == len(spans) and lanes == overlap_lanes(list(spans))  # deterministic
    for lane in set(lanes):
        on_it = [s for s, k in zip(spans, lanes, strict=True) if k == lane]
        assert not partial_overlaps(on_it), (lane, on_it)
    if not partial_overlaps(spans):
        assert set(lanes) <= {0}
    # A new lane only when every lane below it was busy with a span its first span (the
    # earliest, the longest first) could not nest in.
    assert sorted(set(lanes)) == list(range(len(set(lanes))))
    for lane in set(lanes) - {0}:
        first = min((i for i, k in enumerate(lanes) if k == lane),
                    key=lambda i: (spans[i][0], -spans[i][1], i))  # fmt: skip
        start, end = spans[first]
        assert all(
            any(a[0] <= start < a[1] and not (a[0] <= start and end <= a[1])
                for a, k in zip(spans, lanes, strict=True) if k == below)
            for below in range(lane)
        ), (lane, spans)  # fmt: skip


def test_a_rank_s_overlapping_events_are_a_lane_of_their_thread_named_for_it():
    from coordinator.core.timeline import rank_process

    def x(name: str, ts: float, dur: float, tid: int = 7) -> dict:
        return {"ph": "X", "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur}

    trace = {"traceEvents": [
        {"ph": "M", "name": "thread_name", "pid": 7, "tid": 7, "args": {"name": "main"}},
        x("ProfilerStep#3", 0.0, 100.0), x("aten::mm", 10.0, 40.0),
        x("Optimizer.step#SGD.step", 80.0, 50.0), x("aten::add_", 85.0, 10.0),
        x("ProfilerStep#4", 100.0, 100.0), x("aten::mm", 150.0, 10.0),
        x("worker", 0.0, 500.0, tid=8),
        {"ph": "i", "name": "[memory]", "pid": 7, "tid": 7, "ts": 90.0, "s": "t"}]}  # fmt: skip
    events, count, steps = rank_process(trace, label(0), pid=3, origin=0.0)
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    order = {e["tid"]: e["args"]["sort_index"] for e in events if e["name"] == "thread_sort_index"}
    track = {e["name"] + str(e["ts"]): e["tid"] for e in events if e["ph"] != "M"}
    assert names[track["Optimizer.step#SGD.step80.0"]] == "main · lane 2"
    assert track["aten::add_85.0"] == track["Optimizer.step#SGD.step80.0"]
    lane0 = {track[k] for k in ("ProfilerStep#30.0", "aten::mm10.0", "ProfilerStep#4100.0",
                                "aten::mm150.0", "[memory]90.0")}  # fmt: skip
    assert lane0 == {1} and names[1] == "main" and names[track["worker0.0"]] == "thread 8"
    # the lane right after its thread; every event kept, on process 3
    assert sorted(names, key=order.__getitem__) == [1, track["aten::add_85.0"], track["worker0.0"]]
    assert count["kept"] == 8 and {e["pid"] for e in events} == {3} and steps == {3: 0.0, 4: 100.0}


def test_a_flow_event_goes_to_the_lane_of_the_slice_it_binds_to():
    # kineto's ac2g arrow starts at a cudaLaunchKernel inside Optimizer.step, which crosses
    # ProfilerStep#3 and so moves to lane 2: its 's' must move too, or Perfetto binds it to
    # ProfilerStep#3 (or to nothing); an arrow outside the moved slice stays on lane 0
    from coordinator.core.timeline import rank_process

    def x(name: str, ts: float, dur: float, tid: int = 7) -> dict:
        return {"ph": "X", "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur}

    def flow(ph: str, ts: float, id_: int, tid: int = 7) -> dict:
        return {"ph": ph, "id": id_, "pid": 7, "tid": tid, "ts": ts, "cat": "ac2g",
                "name": "ac2g", "bp": "e"}  # fmt: skip

    trace = {"traceEvents": [
        x("ProfilerStep#3", 0.0, 100.0), x("cudaLaunchKernel", 10.0, 5.0),
        x("Optimizer.step#Adam.step", 80.0, 50.0), x("cudaLaunchKernel", 85.0, 5.0),
        x("ProfilerStep#4", 100.0, 100.0), x("aten::add_", 120.0, 8.0),
        x("gemm", 20.0, 8.0, tid=9), x("gemm", 95.0, 8.0, tid=9),
        flow("s", 10.0, 1), flow("f", 20.0, 1, tid=9),
        flow("s", 85.0, 2), flow("f", 95.0, 2, tid=9),
        flow("s", 90.0, 3), flow("t", 125.0, 3)]}  # fmt: skip
    events, _, _ = rank_process(trace, label(0), pid=3, origin=0.0)
    track = {(e["name"], e["ph"], e["ts"]): e["tid"] for e in events if e["ph"] != "M"}
    moved = track[("Optimizer.step#Adam.step", "X", 80.0)]
    assert moved != track[("ProfilerStep#3", "X", 0.0)]  # the slice went to a lane
    assert track[("ac2g", "s", 85.0)] == track[("cudaLaunchKernel", "X", 85.0)] == moved
    assert track[("ac2g", "s", 90.0)] == moved  # at the launch's end, still in the step
    # past ProfilerStep#4's start (inside the optimizer's step) with the op there
    assert track[("ac2g", "t", 125.0)] == track[("aten::add_", "X", 120.0)] != moved
    assert track[("ac2g", "s", 10.0)] == track[("ProfilerStep#3", "X", 0.0)]
    assert track[("ac2g", "f", 20.0)] == track[("ac2g", "f", 95.0)] == track[("gemm", "X", 20.0)]
