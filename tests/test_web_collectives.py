"""The window page's Collectives section and the notebook's collectives frames, on a real gloo
job: three Ray actors in one gloo group all_reduce each step, rank 1 sleeping before it. Rank 1
arrives last; the page names it (live and from the run's record) and so do the frames."""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def _live_and_recorded(coord, record):
    """The web server of the live coordinator and that of the run's record."""
    from coordinator.ops.recorded import RecordedCoordinator, open_record
    from coordinator.ops.web.record_link import RecordLink
    from coordinator.ops.web.server import CoordinatorLink

    live = ServerThread(CoordinatorLink("unused", "profiler-tests", coord))
    recorded = ServerThread(RecordLink(RecordedCoordinator(open_record(record))))
    try:
        yield live, recorded
    finally:
        live.close()
        recorded.close()


def _same_answer(servers, path):
    """``path``'s answer, the same from every server of ``servers`` (200)."""
    answers = [web.http("GET", path) for web in servers]
    assert all(a == answers[0] for a in answers) and answers[0][0] == 200, answers
    return answers[0][1]


def _window_pages(servers):
    """A signed-in page on window 0 of each server in turn, in headless Chromium; none may
    raise a script error."""
    with chromium_browser() as browser:
        for web in servers:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
            sign_in(page, web.url, TOKEN)
            page.goto(web.url + "/#/window/0")
            yield web, page
            assert errors == [], errors
            page.close()


@pytest.mark.subprocess
def test_the_window_page_names_the_rank_that_arrives_last_live_and_from_the_record(gloo_run):
    coord, reply, record = gloo_run
    last = {r["rank"]: r["arrived_last"] for r in reply["ranks"]}
    assert reply["matched"] >= STEPS - 1 and max(last, key=last.get) == LATE_RANK, reply
    with _live_and_recorded(coord, record) as (live, recorded):
        c = _same_answer((live, recorded), "/api/windows/0/collectives")
        assert c["ranks"] == reply["ranks"] and c["window"] == 0
        assert live.http("GET", "/api/windows/0/collectives?shown=x")[0] == 400
        assert live.http("GET", "/api/windows/9/collectives")[0] == 404
        for _, page in _window_pages((live, recorded)):
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


def _waits_for_the_late_rank(findings):
    return [f for f in findings if f["rule"] == "collective_wait" and f["ranks"] == [LATE_RANK]]


@pytest.mark.subprocess
def test_the_findings_name_the_rank_that_arrives_last_live_and_from_the_record(gloo_run):
    coord, _, record = gloo_run
    with _live_and_recorded(coord, record) as (live, recorded):
        a = _same_answer((live, recorded), "/api/windows/0/advise")
        found = a["findings"]
        assert a["window"] == 0 and _waits_for_the_late_rank(found), found
        costs = [f["cost_ms_per_step"] for f in found]
        assert costs == sorted(costs, reverse=True)
        for web in (live, recorded):
            assert web.http("GET", "/api/windows/0/advise?role=a%20b")[0] == 400
            assert web.http("GET", "/api/windows/0/advise?trainer_id=" + "x" * 200)[0] == 400
            assert web.http("GET", "/api/windows/9/advise")[0] == 404
        for web, page in _window_pages((live, recorded)):
            wait_js(page, "document.getElementById('findings')?.$findings !== undefined", 30)
            drawn = page.evaluate("document.getElementById('findings').$findings")
            assert [(f["rule"], f["ranks"]) for f in drawn] == [
                (f["rule"], f["ranks"]) for f in found
            ], drawn
            rows = page.locator("#findings tbody tr").all_inner_texts()
            assert len(rows) == len(found) and "no finding" not in page.inner_text("#findings")
            row = next(r for r in rows if "collective_wait" in r)
            assert f"\t{LATE_RANK}\t" in row and "waiting_ranks=[0, 2]" in row, row
            headings = page.locator("h2").all_inner_texts()
            assert headings.index("Findings") < headings.index("Collectives")
            page.goto(web.url + "/")
            wait_js(page, "document.getElementById('latest-findings')?.$findings", 30)
            panel = page.evaluate("document.getElementById('latest-findings').$findings")
            assert _waits_for_the_late_rank(panel) and len(panel) == min(3, len(found)), panel
            assert "collective_wait" in page.inner_text("#latest-findings")
            page.click("#latest-findings-link")
            page.wait_for_function("location.hash === '#/window/0'")


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
