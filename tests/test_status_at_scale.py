"""``status()`` of a large run: counts by state, the ranks not ok, cut window lists; the whole
per-rank list on request (``status(ranks="all")``, ``ranks(offset, limit, state)``)."""

import json
import uuid

import pytest

from coordinator import get_or_create_coordinator
from coordinator.ops.tables import render_ranks, render_status
from tests.configs import profiler_config
from tests.node_sim import PlainRank

N = 300  # over the 256 ranks up to which status() lists every rank


@pytest.fixture(scope="module")
def big_run(ray_session, tmp_path_factory):
    ray = ray_session
    Rank = ray.remote(num_cpus=0)(PlainRank)
    many, faulty = Rank.remote("node-a", "no-agent"), Rank.remote("node-a", "no-agent")
    ray.get(faulty.inject.remote(1, "raise"))
    workers = [faulty if r == 7 else many for r in range(N)]
    cfg = profiler_config(
        tmp_path_factory.mktemp("big"), wait=0, warmup=1, active=2, repeat=1, fanout="direct"
    )
    coord = get_or_create_coordinator(cfg, name=f"big-{uuid.uuid4().hex[:6]}")
    ray.get(coord.register.remote("t", workers))
    ray.get(coord.start.remote("t", 0))
    for k in range(3):
        ray.get(coord.step.remote("t", k))
    yield ray, coord
    for h in (coord, many, faulty):
        ray.kill(h)


def test_status_of_a_large_run_counts_ranks_and_lists_the_ones_not_ok(big_run):
    ray, coord = big_run
    st = ray.get(coord.status.remote())
    assert st["ranks_complete"] is False
    assert st["rank_counts"] == {"ok": N - 1, "disabled": 1}
    assert [(r["rank"], r["state"]) for r in st["ranks"]] == [(7, "disabled")]
    (w,) = st["windows"]
    assert w["complete"] is False and w["rank_count"] == N - 1
    assert w["ranks"] == [r for r in range(N) if r != 7][:64]
    assert len(json.dumps(st)) < 64 * 1024
    text = render_status(st)
    assert f"ranks: 1 disabled, {N - 1} ok; listed: the 1 not ok" in text
    assert f"{N - 1} ranks" in text


def test_every_rank_on_request_and_by_page(big_run):
    ray, coord = big_run
    full = ray.get(coord.status.remote(ranks="all"))
    assert full["ranks_complete"] is True and len(full["ranks"]) == N
    assert full["windows"][0]["complete"] is True and len(full["windows"][0]["ranks"]) == N - 1
    page = ray.get(coord.ranks.remote(offset=5, limit=4, state="ok"))
    assert page["total"] == N - 1 and [r["rank"] for r in page["ranks"]] == [5, 6, 8, 9]
    assert ray.get(coord.ranks.remote(state="disabled"))["ranks"][0]["rank"] == 7
    assert render_ranks(page).startswith(f"ranks 5-9 of {N - 1}")
    for bad, match in [
        ({"limit": 0}, "limit must be an int in 1..10000"),
        ({"offset": -1}, "offset must be an int >= 0"),
        ({"state": "sleepy"}, "state must be one of ok, disabled"),
        ({"trainer_id": "../x"}, "trainer"),
    ]:
        with pytest.raises(ValueError, match=match):
            ray.get(coord.ranks.remote(**bad))
    with pytest.raises(ValueError, match="ranks must be 'summary' or 'all'"):
        ray.get(coord.status.remote(ranks="every"))
