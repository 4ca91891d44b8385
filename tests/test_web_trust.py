"""The web server's token and its expensive reads (issue 46, items 3 and 4): the token is never
taken from an address, the login form sets the cookie (a read-only server's too), and past
``EXPENSIVE_AT_ONCE`` merged timelines or tarballs at once the next one is answered 429."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from coordinator.ops.web import auth
from coordinator.ops.web.server import EXPENSIVE_AT_ONCE, WebServer
from tests.s3_server import free_port

TOKEN = "t0ken-for-the-tests"


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
        assert r.status == 400 and auth.COOKIE not in r.cookies
        assert "never taken from an address" in (await r.json())["error"]
        page = await client.get("/login")
        html = await page.text()
        assert page.status == 200 and '<form method="post" action="/login">' in html
        assert TOKEN not in html
    finally:
        await client.close()


@pytest.mark.parametrize("link", [None, _ReadOnly()])
async def test_the_login_form_sets_the_cookie_from_its_body(link):
    client, _ = await _client(link)
    try:
        wrong = await client.post("/login", data={"token": "nope"}, allow_redirects=False)
        assert wrong.status in (401, 403) and auth.COOKIE not in wrong.cookies
        r = await client.post("/login", data={"token": TOKEN}, allow_redirects=False)
        assert (r.status, r.headers["Location"]) == (303, "/")
        cookie = r.headers["Set-Cookie"]
        assert f"{auth.COOKIE}={TOKEN}" in cookie and "HttpOnly" in cookie
        assert "SameSite=Strict" in cookie
    finally:
        await client.close()


@pytest.mark.parametrize("path", ["traces.tar.gz", "timeline.json.gz"])
async def test_an_expensive_read_past_the_limit_is_answered_429(path):
    client, server = await _client()
    try:
        server.expensive.running = EXPENSIVE_AT_ONCE  # (as many as allowed are being built)
        r = await client.get(f"/api/windows/0/{path}")
        assert (r.status, r.headers["Retry-After"]) == (429, "5")
        assert f"at most {EXPENSIVE_AT_ONCE} at once" in (await r.json())["error"]
    finally:
        await client.close()
