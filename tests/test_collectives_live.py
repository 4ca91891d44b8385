"""Collectives across ranks on a real run (issue 56): reference SFT ranks in one gloo group,
real torch.profiler, the node agent's reader, the coordinator's ``collectives()``; one rank
sleeps a known time before its step's gradient all-reduce: it is the last to arrive there, and
the other rank's wait equals the delay."""

from __future__ import annotations

from statistics import median

import pytest

from coordinator.ops.timeline import merge_window
from tests.late_window import ACTIVE, late_window

pytestmark = pytest.mark.ray

LATE_S = 0.08


@pytest.fixture(scope="module")
def late_pair(ray_session):
    from tests.ray_workers import LatePolicyWorker, gloo_pair

    with gloo_pair(ray_session, LatePolicyWorker) as workers:
        yield workers


def run_window(ray, workers, tmp_path, late: dict[int, float]) -> dict:
    """One late window (``tests/late_window.py``): the coordinator's ``collectives()``,
    ``kernel_summary()``, ``status()`` and the merged timeline once the window settled."""

    def read(coordinator, status):
        return {
            "merged": merge_window(coordinator, 0, str(tmp_path / "w0.json")),
            "status": status,
            "collectives": ray.get(coordinator.collectives.remote()),
            "summary": ray.get(coordinator.kernel_summary.remote(top_k=0)),
        }

    return late_window(ray, workers, tmp_path, late, read)


def test_the_rank_that_sleeps_before_the_all_reduce_is_last_and_the_other_waits_its_delay(
    ray_session, late_pair, tmp_path
):
    out = run_window(ray_session, late_pair, tmp_path, late={1: LATE_S})
    c = out["collectives"]
    assert c["window"] == 0 and c["ranks_recorded"] == 2, c
    reduces = [m for m in c["collectives"] if m["name"] == "all_reduce" and m["step"] is not None]
    assert len(reduces) == ACTIVE, c
    for m in reduces:
        assert m["group"] == "0" and m["ranks"] == [0, 1] and m["last_rank"] == 1, m
        assert m["wait_us"]["1"] == 0.0 and m["wait_us"]["0"] > 0.5 * LATE_S * 1e6, (m, reduces)
        assert m["bytes"] > 0 and m["transfer_us"] > 0
    # (the median: on 2 busy cores a rank's process is sometimes descheduled for tens of ms)
    wait = median(m["wait_us"]["0"] for m in reduces)
    assert abs(wait - LATE_S * 1e6) < 0.2 * LATE_S * 1e6, reduces
    ranks = {r["rank"]: r for r in c["ranks"]}
    assert ranks[1]["arrived_last"] >= ACTIVE and ranks[0]["arrived_last"] == 0, ranks
    # the share of rank 0's step spent waiting: the delay over its step (which holds it)
    step_ms = out["summary"]["stragglers"]["ranks"][0]["step_ms"]
    assert ranks[0]["wait_share"] == pytest.approx(
        sum(m["wait_us"]["0"] for m in reduces) / ACTIVE / 1e3 / step_ms, rel=0.05
    ), (ranks, step_ms)
    assert 0.2 < ranks[0]["wait_share"] < 1.0 and ranks[1]["wait_share"] < 0.1, ranks
    assert not ranks[1]["clock_corrected"] and abs(ranks[1]["clock_offset_us"]) < 5_000, ranks
    assert not [p for p in c["problems"] if "rank" in p and "lacks" in p], c["problems"]
    # named in stragglers, with the reason, beside the compute-time table (which cannot see a
    # sleep: the two disagree, and the note says why)
    last = out["summary"]["stragglers"]["last_arriver"]
    assert last is not None and last["rank"] == 1 and last["waiting_ranks"] == [0], last
    assert f"arrives last at {last['arrived_last']} of" in last["reason"], last
    assert 0.8 * LATE_S * 1e3 < last["wait_ms_per_step"] < 1.2 * LATE_S * 1e3, last
    assert last["agrees"] == (1 in out["summary"]["stragglers"]["flagged"]), last
    assert last["agrees"] or "no rank's compute time" in last["note"], last
    assert c["last_arriver"]["rank"] == 1
    entry = out["status"]["windows"][0]
    assert entry["last_arriver"].startswith("rank 1 arrives last at"), entry
    # one node, one clock: the merged timeline asked the collectives and shifted no rank
    assert [(c["rank"], c["clock_offset_us"]) for c in out["merged"]["ranks"]] == [(0, 0), (1, 0)]


def test_without_a_late_rank_no_wait_is_near_the_delay(ray_session, late_pair, tmp_path):
    out = run_window(ray_session, late_pair, tmp_path, late={})
    c = out["collectives"]
    reduces = [m for m in c["collectives"] if m["name"] == "all_reduce" and m["step"] is not None]
    assert len(reduces) == ACTIVE, c
    assert median(max(m["wait_us"].values()) for m in reduces) < 0.5 * LATE_S * 1e6, reduces
    # (two ranks on 2 busy cores: one of them is last at each all-reduce, and a descheduled
    # process can make the other wait; named or not, it is never for a wait like the delay)
    last = out["summary"]["stragglers"]["last_arriver"]
    assert last is None or last["wait_ms_per_step"] < 0.5 * LATE_S * 1e3, last
