"""The window page's Collectives section and the notebook's collectives frames, on a real gloo
job: three Ray actors in one gloo group all_reduce each step, rank 1 sleeping before it. Rank 1
arrives last; the page names it (live and from the run's record) and so do the frames."""

from __future__ import annotations

import time
import uuid

import pytest
import torch
import torch.distributed as dist

from coordinator import get_or_create_coordinator
from coordinator.ops import notebook as nb
from tests.configs import profiler_config
from tests.test_web import TOKEN, ServerThread, chromium_browser, sign_in, wait_js
from trainers.reference.workers import PolicyWorker, make_policy_group

LATE_RANK, DELAY_S, RANKS, STEPS = 1, 0.03, 3, 4


class GlooRank(PolicyWorker):
    """A reference policy rank whose step is one all_reduce, ``late`` sleeping before it."""

    def gloo_step(self, late: int, delay_s: float) -> float:
        if self.rank == late:
            time.sleep(delay_s)
        t = torch.ones(4096)
        dist.all_reduce(t)
        return float(t[0])


@pytest.fixture(scope="module")
def gloo_run(ray_session, tmp_path_factory):
    """The coordinator of a finished gloo run (window 0: steps 1-3), its ``collectives()``
    reply, and its record's directory."""
    from coordinator.client.step_client import wait_for_traces

    ray = ray_session
    cfg = profiler_config(tmp_path_factory.mktemp("gloo"), wait=0, warmup=1, active=STEPS - 1,
                          repeat=1, record_shapes=True)  # fmt: skip
    coord = get_or_create_coordinator(
        cfg, name=f"p-{uuid.uuid4().hex[:8]}", namespace="profiler-tests"
    )
    workers = make_policy_group(RANKS, worker_cls=GlooRank)
    try:
        ray.get(coord.register.remote("t", workers))
        ray.get(coord.start.remote("t", 0))
        for k in range(STEPS):
            assert ray.get([w.gloo_step.remote(LATE_RANK, DELAY_S) for w in workers]) == [3.0] * 3
            ray.get(coord.step.remote("t", k))
        ray.get(coord.stop.remote("t"))
        assert wait_for_traces(coord, timeout_s=60) == []
        reply = ray.get(coord.collectives.remote(window=0))
        entry = ray.get(coord.flush_record.remote(30.0))
        assert entry["error"] is None and entry["windows"] == 1, entry
        yield coord, reply, entry["dir"]
    finally:
        ray.kill(coord)
        for w in workers:
            ray.kill(w)


@pytest.mark.subprocess
def test_the_window_page_names_the_rank_that_arrives_last_live_and_from_the_record(gloo_run):
    from coordinator.ops.recorded import RecordedCoordinator, open_record
    from coordinator.ops.web.record_link import RecordLink
    from coordinator.ops.web.server import CoordinatorLink

    coord, reply, record = gloo_run
    last = {r["rank"]: r["arrived_last"] for r in reply["ranks"]}
    assert reply["matched"] >= STEPS - 1 and max(last, key=last.get) == LATE_RANK, reply
    live = ServerThread(CoordinatorLink("unused", "profiler-tests", coord))
    recorded = ServerThread(RecordLink(RecordedCoordinator(open_record(record))))
    try:
        answers = [web.http("GET", "/api/windows/0/collectives") for web in (live, recorded)]
        assert answers[0] == answers[1] and answers[0][0] == 200
        assert answers[0][1]["ranks"] == reply["ranks"] and answers[0][1]["window"] == 0
        assert live.http("GET", "/api/windows/0/collectives?shown=x")[0] == 400
        assert live.http("GET", "/api/windows/9/collectives")[0] == 404
        with chromium_browser() as browser:
            for web in (live, recorded):
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                errors: list[str] = []
                page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
                sign_in(page, web.url, TOKEN)
                page.goto(web.url + "/#/window/0")
                wait_js(page, "document.getElementById('collectives')?.$arrivals !== undefined", 30)
                drawn = page.evaluate("document.getElementById('collectives').$arrivals")
                assert drawn["last"] and set(drawn["last"]) == {LATE_RANK}, drawn
                assert drawn["skew_us"] == sorted(drawn["skew_us"], reverse=True)
                flagged = page.locator("#collectives-ranks tr.flagged td").first.inner_text()
                assert flagged == str(LATE_RANK)
                lead = page.inner_text("#collectives-lead")
                assert f"rank {LATE_RANK} arrives last" in lead, lead
                said = page.inner_text("#straggler-arriver")  # beside the compute stragglers
                assert said.startswith(f"collectives: rank {LATE_RANK} arrives last at"), said
                assert errors == []
                page.close()
    finally:
        live.close()
        recorded.close()


def test_the_collectives_frames_name_the_late_rank_and_its_waiters(ray_session, gloo_run):
    coord, reply, _ = gloo_run
    ranks = nb.collectives_frame(reply)
    assert list(ranks.index) == list(range(RANKS))
    assert ranks["arrived_last"].idxmax() == LATE_RANK
    assert ranks.attrs["window"] == 0 and ranks.attrs["matched"] == reply["matched"]
    matched = nb.matched_collectives_frame(reply)
    assert len(matched) == reply["shown"] and (matched["last_rank"] == LATE_RANK).any()
    late = matched[matched["last_rank"] == LATE_RANK]
    for rank in (0, 2):  # the others wait about the delay, rank 1 not at all
        assert late[f"wait_us_{rank}"].median() == pytest.approx(DELAY_S * 1e6, rel=0.3)
    assert (late[f"wait_us_{LATE_RANK}"] == 0).all()
    strag = nb.stragglers_frame(ray_session.get(coord.kernel_summary.remote(window=0, top_k=0)))
    assert strag.attrs["last_arriver"]["rank"] == LATE_RANK, strag.attrs
