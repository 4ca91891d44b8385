"""Who may ask the web server what: pure checks on a request's method, headers and cookie.

- Changes (captures, cancels: every method but GET and HEAD) need the token, always, in an
  ``Authorization: Bearer <token>`` header; a cookie never authorises a change (so another site
  cannot make a browser change a run).
- Reads need the token too, on loopback as on any other address (every local user can reach a
  loopback port): in the header or in the cookie that ``POST /login`` sets (the token in the
  form's body, never in an address: ``GET /login?token=`` is refused). The cookie is named
  for the server's port (``cookie_name``): a browser keeps one host's cookies for all its
  ports, so signing in to a second server on the host leaves the first one's cookie alone. The
  browser still sends every cookie of the host to each of its ports, another local user's
  server included: the cookie holds ``cookie_value(token)`` (an HMAC of the token), never the
  token, so what leaks that way reads this server's run and changes nothing. A cookie of
  another token is answered 401 (sign in again), as a missing token is; a wrong token in the
  header 403. Open to anyone: the
  pages' shells and files that hold no run's data (``OPEN``: ``/``, ``/login``, ``/static/``,
  Perfetto's UI), so that a browser can load the sign-in form.
- The ``Host`` header must name the server (its address, or ``localhost`` on loopback), which
  stops a page on another site from reaching a loopback server by DNS rebinding.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from dataclasses import dataclass

TOKEN_ENV = "RAY_PROFILER_TOKEN"
COOKIE = "ray_profiler_token"
"""The sign-in cookie's name, before its port (``cookie_name``)."""
READS = ("GET", "HEAD")
OPEN = ("/", "/login", "/perfetto")
OPEN_UNDER = ("/static/", "/perfetto/")
"""The paths a read of needs no token: no run's data is in them (every ``/api/`` read needs
it)."""


@dataclass(frozen=True)
class Refusal:
    """An HTTP status and the reason the server answers with."""

    status: int
    reason: str


def new_token() -> str:
    """A fresh random token (32 bytes, URL-safe)."""
    return secrets.token_urlsafe(32)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(host: str, port: int) -> frozenset[str]:
    """The ``Host`` header values that name a server bound to ``host:port``."""
    names = {host, f"[{host}]"} if ":" in host else {host}
    if is_loopback(host):
        names |= {"localhost", "127.0.0.1", "[::1]"}
    return frozenset({*names, *(f"{n}:{port}" for n in names)})


def cookie_name(port: int) -> str:
    """The sign-in cookie of the server on ``port`` (browsers share a host's cookies across its
    ports, so one name for every server would let each sign-in overwrite the others')."""
    return f"{COOKIE}_{port}"


def cookie_value(token: str) -> str:
    """What the sign-in cookie holds for ``token``: an HMAC of it (the cookie reaches every
    port of the host; the token, which also authorises changes, never leaves in it)."""
    return hmac.new(token.encode(), b"ray-profiler sign-in cookie", hashlib.sha256).hexdigest()


def is_open(path: str) -> bool:
    """Whether a read of ``path`` needs no token (``OPEN``)."""
    return path in OPEN or path.startswith(OPEN_UNDER)


def check(
    method: str,
    host_header: str | None,
    authorization: str | None,
    cookie: str | None,
    token: str,
    hosts: frozenset[str],
    open_read: bool,
) -> Refusal | None:
    """None when the request may go on, else why not (400, 401 or 403); ``open_read``: a
    read of this path needs no token (``is_open``)."""
    if host_header is None or host_header.lower() not in hosts:
        return Refusal(403, f"unexpected Host header {str(host_header)[:80]!r}")
    read = method in READS
    if read and open_read:
        return None
    given = bearer(authorization)
    from_cookie = given is None and read and cookie is not None
    if from_cookie:
        given, token = cookie, cookie_value(token)
    if given is None:
        what = "changes need" if not read else "this read needs"
        return Refusal(
            401,
            f"{what} the token: send 'Authorization: Bearer <token>', or sign in at /login "
            "(the address ray-profiler serve printed signs in)",
        )
    if not hmac.compare_digest(given.encode(), token.encode()):
        if from_cookie:  # (a page signed in to an earlier run of this server: sign in again)
            return Refusal(401, "the sign-in cookie holds another token: sign in again at /login")
        return Refusal(403, "wrong token")
    return None


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()
