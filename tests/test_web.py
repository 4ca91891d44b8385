"""The web view: its pure checks, its JSON API on a live coordinator with finished windows, the
pages in a real headless Chromium, and ``ray-profiler serve`` as a user starts it."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from typing import Any

import pytest

from coordinator import get_or_create_coordinator
from coordinator.ops.web import auth
from coordinator.ops.web.params import BadRequest, capture_args, diff_args, kernels_args
from tests.configs import ROOT, profiler_config
from tests.s3_server import free_port

TOKEN = "test-token-" + uuid.uuid4().hex
HOSTS = auth.allowed_hosts("127.0.0.1", 8270)


# ------------------------------------------------------------------ pure


def test_the_pages_shells_are_open_and_changes_always_need_the_bearer_token():
    ok = "127.0.0.1:8270"
    assert auth.is_open("/") and auth.is_open("/static/app.js") and auth.is_open("/perfetto/x")
    assert not auth.is_open("/api/status") and not auth.is_open("/api/windows/0/traces.tar.gz")
    assert auth.check("GET", ok, None, None, TOKEN, HOSTS, True) is None
    # on loopback too, a read of the run's data needs the token (issue 53)
    assert auth.check("GET", ok, None, None, TOKEN, HOSTS, False).status == 401
    assert auth.check("GET", ok, f"Bearer {TOKEN}", None, TOKEN, HOSTS, False) is None
    no = auth.check("POST", ok, None, None, TOKEN, HOSTS, True)
    assert no is not None and no.status == 401 and "Bearer" in no.reason
    wrong = auth.check("POST", ok, "Bearer nope", None, TOKEN, HOSTS, True)
    assert wrong is not None and wrong.status == 403
    assert auth.check("DELETE", ok, f"Bearer {TOKEN}", None, TOKEN, HOSTS, True) is None
    # a cookie never authorises a change (another site could make a browser send it)
    assert auth.check("POST", ok, None, TOKEN, TOKEN, HOSTS, True).status == 401
    # DNS rebinding: a Host that does not name this server
    assert auth.check("GET", "evil.example:8270", None, None, TOKEN, HOSTS, True).status == 403
    assert auth.check("GET", None, None, None, TOKEN, HOSTS, True).status == 403
    assert auth.check("GET", "localhost:8270", None, None, TOKEN, HOSTS, True) is None


def test_on_another_address_every_read_needs_the_token_in_the_header_or_the_cookie():
    hosts = auth.allowed_hosts("10.1.2.3", 8270)
    assert not auth.is_loopback("10.1.2.3") and auth.is_loopback("::1")
    host = "10.1.2.3:8270"
    assert auth.check("GET", host, None, None, TOKEN, hosts, False).status == 401
    assert auth.check("GET", host, f"Bearer {TOKEN}", None, TOKEN, hosts, False) is None
    assert auth.check("GET", host, None, auth.cookie_value(TOKEN), TOKEN, hosts, False) is None
    assert auth.check("GET", host, None, TOKEN, TOKEN, hosts, False).status == 401
    # a cookie of another token: sign in again (401, which the page follows to /login)
    assert auth.check("GET", host, None, "x", TOKEN, hosts, False).status == 401
    assert auth.check("GET", host, "Bearer x", None, TOKEN, hosts, False).status == 403
    assert auth.check("GET", "127.0.0.1:8270", None, TOKEN, TOKEN, hosts, False).status == 403
    assert auth.bearer("Basic abc") is None and auth.bearer("bearer  t ") == "t"


def test_api_inputs_are_checked_naming_the_parameter():
    assert kernels_args({"top_k": "5", "per_rank": "true", "role": "rollout"}) == {
        "top_k": 5,
        "trainer_id": None,
        "role": "rollout",
        "per_rank": True,
        "run": None,
        "by": "kernel",
    }
    assert kernels_args({"by": "op"})["by"] == "op"
    for query, message in [
        ({"top_k": "x"}, "top_k must be an int"),
        ({"top_k": "-1"}, "top_k must be an int in 0..100000"),
        ({"per_rank": "maybe"}, "per_rank must be true or false"),
        ({"role": "r" * 200}, "role is longer than 128"),
        ({"by": "layer"}, "by must be one of kernel, op"),
    ]:
        with pytest.raises(BadRequest, match=message):
            kernels_args(query)
    with pytest.raises(BadRequest, match="a is required"):
        diff_args({"b": "1"})
    assert capture_args(b'{"active": 2}') == {"active": 2, "ranks": None, "start_step": None}
    for body, message in [
        (b"{", "not JSON"),
        (b"[1]", "must be a JSON object"),
        (b'{"actve": 2}', r"unknown fields \['actve'\]"),
        (b"{}", "active is required"),
        (b'{"active": "2"}', "active must be an int"),
        (b'{"active": 2, "ranks": [0, "1"]}', "ranks must be a list of ints"),
        (b" " * 70_000, "over 65536 bytes"),
    ]:
        with pytest.raises(BadRequest, match=message):
            capture_args(body)


# ------------------------------------------------------- a live coordinator


class Served:
    """A coordinator with two closed windows (the second doing 8x the work), the phase times
    of every step (``train`` and ``log`` regions, timed by the trainer's own clock), a trainer
    that is still running but stopped stepping (a stall, with every rank's stack), and the web
    server on a free loopback port (in a thread)."""

    def __init__(self, ray, tmp_path, workers):
        from coordinator.client.phase_clock import PhaseClock, Region
        from coordinator.client.step_client import wait_for_traces
        from coordinator.ops.web.server import CoordinatorLink

        # (Two toy ranks on a busy 2-core host can differ 1.7x by chance, and wait for a CPU:
        # a straggler or host_contention finding would be true of the window but not of the
        # code; their rules are tested elsewhere.)
        quiet = {"straggler": {"ratio": 100.0}, "host_contention": {"min_share": 1.0}}
        cfg = profiler_config(tmp_path, wait=1, warmup=1, active=2, repeat=2, stall_min_s=2.0,
                              advise=quiet)  # fmt: skip
        self.name = f"profiler-{uuid.uuid4().hex[:8]}"
        self.coord = get_or_create_coordinator(cfg, name=self.name, namespace="profiler-tests")
        ray.get(self.coord.register.remote("t", workers))
        ray.get(self.coord.start.remote("t", 0))
        clock = PhaseClock()
        self.phases = []
        for k in range(8):  # windows 0 (steps 2-3) and 1 (6-7); the run goes on
            clock.begin_step()
            with Region(clock, "train"):
                ray.get([w.train_step.remote(8 if k >= 4 else 1) for w in workers])
            with Region(clock, "log"):
                time.sleep(0.01)
            self.phases.append(clock.close_step(k))
            ray.get(self.coord.step.remote("t", k, phases=[self.phases[-1]]))
        assert wait_for_traces(self.coord, timeout_s=60) == []
        deadline = time.monotonic() + 60  # no step for stall_min_s: the watchdog's stall
        while not ray.get(self.coord.status.remote())["stalls"]:
            assert time.monotonic() < deadline, "no stall recorded"
            time.sleep(0.2)
        self.web = ServerThread(CoordinatorLink(self.name, "profiler-tests", self.coord))
        self.url = self.web.url

    def close(self, ray):
        self.web.close()
        ray.get(self.coord.stop.remote("t"))
        ray.kill(self.coord)

    def http(self, method, path, body=None, token=None, headers=None):
        return self.web.http(method, path, body, token, headers)


class ServerThread:
    """The web server of ``link`` on a free loopback port, in a thread with its own loop."""

    def __init__(self, link):
        from coordinator.ops.web.server import WebServer

        self.port = free_port()
        self.server = WebServer(link, TOKEN, "127.0.0.1", self.port)
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(30), "the web server did not start"

    def _run(self, ready):
        from aiohttp import web

        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(self.server.app(), access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        self.loop.run_until_complete(site.start())
        ready.set()
        self.loop.run_forever()

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)

    def http(self, method, path, body=None, token=None, headers=None):
        """(status, parsed JSON or raw bytes) of one request; a read sends the token unless
        ``token`` is "" (every read of the run's data needs it, on loopback too)."""
        hdrs = dict(headers or {})
        if token is None and method in ("GET", "HEAD"):
            token = TOKEN
        if token:
            hdrs["Authorization"] = f"Bearer {token}"
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                raw, status, kind = r.read(), r.status, r.headers.get("Content-Type", "")
        except urllib.error.HTTPError as exc:
            raw, status, kind = exc.read(), exc.code, exc.headers.get("Content-Type", "")
        return status, json.loads(raw) if "json" in kind else raw


@pytest.fixture(scope="module")
def served(ray_session, tmp_path_factory, worker_pool):
    workers = worker_pool.take(2)
    s = Served(ray_session, tmp_path_factory.mktemp("web"), workers)
    yield s
    s.close(ray_session)
    worker_pool.give_back(workers)


def test_every_endpoint_answers_with_the_replies_shapes(served):
    status, st = served.http("GET", "/api/status")
    assert status == 200 and [w["index"] for w in st["windows"]] == [0, 1]
    assert st["config"]["storage_options"] == {}  # (redacted when it holds any)
    status, ks = served.http("GET", "/api/windows/1/kernels?top_k=5&per_rank=true")
    assert status == 200 and ks["window"] == 1 and len(ks["kernels"]) == 5
    assert set(ks["per_rank"][ks["kernels"][0]["name"]]) == {"0", "1"}
    status, ops = served.http("GET", "/api/windows/1/kernels?top_k=5&by=op")
    assert status == 200 and ops["by"] == "op"  # a CPU window: the op table is the kernel table
    assert [k["name"] for k in ops["kernels"]] == [k["name"] for k in ks["kernels"]]
    assert ops["ops"][ops["kernels"][0]["name"]]["cpu_us"] == ops["kernels"][0]["total_us"]
    status, strag = served.http("GET", "/api/windows/0/stragglers")
    assert status == 200 and strag["window"] == 0 and set(strag["ranks"]) == {"0", "1"}
    status, d = served.http("GET", "/api/diff?a=0&b=1&top_k=3")
    assert status == 200 and d["a"]["window"] == 0 and len(d["kernels"]) == 3
    status, c = served.http("GET", "/api/windows/1/collectives")  # toy ranks: no collective
    assert status == 200 and c["window"] == 1 and c["matched"] == 0 and c["ranks_without"] == [0, 1]
    status, ph = served.http("GET", "/api/phases?last=5")
    assert status == 200 and ph["steps_seen"] == 8
    assert [s["step"] for s in ph["steps"]] == [3, 4, 5, 6, 7]  # the last five
    sent = {k: (wall, regions) for k, wall, regions in served.phases}
    for s in ph["steps"]:  # what the trainer's clock measured, in ms
        wall, regions = sent[s["step"]]
        assert s["wall_ms"] == pytest.approx(wall * 1e3, abs=0.01)
        assert s["regions"] == pytest.approx({n: v * 1e3 for n, v in regions.items()}, abs=0.01)
        assert s["regions"]["log"] >= 10.0 and s["other_ms"] >= 0.0
    means = {r["region"]: r["mean_ms"] for r in ph["regions"]}
    assert set(means) == {"train", "log"}
    last5 = [sent[k][1]["train"] * 1e3 for k in range(3, 8)]
    assert means["train"] == pytest.approx(sum(last5) / 5, rel=1e-3)
    status, st = served.http("GET", "/api/status")
    (stall,) = st["stalls"]
    assert stall["trainer_id"] == "t" and stall["last_step"] == 7 and stall["resumed_step"] is None
    assert stall["lines"], stall  # every rank's stack, grouped
    status, raw = served.http("GET", "/api/windows/1/traces.tar.gz")
    assert status == 200
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:gz") as tar:
        names = sorted(n for n in tar.getnames() if n.endswith(".json"))
    assert names == [f"window_0001_policy/rank{r}.pt.trace.json" for r in (0, 1)]
    status, raw = served.http("GET", "/api/windows/1/timeline.json.gz?min_us=1")
    assert status == 200
    merged = json.loads(gzip.decompress(raw))
    names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"]
             if e["name"] == "process_name"}  # fmt: skip
    assert [n.split(" · ")[:2] for _, n in sorted(names.items())] == [
        ["rank 0", "policy"], ["rank 1", "policy"]]  # fmt: skip
    assert merged["rayProfiler"]["min_us"] == 1 and set(
        merged["rayProfiler"]["step_start_spread_us"]
    ) == {"6", "7"}
    status, raw = served.http("GET", "/api/windows/1/timeline.json.gz?ranks=1&role=policy")
    assert status == 200
    assert [r["rank"] for r in json.loads(gzip.decompress(raw))["rayProfiler"]["ranks"]] == [1]
    status, page = served.http("GET", "/")
    assert status == 200 and b"/static/app.js" in page
    status, js = served.http("GET", "/static/vendor/chart.umd.min.js")
    assert status == 200 and len(js) > 100_000  # served from the package, no CDN


def test_bad_input_gets_a_json_reason_and_the_right_status(served):
    status, body = served.http("GET", "/api/windows/9/kernels")
    assert status == 404 and body["error"].startswith("no window 9")
    assert served.http("GET", "/api/windows/x/kernels")[0] == 400
    assert served.http("GET", "/api/windows/1/kernels?top_k=-3")[0] == 400
    assert served.http("GET", "/api/diff?a=0")[0] == 400
    # one limit for the steps of /api/phases: the coordinator's (it keeps 10,000 exactly)
    assert served.http("GET", "/api/phases?last=10000")[0] == 200
    status, none = served.http("GET", "/api/phases?last=0")
    assert status == 200 and none["steps"] == [] and none["steps_seen"] == 8
    status, body = served.http("GET", "/api/phases?last=10001")
    assert status == 400 and body["error"] == "last must be an int in 0..10000, got 10001"
    assert served.http("GET", "/api/windows/1/kernels?role=nobody")[0] == 400
    status, body = served.http("GET", "/api/windows/1/collectives?shown=10001")
    assert status == 400 and body["error"] == "shown must be an int in 0..10000, got 10001"
    assert served.http("GET", "/api/windows/9/collectives")[0] == 404
    status, body = served.http("GET", "/api/windows/9/timeline.json.gz")
    assert status == 404 and "no closed window 9" in body["error"]
    status, body = served.http("GET", "/api/windows/1/timeline.json.gz?ranks=5")
    assert status == 404 and "has no rank 5" in body["error"]
    status, body = served.http("GET", "/api/windows/1/timeline.json.gz?role=nobody")
    assert status == 404 and "no role 'nobody'" in body["error"]
    for query, message in [
        ("ranks=0,x", "ranks must be ranks separated by commas"),
        ("min_us=-1", "min_us must be a number"),
        ("min_us=nan", "min_us must be a number"),
        ("max_events=0", "max_events must be an int"),
        ("ranks=" + ",".join(map(str, range(300))), "ranks lists 300 ranks; at most 256"),
    ]:
        status, body = served.http("GET", f"/api/windows/1/timeline.json.gz?{query}")
        assert status == 400 and message in body["error"], (query, body)
    assert served.http("GET", "/api/nothing")[0] == 404
    assert served.http("GET", "/static/../server.py")[0] == 404
    assert served.http("POST", "/api/captures", b"{", token=TOKEN)[0] == 400
    status, body = served.http("POST", "/api/captures", b'{"active": 1, "x": 2}', token=TOKEN)
    assert status == 400 and "unknown fields" in body["error"]
    status, body = served.http("POST", "/api/captures", b"[" * 100_000, token=TOKEN)
    assert status == 413 and body["error"]
    # no token, a wrong one, a foreign Host: refused before the coordinator is asked
    assert served.http("POST", "/api/captures", {"active": 1})[0] == 401
    assert served.http("POST", "/api/captures", {"active": 1}, token="nope")[0] == 403
    assert served.http("DELETE", "/api/captures/5")[0] == 401
    assert served.http("GET", "/api/status", headers={"Host": "evil.example"})[0] == 403
    status, body = served.http("GET", "/api/status")
    assert TOKEN not in json.dumps(body)


def test_a_timeline_of_more_ranks_than_the_server_merges_is_413_with_the_limit(served, monkeypatch):
    from coordinator.ops.web import server

    monkeypatch.setattr(server, "TIMELINE_RANKS", 1)  # the window has 2
    status, body = served.http("GET", "/api/windows/1/timeline.json.gz")
    assert status == 413 and "has 2 ranks to merge; at most 1" in body["error"]
    assert served.http("GET", "/api/windows/1/timeline.json.gz?ranks=0")[0] == 200


def test_captures_are_answered_refused_with_their_reason_and_cancelled(served):
    status, ok = served.http(
        "POST", "/api/captures", {"active": 2, "start_step": 100_000}, token=TOKEN
    )
    assert status == 200 and ok["accepted"] and ok["steps"] == [100_000, 100_001]
    status, clash = served.http(
        "POST", "/api/captures", {"active": 1, "start_step": 100_001}, token=TOKEN
    )
    assert status == 409 and not clash["accepted"] and "overlap" in clash["reason"]
    status, gone = served.http("DELETE", f"/api/captures/{ok['window']}", token=TOKEN)
    assert status == 200 and gone["cancelled"]
    status, again = served.http("DELETE", f"/api/captures/{ok['window']}", token=TOKEN)
    assert status == 409 and "no pending capture" in again["reason"]


def test_an_unreachable_coordinator_is_503_and_found_again_when_it_is_back(ray_session, tmp_path):
    from coordinator.ops.web.server import CoordinatorLink

    name = f"profiler-{uuid.uuid4().hex[:8]}"
    web = ServerThread(CoordinatorLink(name, "profiler-tests"))
    try:
        status, body = web.http("GET", "/api/status")
        assert status == 503 and f"the coordinator {name!r} cannot be reached" in body["error"]
        assert web.http("GET", "/api/windows/0/kernels")[0] == 503
        cfg = profiler_config(tmp_path)
        coord = get_or_create_coordinator(cfg, name=name, namespace="profiler-tests")
        try:
            status, st = web.http("GET", "/api/status")  # looked up again: no restart needed
            assert status == 200 and st["name"] == name
        finally:
            ray_session.kill(coord)
    finally:
        web.close()


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "Debian's chromium is missing: `make test` installs it (apt-get install chromium)"
    return path


@contextlib.contextmanager
def chromium_browser():
    """Debian's headless Chromium, driven by Playwright; closed on the way out."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


def sign_in(page, url: str, token: str = TOKEN) -> None:
    """Sign ``page``'s context in through the address ``serve`` prints: the token in its
    fragment (never sent to the server), posted by the sign-in page, kept as a cookie."""
    page.goto(f"{url}/login#token={token}")
    page.wait_for_url(url + "/", timeout=30_000)
    assert "token" not in page.url


def screenshot(page, tmp_path, name: str) -> None:
    """A full-page screenshot in ``tmp_path``; also in ``$RAY_PROFILER_DOCS_IMG`` when set
    (``docs/img/screenshot.py`` remakes the docs' images from these real runs)."""
    page.screenshot(path=str(tmp_path / name), full_page=True)
    assert (tmp_path / name).stat().st_size > 20_000
    if os.environ.get("RAY_PROFILER_DOCS_IMG"):
        shutil.copy(tmp_path / name, os.path.join(os.environ["RAY_PROFILER_DOCS_IMG"], name))


def wait_js(page, expression: str, timeout_s: float) -> None:
    """Until ``expression`` is true in the page. (Playwright's ``wait_for_function`` polls with
    ``eval``, which the pages' security policy refuses.)"""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"not true in {timeout_s} s: {expression}"
        time.sleep(0.1)


def test_the_pages_in_a_real_browser(served, tmp_path):
    with chromium_browser() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 2200})
        sign_in(page, served.url)
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        # the run page lists the windows, and refreshes by itself
        page.goto(served.url + "/")
        page.wait_for_selector("a[href='#/window/1']", timeout=30_000)
        page.wait_for_function("document.getElementById('live').textContent.includes('step 7')")
        # the window page: the kernel table and the charts
        page.goto(served.url + "/#/window/1")
        page.wait_for_selector("text=aten::addmm", timeout=30_000)
        page.wait_for_selector("text=Rank x top kernel")
        assert page.locator("canvas").count() == 5  # spread, heat map, breakdown, steps, strip
        page.wait_for_selector("#collectives-none", timeout=30_000)  # one line, no chart
        assert page.inner_text("#collectives-none") == (
            "no collectives in this window: none of its 2 ranks' traces had one"
        )
        page.screenshot(path=str(tmp_path / "window.png"), full_page=True)
        assert (tmp_path / "window.png").stat().st_size > 20_000
        # the op table's route (a CPU window: the op table is the kernel table)
        page.click("#by-op")
        page.wait_for_function("location.hash.endsWith('/policy/op')")
        page.wait_for_selector("text=aten::addmm", timeout=30_000)
        # (the old page's text can still be there while the new one mounts its charts)
        page.locator("canvas").nth(4).wait_for(state="attached", timeout=30_000)
        assert page.locator("canvas").count() == 5
        # captures: refused without the token, accepted with it, then cancelled
        page.goto(served.url + "/#/captures")
        page.fill("input[name=start_step]", "200000")
        page.fill("input[name=token]", "")
        page.click("button[type=submit]")
        page.wait_for_selector("#capture-answer.error")
        assert "refused (401)" in page.inner_text("#capture-answer")
        page.fill("input[name=token]", TOKEN)
        page.click("button[type=submit]")
        page.wait_for_selector("#capture-answer.ok")
        answer = page.inner_text("#capture-answer")
        assert "accepted: window" in answer and "steps 200000-200001" in answer
        page.click("button[id^=cancel-]")
        page.wait_for_selector("text=cancelled")
        # the diff page
        page.goto(served.url + "/#/diff/0/1")
        page.wait_for_selector("text=against window 0", timeout=30_000)
        assert page.locator("canvas").count() >= 1
        page.screenshot(path=str(tmp_path / "diff.png"), full_page=True)
        # the phase times of the last steps: both regions, in the table and the chart
        page.goto(served.url + "/#/phases")
        page.wait_for_selector("text=Phase times: the last 8 steps (8 seen)", timeout=30_000)
        rows = page.locator("table tr").all_inner_texts()
        assert any(r.startswith("train") for r in rows) and any(r.startswith("log") for r in rows)
        assert page.locator("canvas").count() == 1
        # the stall: the run page points to it, the stalls page shows its stacks
        page.goto(served.url + "/")
        page.click("a[href='#/stalls']", timeout=30_000)
        page.wait_for_selector("text=Stall 1: trainer t, after step 7, still stalled")
        stall = served.http("GET", "/api/status")[1]["stalls"][0]
        assert page.inner_text("pre").splitlines()[0] == stall["lines"][0]
        # marks are per role: a window whose rollout alone was marked names the rollout,
        # and the policy's part (its window page) shows none
        window = two_role_window_marked_on_rollout()
        js = "w => [marksText(w), regressionText(w.roles.t.regression)]"
        texts = page.evaluate(js, window)
        assert texts[0].startswith("rollout: SLOWER than windows 0-7 (8): aten::mm x1.5"), texts
        assert texts[1] == "" and "policy" not in texts[0]
    # the capture refused without a token is the one error the page is expected to log
    assert [e for e in errors if "401" not in e] == [], errors


@pytest.mark.subprocess
def test_the_run_page_fits_a_1280_pixel_screen_and_links_each_window_s_timeline(served):
    with chromium_browser() as browser:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        sign_in(page, served.url)
        page.goto(served.url + "/")
        page.wait_for_selector("a[href='#/window/1']", timeout=30_000)
        # An RL run's windows on object storage: a long URL per window, two roles each
        # with marks. Long paths and role lists are folded: nothing runs off the edge.
        st = served.http("GET", "/api/status")[1]
        marked = two_role_window_marked_on_rollout()["roles"]["gen"]["regression"]
        for w in st["windows"]:
            w["trace_dir"] = (
                "s3://a_training_bucket/team_post_training/profiles/llama3_70b_instruct_"
                "grpo_math_reasoning_v2/experiment_20261203/"
                f"run_20261203_101010/window_{w['index']:04d}_steps_6-7"
            )
            policy = next(iter(w["roles"].values()))
            w["roles"]["rollout"] = dict(policy, role="rollout-vllm-engine", regression=marked)
        js = """st => { const m = document.querySelector("main"); m.replaceChildren();
            runPage(m, st); const where = m.querySelector("td.where");
            const link = m.querySelector("a.timeline");
            return [document.documentElement.scrollWidth, where?.title ?? "",
                    where?.textContent ?? "", link?.getAttribute("href")]; }"""
        width, title, shown, href = page.evaluate(js, st)
        assert width <= 1280, width
        assert title.endswith("window_0001_steps_6-7") and len(shown) < len(title)
        assert href == "/api/windows/1/timeline.json.gz"
        page.goto(served.url + "/#/window/1")
        page.wait_for_selector("a.timeline", timeout=30_000)
        assert page.locator("a.timeline").get_attribute("href") == (
            "/api/windows/1/timeline.json.gz"
        )
        assert page.evaluate("document.documentElement.scrollWidth") <= 1280


def test_ray_profiler_serve_as_a_user_starts_it(served, ray_session):
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address,
        "RAY_PROFILER_TOKEN": "",
    }
    env.pop("RAY_PROFILER_TOKEN")
    cmd = [sys.executable, "-m", "coordinator", "--name", served.name, "--namespace"]
    cmd += ["profiler-tests", "serve", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        token_line = proc.stdout.readline()
        assert first.startswith(f"ray-profiler serve: http://127.0.0.1:{port}/"), first
        token = token_line.strip().rsplit(" ", 1)[-1]
        assert len(token) >= 32
        sign_in_line = proc.stdout.readline()  # the token in a fragment: never sent in a request
        assert sign_in_line.strip() == f"sign in: http://127.0.0.1:{port}/login#token={token}"
        url = f"http://127.0.0.1:{port}/api/status"
        st = _when_up(url, proc, {"Authorization": f"Bearer {token}"})
        assert st["name"] == served.name and len(st["windows"]) == 2
        assert _open(url)[0] == 401  # on loopback too, a read of the run needs the token
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/api/captures", data=b'{"active": 1}', method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=30)
        assert refused.value.code == 401
    finally:
        proc.terminate()
        proc.wait(30)


def two_role_window_marked_on_rollout() -> dict:
    """A window entry's ``roles`` (what the marks read of it) where only the rollout's
    ``aten::mm`` was marked, as the pure core marks it."""
    from coordinator.core.marks import _profile, confirm, judge

    ref = [_profile(i, {"aten::mm": 300.0, "aten::add": 700.0}, 1.0) for i in range(8)]
    a, b = (
        judge(
            _profile(i, {"aten::mm": 450.0, "aten::add": 700.0}, 1.1),
            ref,
            threshold=1.25,
            baseline=0,
            run="r",
            trainer_id="gen",
        )  # fmt: skip
        for i in (8, 9)
    )
    confirm(a, b)
    calm = judge(ref[0], ref, threshold=1.25, baseline=0, run="r", trainer_id="t")
    return {
        "regression": calm,
        "roles": {
            "t": {"role": "policy", "regression": calm},
            "gen": {"role": "rollout", "regression": b},
        },
    }


def tar_files(blob: bytes) -> dict[str, bytes]:
    """A ``.tar.gz``'s files by name (gzipped traces decompressed: their headers hold times)."""
    out = {}
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        for m in tar.getmembers():
            if m.isfile():
                data = tar.extractfile(m).read()
                out[m.name] = gzip.decompress(data) if m.name.endswith(".gz") else data
    return out


def _when_up(url: str, proc: subprocess.Popen, headers: dict | None = None) -> Any:
    """The JSON of a GET of ``url`` once the server ``proc`` answers (60 s at most)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            req = urllib.request.Request(url, headers=headers or {})
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise AssertionError(f"the server did not answer {url}") from None
            time.sleep(0.3)


def _serve_record(record: str) -> tuple[subprocess.Popen, str, str]:
    """``ray-profiler serve --from RECORD`` in a process of its own whose Ray address leads
    nowhere (the cluster is gone): its URL once it answers, and the token it printed."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT, "RAY_ADDRESS": "127.0.0.1:1"}
    env.pop(auth.TOKEN_ENV, None)
    cmd = [sys.executable, "-m", "coordinator", "serve", "--from", record, "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    proc.stdout.readline()
    token = proc.stdout.readline().strip().rsplit(" ", 1)[-1]
    _when_up(url + "/api/viewer", proc, {"Authorization": f"Bearer {token}"})
    return proc, url, token


@pytest.mark.subprocess
def test_a_finished_run_s_window_opens_in_perfetto_with_no_cluster(served, tmp_path):
    import ray

    entry = ray.get(served.coord.flush_record.remote(30.0))
    proc, url, token = _serve_record(entry["dir"])
    try:
        status, _, viewer, _ = _open(url + "/api/viewer", {"Authorization": f"Bearer {token}"})
        assert status == 200 and json.loads(viewer)["perfetto"] == "/perfetto/"
        with chromium_browser() as browser:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            sign_in(page, url, token)
            page.goto(url + "/")
            page.wait_for_selector("a[href='#/window/1']", timeout=30_000)
            row = page.locator("tr", has=page.locator("a[href='#/window/1']"))
            href = row.locator("a.perfetto").get_attribute("href")
            assert _decoded_target(href) == url + "/api/windows/1/timeline.json.gz"
            page.goto(url + href)  # merged by the server from the files in save_path
            for r in (0, 1):
                page.get_by_text(f"rank {r} · policy").first.wait_for(timeout=120_000)
            page.wait_for_timeout(1_000)
            screenshot(page, tmp_path, "perfetto-record.png")
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_trace_missing_from_save_path_is_named_and_the_others_served(served, tmp_path):
    import ray

    from coordinator.ops.collect import collect_window
    from coordinator.ops.recorded import RecordedCoordinator, open_record
    from coordinator.ops.web.record_link import RecordLink
    from coordinator.ops.web.server import MISSING_HEADER
    from tests.test_run_record import cli_no_cluster

    entry = ray.get(served.coord.flush_record.remote(30.0))
    h = RecordedCoordinator(open_record(entry["dir"]))
    trace = h.rec.run.state.windows[1].traces[("t", 1)]
    gone = [p for p in {trace["path"], trace["local_path"]} if p and os.path.exists(p)]
    assert gone, trace
    for p in gone:  # (put back below: the other tests read them)
        os.rename(p, p + ".away")
    web = ServerThread(RecordLink(h))
    try:
        res = collect_window(h, 1, str(tmp_path / "w1"))
        assert sorted(res["files"]) == [0] and list(res["missing"]) == [1]
        assert "not in save_path" in res["missing"][1] and gone[0] in res["missing"][1]
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        req = urllib.request.Request(web.url + "/api/windows/1/traces.tar.gz", headers=bearer)
        with urllib.request.urlopen(req, timeout=120) as r:
            files, said = tar_files(r.read()), json.loads(r.headers[MISSING_HEADER])
        assert list(said) == ["window 1 rank 1"] and "not in save_path" in said["window 1 rank 1"]
        assert len(files) == 2 and b"window 1 rank 1: its trace is not in" in next(
            v for k, v in files.items() if k.endswith("MISSING.txt")
        )
        req = urllib.request.Request(web.url + "/api/windows/1/timeline.json.gz", headers=bearer)
        with urllib.request.urlopen(req, timeout=120) as r:
            merged, said = (
                json.loads(gzip.decompress(r.read())),
                json.loads(r.headers[MISSING_HEADER]),
            )
        assert [x["rank"] for x in merged["rayProfiler"]["ranks"]] == [0]
        assert list(said) == ["window 1 policy 1"]
        got = cli_no_cluster("summarise", entry["dir"], "--window", "1")
        assert got.returncode == 1 and "1 trace(s): rank 0" in got.stdout, got.stderr
        assert "window 1 rank 1: its trace is not in save_path" in got.stderr
    finally:
        web.close()
        for p in gone:
            os.rename(p + ".away", p)


def _open(url: str, headers: dict | None = None):
    """(status, headers, body) of a GET, without following a redirect's answer's errors."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, r.read(), r.url
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read(), url


def test_perfetto_is_served_from_the_extra_under_its_own_policy(served):
    import hashlib

    status, viewer = served.http("GET", "/api/viewer")
    assert status == 200 and viewer == {
        "perfetto": "/perfetto/",
        "install": None,
        "read_only": None,
    }
    status, headers, body, where = _open(served.url + "/perfetto")
    assert status == 200 and where.endswith("/perfetto/")  # redirected to the UI's folder
    assert headers["Content-Type"].startswith("text/html") and b"Perfetto UI" in body
    policy = dict(p.strip().split(" ", 1) for p in headers["Content-Security-Policy"].split(";"))
    loader = body.split(b'<script type="text/javascript">')[1].split(b"</script>")[0]
    digest = base64.b64encode(hashlib.sha256(loader).digest()).decode()
    assert policy["script-src"].split() == [
        "'self'", "'wasm-unsafe-eval'", f"'sha256-{digest}'"]  # fmt: skip
    assert policy["default-src"] == "'self'" and policy["object-src"] == "'none'"
    assert "http" not in policy["connect-src"] and "*" not in headers["Content-Security-Policy"]
    version = json.loads(body.split(b"data-perfetto_version='")[1].split(b"'")[0])["stable"]
    status, headers, wasm, _ = _open(f"{served.url}/perfetto/{version}/trace_processor.wasm")
    assert status == 200 and headers["Content-Type"] == "application/wasm"
    assert wasm[:4] == b"\0asm"
    for bad in ("nothing.js", ".hidden", f"{version}/../../../server.py", "%2e%2e/server.py"):
        assert _open(f"{served.url}/perfetto/{bad}")[0] == 404, bad
    # the same rules as the rest: a foreign Host is refused
    assert _open(served.url + "/perfetto/", {"Host": "evil.example"})[0] == 403
    # where the extra is not installed: 404 saying how to install it, and the pages know
    saved, served.web.server.perfetto = served.web.server.perfetto, None
    try:
        status, body = served.http("GET", "/perfetto/")
        assert status == 404 and "pip install 'ray-profiler[perfetto]'" in body["error"]
        status, viewer = served.http("GET", "/api/viewer")
        assert viewer["perfetto"] is None and "ray-profiler[perfetto]" in viewer["install"]
    finally:
        served.web.server.perfetto = saved


def _decoded_target(href: str) -> str:
    """The trace URL a ``/perfetto/#!/?url=...`` link opens."""
    assert href.startswith("/perfetto/#!/?url="), href
    return urllib.parse.unquote(href.split("?url=", 1)[1])


@pytest.mark.subprocess
def test_the_served_perfetto_shows_one_process_per_rank_of_a_real_window(served, tmp_path):
    with chromium_browser() as browser:
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        outside: list[tuple[str, str]] = []  # (url, what became of it): nothing may load
        context.on("response", lambda r: outside.append((r.url, str(r.status)))
                   if not r.url.startswith(served.url) else None)  # fmt: skip
        context.on("requestfailed", lambda r: outside.append((r.url, r.failure or ""))
                   if not r.url.startswith(served.url) else None)  # fmt: skip
        page = context.new_page()
        sign_in(page, served.url)
        page.goto(served.url + "/")
        page.wait_for_selector("a[href='#/window/1']", timeout=30_000)
        row = page.locator("tr", has=page.locator("a[href='#/window/1']"))
        href = row.locator("a.perfetto").get_attribute("href")
        assert _decoded_target(href) == served.url + "/api/windows/1/timeline.json.gz"
        page.goto(served.url + href)  # the real two-rank window, merged by the server
        for r in (0, 1):
            page.get_by_text(f"rank {r} · policy").first.wait_for(timeout=120_000)
        page.wait_for_timeout(1_000)  # the overview's first paint
        screenshot(page, tmp_path, "perfetto.png")
        # one rank's link, from the window page's rank table: that rank alone
        page.goto(served.url + "/#/window/1")
        link = page.locator("a.perfetto", has_text="rank 1")
        link.wait_for(timeout=30_000)
        href = link.get_attribute("href")
        assert _decoded_target(href) == (
            served.url + "/api/windows/1/timeline.json.gz?ranks=1&role=policy"
        )
        page.goto(served.url + "/")  # a new document: Perfetto opens the new trace
        page.goto(served.url + href)
        page.get_by_text("rank 1 · policy").first.wait_for(timeout=120_000)
        assert page.get_by_text("rank 0 · policy").count() == 0
        # Perfetto asks for a Google script: the policy blocks it, nothing else is tried
        assert all(what == "csp" for _, what in outside), outside
        # without the extra, the links download the trace and the page says how to get it
        js = """() => { state.viewer = { perfetto: null, install: "pip install x" };
            const m = document.querySelector("main"); m.replaceChildren();
            runPage(m, state.status);
            return [m.querySelector("a.perfetto").getAttribute("href"),
                    m.querySelector("#perfetto-hint").textContent]; }"""
        page.goto(served.url + "/")
        page.wait_for_selector("a[href='#/window/1']", timeout=30_000)
        href, hint = page.evaluate(js)
        assert href.startswith("/api/windows/") and href.endswith("/timeline.json.gz")
        assert "pip install x" in hint and "ui.perfetto.dev" in hint


@pytest.mark.subprocess
def test_the_run_page_charts_the_step_time_with_its_windows_and_its_stall(served, tmp_path):
    with chromium_browser() as browser:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        sign_in(page, served.url)
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(served.url + "/")
        drawn = "document.getElementById('run-chart')?.chart?.$bands?.length === 2"
        wait_js(page, drawn, 30)
        chart = "document.getElementById('run-chart').chart"
        bands = page.evaluate(f"{chart}.$bands")
        assert [(b["index"], b["kind"], b["marked"]) for b in bands] == [
            (0, "scheduled", False), (1, "scheduled", False)]  # fmt: skip
        assert bands[0]["x1"] < bands[1]["x0"]  # steps 2-3, then 6-7
        assert [(s["index"], s["step"]) for s in page.evaluate(f"{chart}.$stalls")] == [(1, 7)]
        # what is drawn is what the trainer's clock measured, region by region
        sets = page.evaluate(f"{chart}.data.datasets.map(d => [d.label, d.data])")
        by_label = dict(sets)
        sent = {k: regions for k, _, regions in served.phases}
        assert [p["y"] for p in by_label["train"]] == pytest.approx(
            [sent[k]["train"] * 1e3 for k in range(8)], abs=0.01
        )
        assert "policy (windows, mean over ranks)" in by_label
        screenshot(page, tmp_path, "run.png")
        # a click on a band opens its window
        box = page.locator("#run-chart canvas").bounding_box()
        area = page.evaluate(f"{chart}.chartArea")
        mid = (bands[1]["x0"] + bands[1]["x1"]) / 2
        page.mouse.click(box["x"] + mid, box["y"] + (area["top"] + area["bottom"]) / 2)
        wait_js(page, "location.hash === '#/window/1'", 10)
        page.wait_for_selector("text=Top kernels", timeout=30_000)
        # a 100,000-step run with a window every 1,000 steps and a stall: 1,000 points drawn
        page.goto(served.url + "/")
        wait_js(page, drawn, 30)
        js = """c => { const box = document.getElementById('run-chart');
            const t0 = performance.now(); const made = drawRunChart(box, c);
            return [performance.now() - t0, made.$bands.length, made.$stalls.length,
                    made.data.datasets[0].data.length]; }"""
        ms, nbands, nstalls, npoints = page.evaluate(js, long_run_chart())
        assert (nbands, nstalls, npoints) == (100, 1, 1_000)
        print(f"a 100,000-step run drawn in {ms:.0f} ms")
    assert errors == []


def long_run_chart() -> dict:
    """The chart of a 100,000-step run (tests/test_run_chart.py's), a 2-step window every
    1,000 steps, a stall at step 50,000."""
    from coordinator.core.step_series import step_series
    from coordinator.ops.run_chart import run_chart
    from tests.test_run_chart import long_run, status, window

    stall = {"index": 1, "trainer_id": "t", "last_step": 50_000, "resumed_step": None,
             "detected_at": 0.0, "resumed_at": None}  # fmt: skip
    wins = [window(i, 1_000 * i + 500, 1_000 * i + 501) for i in range(100)]
    return run_chart(step_series(long_run(), points=1_000), status(wins, [stall]))


@pytest.mark.subprocess
def test_the_window_page_strips_every_rank_s_steps_and_pages_many_ranks(served):
    status, ks = served.http("GET", "/api/windows/1/kernels?per_rank=true&top_k=1")
    assert status == 200 and set(ks["rank_steps"]) == {"0", "1"}
    assert [s for s, _ in ks["rank_steps"]["0"]] == [6, 7]
    with chromium_browser() as browser:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        sign_in(page, served.url)
        page.goto(served.url + "/#/window/1")
        wait_js(page, "document.getElementById('step-strip')?.$strip !== undefined", 30)
        strip = page.evaluate("document.getElementById('step-strip').$strip")
        assert strip["ranks"] == [0, 1] and strip["pages"] == 1
        # the spans drawn are each rank's recorded steps, laid end to end
        drawn = page.evaluate(
            "document.getElementById('step-strip').chart.data.datasets.map(d => d.data)"
        )
        for i, rank in enumerate((0, 1)):
            (_, a), (_, b) = ks["rank_steps"][str(rank)]
            assert drawn[0][i] == pytest.approx([0, a]) and drawn[1][i] == pytest.approx([a, a + b])
        # 100 ranks, rank 57 slow at step 3: pages of 32, and the slow rank and step named
        many = {str(r): [[2, 10.0], [3, 30.0 if r == 57 else 10.0], [4, 10.0]] for r in range(100)}
        js = """rs => { const holder = document.getElementById('step-strip');
            drawStrip(holder, stripModel({ rank_steps: rs, stragglers: { threshold: 1.25 } }), 0);
            return holder.$strip; }"""
        strip = page.evaluate(js, many)
        assert (strip["pages"], strip["ranks"], strip["slowRank"]) == (4, list(range(32)), 57)
        assert strip["slow"] == ["57/3"] and strip["slowStep"] == 3
        text = page.inner_text("#step-strip")
        assert "slowest rank 57: 50.0 ms" in text and "step 3 on rank 57, 30.0 ms (x3.00" in text
        page.click("#strip-slowest")
        strip = page.evaluate("document.getElementById('step-strip').$strip")
        assert strip["page"] == 1 and 57 in strip["ranks"]
        colours = page.evaluate(
            "document.getElementById('step-strip').chart.data.datasets[1].backgroundColor"
        )
        assert colours[strip["ranks"].index(57)] == "#e15759"
        assert colours.count("#e15759") == 1
        if os.environ.get("RAY_PROFILER_DOCS_IMG"):
            page.locator("#step-strip").screenshot(
                path=os.path.join(os.environ["RAY_PROFILER_DOCS_IMG"], "strip.png")
            )
        page.click("#strip-next")
        page.click("#strip-next")
        strip = page.evaluate("document.getElementById('step-strip').$strip")
        assert strip["page"] == 3 and strip["ranks"] == list(range(96, 100))
        assert page.is_disabled("#strip-next") and not page.is_disabled("#strip-prev")


@pytest.mark.subprocess
def test_a_run_s_record_is_served_read_only_with_the_live_answers(served, tmp_path):
    import ray

    from coordinator.ops.recorded import RecordedCoordinator, open_record
    from coordinator.ops.web.record_link import RecordLink
    from tests.test_run_record import cli_no_cluster

    entry = ray.get(served.coord.flush_record.remote(30.0))
    assert entry["error"] is None and entry["pending"] == 0 and entry["windows"] == 2, entry
    web = ServerThread(RecordLink(RecordedCoordinator(open_record(entry["dir"]))))
    try:
        for path in (
            "/api/windows/1/kernels?top_k=10&per_rank=true",
            "/api/windows/0/kernels?by=op",
            "/api/windows/0/stragglers",
            "/api/diff?a=0&b=1",
            "/api/phases?last=50",
            "/api/windows/1/collectives",
        ):
            assert web.http("GET", path) == served.http("GET", path), path
        (status, st), (_, live) = web.http("GET", "/api/status"), served.http("GET", "/api/status")
        assert status == 200 and st["windows"] == live["windows"] and st["run"] == live["run"]
        assert [s["index"] for s in st["stalls"]] == [s["index"] for s in live["stalls"]] == [1]
        (_, chart), (_, now) = web.http("GET", "/api/chart"), served.http("GET", "/api/chart")
        assert chart["series"] == now["series"] and chart["windows"] == now["windows"]
        assert chart["roles"] == now["roles"] and len(chart["stalls"]) == 1
        changes = [("POST", "/api/captures", {"active": 1}), ("DELETE", "/api/captures/3", None)]
        for method, path, body in changes:
            status, said = web.http(method, path, body, token=TOKEN)
            assert status == 409 and said["error"].startswith("read-only: the record of run")
        # Traces and timelines come from save_path, as the live server's (issue 47).
        for path in ("/api/windows/1/timeline.json.gz", "/api/windows/0/timeline.json.gz?ranks=1"):
            (status, got), (_, live) = web.http("GET", path), served.http("GET", path)
            assert status == 200 and gzip.decompress(got) == gzip.decompress(live), path
        (status, got), (_, live) = (
            x.http("GET", "/api/windows/1/traces.tar.gz") for x in (web, served)
        )
        assert status == 200 and tar_files(got) == tar_files(live) and len(tar_files(got)) == 2
        out, kept = tmp_path / "w1.json.gz", tmp_path / "w1"
        done = cli_no_cluster("collect", "--from", entry["dir"], "--window", "1", "--merge",
                              str(out), "--to", str(kept))  # fmt: skip
        assert done.returncode == 0 and "2 ranks" in done.stdout, done.stderr
        live_merged = served.http("GET", "/api/windows/1/timeline.json.gz")[1]
        assert gzip.decompress(out.read_bytes()) == gzip.decompress(live_merged)
        assert len(os.listdir(kept)) == 2
        with chromium_browser() as browser:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            sign_in(page, web.url)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(web.url + "/")
            page.wait_for_selector("a[href='#/window/1']", timeout=30_000)
            page.wait_for_selector("#read-only")
            wait_js(page, "document.getElementById('live').textContent.includes('read-only')", 10)
            assert page.locator("#nav-captures").count() == 0  # nothing to capture in a record
            page.goto(web.url + "/#/captures")
            page.wait_for_selector("text=nothing here changes a run", timeout=10_000)
            assert page.locator("#capture-form").count() == 0
            page.goto(web.url + "/#/window/1")
            page.wait_for_selector("text=Rank x top kernel", timeout=30_000)
        assert errors == []
    finally:
        web.close()


DRAW_NOT_JUDGED = """missing => { const h = document.createElement("div");
  drawFindings(h, { findings: [], problems: [], not_judged: missing });
  return [...h.querySelectorAll(".findings-not-judged li")].map(li => li.textContent); }"""
"""The window page's findings drawn for a reply whose rules in ``missing`` could not judge."""


def not_judged_lines(missing: dict[str, str]) -> list[str]:
    """The lines the page draws for ``advise()``'s ``not_judged``: its rules grouped by why."""
    why: dict[str, list[str]] = {}
    for rule, text in missing.items():
        why.setdefault(text, []).append(rule)
    return [f"not judged: {', '.join(rules)}: {text}" for text, rules in why.items()]


def test_a_window_with_no_finding_says_so_in_one_line(served):
    status, a = served.http("GET", "/api/windows/1/advise")
    assert status == 200 and a["window"] == 1 and a["findings"] == [], a
    assert served.http("GET", "/api/windows/1/advise?role=no%20such")[0] == 400
    with chromium_browser() as browser:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        sign_in(page, served.url)
        page.goto(served.url + "/#/window/1")
        page.wait_for_selector("#findings .findings-none", timeout=30_000)
        said = page.locator("#findings .findings-not-judged li").all_inner_texts()
        assert said == not_judged_lines(a["not_judged"]), (said, a)
        assert page.inner_text("#findings").split("\n")[0] == "no finding for this window"
        drawn = page.evaluate(DRAW_NOT_JUDGED, {"dataloader": "old", "zero_grad": "old", "x": "y"})
        assert drawn == ["not judged: dataloader, zero_grad: old", "not judged: x: y"], drawn
        headings = page.locator("h2").all_inner_texts()
        top = headings.index("Top kernels, and their spread across ranks")
        assert headings.index("Findings") < top
