"""The web server's token and its expensive reads (issue 46, items 3 and 4): the token is never
taken from an address, the login form sets the cookie (a read-only server's too), and past
``EXPENSIVE_AT_ONCE`` merged timelines or tarballs at once the next one is answered 429.
Issue 53 item 1: on loopback too, every read of the run's data needs the token; the sign-in
cookie is named for the server's port (a browser shares a host's cookies across its ports)."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from coordinator.ops.web import auth
from coordinator.ops.web.server import EXPENSIVE_AT_ONCE, WebServer
from tests.s3_server import free_port

TOKEN = "t0ken-for-the-tests"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


class _ReadOnly:
    read_only = "read-only: this server shows a run's record"


async def _client(link: object = None) -> tuple[TestClient, WebServer]:
    port = free_port()
    server = WebServer(link, TOKEN, "127.0.0.1", port)
    client = TestClient(TestServer(server.app(), host="127.0.0.1", port=port))
    await client.start_server()
    return client, server


async def test_a_token_in_the_login_address_is_refused_and_never_read():
    client, _ = await _client()
    try:
        r = await client.get(f"/login?token={TOKEN}", allow_redirects=False)
        assert r.status == 400 and not r.cookies
        assert "never taken from an address" in (await r.json())["error"]
        page = await client.get("/login")
        html = await page.text()
        assert page.status == 200 and '<form method="post" action="/login">' in html
        assert TOKEN not in html
    finally:
        await client.close()


@pytest.mark.parametrize("link", [None, _ReadOnly()])
async def test_the_login_form_sets_the_cookie_from_its_body(link):
    client, server = await _client(link)
    try:
        wrong = await client.post("/login", data={"token": "nope"}, allow_redirects=False)
        assert wrong.status == 403 and not wrong.cookies
        assert (await wrong.json())["error"] == "wrong token"
        r = await client.post("/login", data={"token": TOKEN}, allow_redirects=False)
        assert (r.status, r.headers["Location"]) == (303, "/")
        cookie = r.headers["Set-Cookie"]
        name = auth.cookie_name(client.port)
        assert server.cookie == name and f"{name}={auth.cookie_value(TOKEN)}" in cookie
        assert TOKEN not in cookie and "HttpOnly" in cookie  # (the cookie reaches every port)
        assert "SameSite=Strict" in cookie
    finally:
        await client.close()


@pytest.mark.parametrize("path", ["traces.tar.gz", "timeline.json.gz"])
async def test_an_expensive_read_past_the_limit_is_answered_429(path):
    client, server = await _client()
    try:
        server.expensive.running = EXPENSIVE_AT_ONCE  # (as many as allowed are being built)
        r = await client.get(f"/api/windows/0/{path}", headers=BEARER)
        assert (r.status, r.headers["Retry-After"]) == (429, "5")
        assert f"at most {EXPENSIVE_AT_ONCE} at once" in (await r.json())["error"]
    finally:
        await client.close()


API_READS = [
    "/api/viewer", "/api/status", "/api/windows/0/kernels", "/api/windows/0/stragglers",
    "/api/windows/0/collectives", "/api/windows/0/advise",
    "/api/windows/0/traces.tar.gz", "/api/windows/0/timeline.json.gz", "/api/diff?a=0&b=1",
    "/api/phases", "/api/chart", "/api/memory",
]  # fmt: skip


async def test_on_loopback_too_every_read_of_the_run_needs_the_token():
    """Any local user can reach a loopback port: without the token, no read of the run's
    data (nor a slot of the expensive reads) is had; only the pages' shells are open."""
    client, server = await _client()
    try:
        server.expensive.running = EXPENSIVE_AT_ONCE
        routes = {r.resource.canonical for r in server.app().router.routes() if r.method == "GET"}
        api = {p for p in routes if p.startswith("/api/")}
        assert {p.split("?")[0].replace("/0/", "/{window}/") for p in API_READS} == api
        for path in API_READS:
            r = await client.get(path)
            assert r.status == 401, path
            assert "needs the token" in (await r.json())["error"]
            wrong = await client.get(path, cookies={server.cookie: "x"})
            assert wrong.status == 401, path  # (the page follows a 401 to /login)
            assert "sign in again at /login" in (await wrong.json())["error"]
        for path in ("/", "/login", "/static/app.js", "/static/login.js"):
            assert (await client.get(path)).status == 200, path
        # and with the cookie the login form set, a read goes on (here: to the busy slots)
        login = await client.post("/login", data={"token": TOKEN}, allow_redirects=False)
        assert login.status == 303
        r = await client.get("/api/windows/0/traces.tar.gz")
        assert r.status == 429
    finally:
        await client.close()


async def test_two_servers_on_one_host_keep_their_own_sign_in_cookies():
    """Browsers keep one host's cookies for all its ports (aiohttp's jar too): signing in to a
    second loopback server leaves the first one's cookie alone, and a cookie of another token
    is answered with a sign-in (401, which the page follows to /login), never 403."""
    first, first_server = await _client()
    port = free_port()
    other = WebServer(None, "another-t0ken", "127.0.0.1", port)
    second = TestClient(TestServer(other.app(), host="127.0.0.1", port=port))
    await second.start_server()
    jar = aiohttp.CookieJar(unsafe=True)  # (one browser: one jar for every port of the host)
    try:
        assert first_server.cookie != other.cookie
        async with aiohttp.ClientSession(cookie_jar=jar) as browser:
            for url, token in ((first.make_url("/login"), TOKEN),
                               (second.make_url("/login"), "another-t0ken")):  # fmt: skip
                r = await browser.post(url, data={"token": token}, allow_redirects=False)
                assert r.status == 303
            assert len(jar) == 2
            for client, server in ((first, first_server), (second, other)):
                server.expensive.running = EXPENSIVE_AT_ONCE  # (past the token: 429)
                r = await browser.get(client.make_url("/api/windows/0/traces.tar.gz"))
                assert r.status == 429, (await r.json())["error"]
            # the first server restarted with a new token: its old cookie signs in again
            first_server.token = "a-new-t0ken"
            r = await browser.get(first.make_url("/api/status"), allow_redirects=False)
            assert r.status == 401 and "sign in again" in (await r.json())["error"]
    finally:
        await first.close()
        await second.close()
