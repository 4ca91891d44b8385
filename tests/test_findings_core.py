"""The findings' rules (issue 57) on hand-built window figures: each fires with the right rank
and a cost matching the figures, and stays quiet without the fault; overlaps are not counted
twice; the config's ``advise`` is checked."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.core.config import ProfilerConfig
from coordinator.core.findings import RULES, checked_advise, window_findings

STEP_MS = 100.0
STEPS = [10, 11, 12, 13]


def _rank(step_ms: float = STEP_MS, compute_ms: float = 240.0) -> dict[str, Any]:
    return {
        "step_ms": step_ms,
        "step_ratio": step_ms / STEP_MS,
        "compute_ms": compute_ms,
        "compute_ratio": compute_ms / 240.0,
        "comm_ms": 0.0,
        "comm_share": 0.0,
        "flagged": False,
        "launch_bound": [],
    }


def _row(comm_ms: float = 4.0, other_ms: float = 10.0, overlap_ms: float = 0.0) -> dict[str, float]:
    """One rank's breakdown of a 4-step window of 100 ms steps, in the aggregate's keys."""
    window = 4 * STEP_MS * 1e3
    compute = window - comm_ms * 4e3 - other_ms * 4e3
    row = {"compute_us": compute, "comm_us": comm_ms * 4e3, "memcpy_us": 0.0}
    row["other_us"] = other_ms * 4e3
    row["window_us"] = window
    row.update({f"{k}_share": row[f"{k}_us"] / window for k in ("compute", "comm", "memcpy")})
    row["other_share"] = row["other_us"] / window
    row["overlap_us"] = overlap_ms * 4e3
    return row


def table(ranks: int = 4, device: str = "cpu") -> dict[str, Any]:
    """A quiet window: every rank alike, 4% communication, no collective waits."""
    return {
        "window": 3,
        "steps": list(STEPS),
        "ranks": list(range(ranks)),
        "device": device,
        "stragglers": {
            "threshold": 1.25,
            "median_step_ms": STEP_MS,
            "median_compute_ms": 240.0,
            "ranks": {r: _rank() for r in range(ranks)},
            "flagged": [],
            "launch_bound": [],
            "last_arriver": None,
        },
        "breakdown": {"ranks": {r: _row() for r in range(ranks)}, "mean": {}},
        "launch": {},
        "device_steps": {},
        "memory": None,
    }


def rules(t: dict[str, Any], coll: Any = None, settings: Any = None) -> dict[str, Any]:
    found, quiet = window_findings(t, coll, settings)
    assert sorted([f["rule"] for f in found] + quiet) == sorted(RULES)
    return {f["rule"]: f for f in found}


def _arriver(rank: int = 1, wait_ms: float = 30.0, ranks: int = 4) -> dict[str, Any]:
    return {
        "rank": rank,
        "arrived_last": 8,
        "collectives": 8,
        "waiting_ranks": [r for r in range(ranks) if r != rank],
        "wait_ms_per_step": wait_ms,
        "reason": "arrives last",
        "agrees": False,
        "note": None,
    }


def test_a_quiet_window_has_no_finding() -> None:
    assert rules(table()) == {}
    assert rules(table(device="cuda")) == {}


def test_collective_wait_names_the_late_rank_and_the_others_wait() -> None:
    t = table()
    t["stragglers"]["last_arriver"] = _arriver(rank=1, wait_ms=30.0)
    for r in (0, 2, 3):  # the waiting ranks' comm holds their wait: 4 + 30 ms a step
        t["breakdown"]["ranks"][r] = _row(comm_ms=34.0)
    f = rules(t)["collective_wait"]
    assert f["ranks"] == [1] and not f["all_ranks"]
    assert f["cost_ms_per_step"] == 30.0
    assert f["evidence"]["waiting_ranks"] == [0, 2, 3]
    assert f["where"] == {"window": 3, "page": "#/window/3"}
    assert "Rank 1" in f["advice"] and "num_workers" in f["advice"]
    assert "exposed_comm" not in rules(t)  # the wait is not also exposed communication


def test_collective_wait_is_quiet_under_its_share() -> None:
    t = table()
    t["stragglers"]["last_arriver"] = _arriver(wait_ms=1.0)  # 1% of the step
    assert rules(t) == {}
    assert "collective_wait" in rules(t, settings={"collective_wait": {"min_share": 0.005}})


def test_collective_wait_prefers_the_collectives_reply() -> None:
    t = table()
    coll = {
        "last_arriver": _arriver(rank=2, wait_ms=12.0),
        "ranks": [
            {"rank": r, "wait_us_per_step": {"10": 12e3, "11": 12e3} if r != 2 else {}}
            for r in range(4)
        ],
    }
    f = rules(t, coll)["collective_wait"]
    assert f["ranks"] == [2] and f["cost_ms_per_step"] == 12.0


def test_straggler_costs_its_step_over_the_median() -> None:
    t = table()
    t["stragglers"]["ranks"][3] = _rank(step_ms=140.0, compute_ms=400.0)
    f = rules(t)["straggler"]
    assert f["ranks"] == [3]
    assert f["cost_ms_per_step"] == pytest.approx(max(40.0, (400 - 240) / 4))
    assert f["evidence"]["median_step_ms"] == STEP_MS


def test_a_table_s_first_and_last_step_count_every_step_between() -> None:
    """``kernel_summary()`` gives a window's steps as its first and last: a compute straggler
    costs the same as when every step is listed (its excess over the steps it spans)."""
    listed = table()
    slow = _rank(compute_ms=400.0)
    slow["step_ms"] = slow["step_ratio"] = None  # (its compute is over the median, not its step)
    listed["stragglers"]["ranks"][3] = slow
    spanned = {**listed, "steps": [STEPS[0], STEPS[-1]]}
    want = (400.0 - 240.0) / len(STEPS)
    assert rules(listed)["straggler"]["cost_ms_per_step"] == pytest.approx(want)
    assert rules(spanned)["straggler"]["cost_ms_per_step"] == pytest.approx(want)


def test_straggler_is_quiet_under_the_ratio() -> None:
    t = table()
    t["stragglers"]["ranks"][3] = _rank(step_ms=110.0, compute_ms=264.0)  # 1.1x
    assert rules(t) == {}


def test_a_late_straggler_is_not_counted_twice() -> None:
    t = table()
    t["stragglers"]["ranks"][1] = _rank(step_ms=100.0, compute_ms=360.0)  # 30 ms a step more
    t["stragglers"]["last_arriver"] = _arriver(rank=1, wait_ms=30.0)
    found = rules(t)
    assert found["collective_wait"]["cost_ms_per_step"] == 30.0
    assert "straggler" not in found  # its excess is the others' wait: reported once


def test_a_rank_that_computes_longer_but_meets_the_others_in_step_is_no_straggler() -> None:
    """Ranks that meet in collectives: a compute excess whose step is no longer than the
    others' costs the step only through their wait (collective_wait's, here under its bound:
    the rank did not arrive last at most collectives); without collectives it is the cost."""
    t = table()
    t["stragglers"]["ranks"][1] = _rank(step_ms=100.0, compute_ms=360.0)  # 1.5x its compute
    assert rules(t)["straggler"]["cost_ms_per_step"] == 30.0  # no collectives: its excess
    synced = rules(t, {"matched": 8, "ranks": [], "last_arriver": None})
    assert "straggler" not in synced, synced
    t["stragglers"]["ranks"][1] = _rank(step_ms=140.0, compute_ms=360.0)  # its step longer too
    synced = rules(t, {"matched": 8, "ranks": [], "last_arriver": None})
    assert synced["straggler"]["cost_ms_per_step"] == 40.0


def test_exposed_comm_on_cpu_over_ten_percent() -> None:
    t = table()
    for r in range(4):
        t["breakdown"]["ranks"][r] = _row(comm_ms=20.0)
    f = rules(t)["exposed_comm"]
    assert f["all_ranks"] and f["ranks"] == [0, 1, 2, 3]
    assert f["cost_ms_per_step"] == pytest.approx(20.0)
    assert "no_sync" in f["advice"]
    t["breakdown"]["ranks"] = {r: _row(comm_ms=8.0) for r in range(4)}  # 8%: under 10%
    assert "exposed_comm" not in rules(t)


def test_exposed_comm_on_cuda_is_comm_minus_overlap_over_five_percent() -> None:
    t = table(device="cuda")
    t["breakdown"]["ranks"] = {r: _row(comm_ms=30.0, overlap_ms=24.0) for r in range(4)}
    t["breakdown"]["ranks"][2] = _row(comm_ms=30.0, overlap_ms=20.0)  # 10 ms exposed
    f = rules(t)["exposed_comm"]
    assert f["ranks"] == [0, 1, 2, 3]
    assert f["evidence"]["ms_per_step"] == {0: 6.0, 1: 6.0, 2: 10.0, 3: 6.0}
    assert f["cost_ms_per_step"] == pytest.approx(7.0)
    t["breakdown"]["ranks"] = {r: _row(comm_ms=30.0, overlap_ms=27.0) for r in range(4)}
    assert "exposed_comm" not in rules(t)  # 3% exposed


def test_launch_bound_costs_the_idle_of_its_steps() -> None:
    t = table(device="cuda")
    t["launch"] = {
        r: {"kernels": 900, "delay_p50_us": 8.0, "delay_p95_us": 20.0, "short_share": 0.2,
            "launch_bound": []}
        for r in range(4)
    }  # fmt: skip
    t["device_steps"] = {r: [[s, 90e3, 100e3] for s in STEPS] for r in range(4)}
    t["launch"][0] = {**t["launch"][0], "short_share": 0.8, "launch_bound": [11, 12]}
    t["device_steps"][0] = [[10, 90e3, 100e3], [11, 30e3, 100e3], [12, 30e3, 100e3], [13, 9e4, 1e5]]
    found = rules(t)
    f = found["launch_bound"]
    assert f["ranks"] == [0]
    assert f["cost_ms_per_step"] == pytest.approx((70 + 70) / 4)
    assert f["evidence"]["launch_bound_steps"] == {0: [11, 12]}
    assert "gpu_idle" not in found  # rank 0's idle is its launch-bound steps': counted once
    t["launch"][0]["launch_bound"] = []
    assert rules(t) == {}


def test_gpu_idle_over_fifteen_percent() -> None:
    t = table(device="cuda")
    t["breakdown"]["ranks"][1] = _row(other_ms=40.0)
    f = rules(t)["gpu_idle"]
    assert f["ranks"] == [1] and f["cost_ms_per_step"] == pytest.approx(40.0)
    assert rules(table(device="cpu") | {"breakdown": t["breakdown"]}) == {}  # CPU: no device


def test_memory_peak_over_ninety_percent_of_a_known_device() -> None:
    t = table(device="cuda")
    t["memory"] = {"peak_bytes": {0: 30 * 2**30, 1: 75 * 2**30, 2: 30 * 2**30, 3: 30 * 2**30}}
    assert rules(t) == {}  # the device's memory is not known: quiet
    f = rules(t, settings={"memory_peak": {"device_gib": 80}})["memory_peak"]
    assert f["ranks"] == [1] and f["cost_ms_per_step"] == 0.0
    assert f["evidence"]["share"] == {1: round(75 / 80, 4)}
    assert rules(t, settings={"memory_peak": {"device_gib": 80, "share": 0.95}}) == {}


def test_findings_come_costliest_first() -> None:
    t = table()
    t["stragglers"]["last_arriver"] = _arriver(rank=1, wait_ms=10.0)
    t["stragglers"]["ranks"][3] = _rank(step_ms=150.0)
    found, _ = window_findings(t)
    assert [f["rule"] for f in found] == ["straggler", "collective_wait"]
    assert [f["cost_ms_per_step"] for f in found] == [50.0, 10.0]


def test_advise_config_is_checked() -> None:
    cfg = ProfilerConfig.from_dict({"advise": {"exposed_comm": {"share_cpu": 0.2}}})
    assert cfg.advise == {"exposed_comm": {"share_cpu": 0.2}}
    assert ProfilerConfig.from_dict({}).advise == {}
    assert checked_advise({}) == {}
    bad = [
        (None, "'advise' must be a mapping"),
        ({"colective_wait": {}}, "unknown key 'advise.colective_wait'; did you mean"),
        ({"straggler": None}, "'advise.straggler' must be a mapping of thresholds"),
        ({"straggler": {"ration": 2}}, "'advise.straggler.ration'; did you mean 'ratio'"),
        ({"straggler": {"ratio": None}}, "'advise.straggler.ratio' must be a finite number"),
        ({"straggler": {"ratio": True}}, "must be a finite number, got bool"),
        ({"straggler": {"ratio": float("nan")}}, "must be a finite number"),
        ({"straggler": {"ratio": 0.5}}, "'advise.straggler.ratio' must be in 1..100, got 0.5"),
        ({"gpu_idle": {"share": "high"}}, "must be a finite number, got str"),
    ]
    for value, message in bad:
        with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
            ProfilerConfig.from_dict({"advise": value})


def test_every_threshold_says_where_it_came_from() -> None:
    for rule in RULES.values():
        for t in rule.thresholds.values():
            assert t.source and t.low <= t.default <= t.high


def test_a_finding_over_many_ranks_lists_its_costliest_in_its_evidence() -> None:
    from coordinator.core.findings import EVIDENCE_RANKS

    t = table(ranks=100)
    for r in range(100):  # every rank over 10%, rank r's comm 20 + r/10 ms
        t["breakdown"]["ranks"][r] = _row(comm_ms=20.0 + r / 10)
    f = rules(t)["exposed_comm"]
    assert f["ranks"] == list(range(100)) and f["all_ranks"]  # every rank named
    ev = f["evidence"]
    assert list(ev["ms_per_step"]) == list(range(100 - EVIDENCE_RANKS, 100))  # the costliest
    assert list(ev["share_of_step"]) == list(ev["ms_per_step"])
    assert ev["ranks_in_evidence"] == f"the {EVIDENCE_RANKS} costliest of 100"
    assert f["cost_ms_per_step"] == pytest.approx(20.0 + 4.95)  # the mean over all 100


def test_host_sync_costs_at_most_the_device_idle_and_gpu_idle_takes_it_off() -> None:
    t = table(device="cuda")
    t["breakdown"]["ranks"][1] = _row(other_ms=40.0)  # 40 ms of device idle a step
    gpu = {"syncs": 4, "sync_causes": [["aten::item", 0.0, 4]], "pageable_us": 0.0,
           "pageable_copies": 0, "fp32_gemm_us": 0.0, "tf32_gemm_us": 0.0}  # fmt: skip
    t["gpu"] = {1: gpu | {"sync_wait_us": 90_000.0}, 2: gpu | {"sync_wait_us": 6_000.0}}
    found = rules(t)
    f = found["host_sync"]  # rank 1 waits 90 ms while its device runs: 40 ms at most are lost
    assert f["ranks"] == [1, 2] and f["evidence"]["wait_ms"] == {1: 90.0, 2: 6.0}
    assert f["evidence"]["ms_per_step"] == {1: pytest.approx(40.0), 2: pytest.approx(6.0)}
    assert "gpu_idle" not in found  # its 40 ms idle counted once, by host_sync
    t["gpu"][1]["sync_wait_us"] = 10_000.0  # a shorter wait: the rest of the idle is gpu_idle's
    found = rules(t)
    assert found["gpu_idle"]["cost_ms_per_step"] == pytest.approx(30.0)
