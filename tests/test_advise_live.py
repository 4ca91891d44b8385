"""Findings on a real run (issue 57): two reference SFT ranks in one gloo group, real
torch.profiler, the node agent's summaries, the coordinator's ``advise()``; one rank sleeps a
known time before each step's gradient all-reduce: ``collective_wait`` names it, costing the
delay within 30%, and the same run without the sleep names no wait near it."""

from __future__ import annotations

import pytest

from tests.late_window import late_window

pytestmark = pytest.mark.ray

LATE_S = 0.08


@pytest.fixture(scope="module")
def late_pair(ray_session):
    from tests.ray_workers import LatePolicyWorker, gloo_pair

    with gloo_pair(ray_session, LatePolicyWorker) as workers:
        yield workers


def advise_window(ray, workers, tmp_path, late: dict[int, float]) -> dict:
    """The coordinator's ``advise()`` of one late window (``tests/late_window.py``)."""
    return late_window(ray, workers, tmp_path, late, lambda c, _: ray.get(c.advise.remote()))


def test_collective_wait_names_the_sleeping_rank_at_its_delay(ray_session, late_pair, tmp_path):
    reply = advise_window(ray_session, late_pair, tmp_path, late={1: LATE_S})
    assert reply["window"] == 0 and reply["trainer_id"] == "sft", reply
    found = {f["rule"]: f for f in reply["findings"]}
    f = found["collective_wait"]
    assert f["ranks"] == [1] and f["evidence"]["waiting_ranks"] == [0], f
    assert f["cost_ms_per_step"] == pytest.approx(LATE_S * 1e3, rel=0.3), f
    assert f["where"] == {"window": 0, "page": "#/window/0"}
    # the wait is counted once: not again as rank 0's exposed communication
    assert 0 not in found.get("exposed_comm", {"ranks": []})["ranks"], found
    costs = [x["cost_ms_per_step"] for x in reply["findings"]]
    assert costs == sorted(costs, reverse=True)


def test_without_the_sleep_no_wait_is_named_near_the_delay(ray_session, late_pair, tmp_path):
    reply = advise_window(ray_session, late_pair, tmp_path, late={})
    assert reply["window"] == 0, reply
    for f in reply["findings"]:  # (2 busy cores: a descheduled rank is a real, small wait)
        assert f["rule"] != "collective_wait" or f["cost_ms_per_step"] < 0.5 * LATE_S * 1e3, f
