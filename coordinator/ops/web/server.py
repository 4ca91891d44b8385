"""``ray-profiler serve``: the web pages and the JSON API of a running coordinator (aiohttp).

It runs in the operator's process, beside a Ray driver, and only calls the coordinator's own
RPCs: every answer has the shape of a reply in ``coordinator.protocol.replies``. See
docs/views.md#the-web-view-and-its-http-api for the pages and the API table.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import logging
import math
import os
import shutil
import tarfile
import tempfile
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from aiohttp import web

from coordinator.core.phases import EXACT_STEPS
from coordinator.core.step_series import DEFAULT_POINTS, MAX_POINTS
from coordinator.core.timeline import DEFAULT_MAX_EVENTS
from coordinator.ops.cross_diff import ALL_KERNELS, diff_tables
from coordinator.ops.run_chart import run_chart
from coordinator.ops.web import auth, files, perfetto
from coordinator.ops.web.params import (
    MAX_BODY_BYTES,
    BadRequest,
    advise_args,
    capture_args,
    collectives_args,
    diff_args,
    float_param,
    int_param,
    kernels_args,
    ranks_param,
    role_param,
    str_param,
    window_index,
)
from coordinator.protocol.atomic_file import write_atomic

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 60.0
TIMELINE_RANKS = 256
"""At most this many ranks in one merged timeline from the web view (413 beyond: ask for
``ranks=``, or run ``ray-profiler collect --merge``, which has no such limit)."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Unavailable(Exception):
    """The coordinator cannot be reached (503)."""


class NotFound(Exception):
    """An unknown window or run (404)."""


class TooLarge(Exception):
    """More than the server makes in one answer (413); the message says the limit."""


class Conflict(Exception):
    """A change asked of a server that cannot make it (409): it serves a run's record."""


class Busy(Exception):
    """Too many expensive reads at once (429); the message says the limit."""


EXPENSIVE_AT_ONCE = 2
"""Merged timelines and trace tarballs built at once; one more is answered 429 (each can cost
a core and hundreds of MB for a large window, and reads are open on loopback)."""
RETRY_AFTER_S = 5


class ExpensiveReads:
    """At most ``limit`` expensive reads at once: ``async with reads.one():``, else ``Busy``."""

    def __init__(self, limit: int = EXPENSIVE_AT_ONCE) -> None:
        self.limit, self.running = limit, 0

    @contextlib.asynccontextmanager
    async def one(self) -> Any:
        if self.running >= self.limit:
            raise Busy(
                f"{self.running} merged timelines or trace tarballs are being built; at most "
                f"{self.limit} at once: try again in a few seconds"
            )
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1


class RecordCache:
    """The records the diff page read last (a few: each holds its windows' tables)."""

    def __init__(self, size: int = 4) -> None:
        self.size, self._kept = size, collections.OrderedDict[str, Any]()

    def open(self, run: str, save_path: str | None) -> Any:
        """The record of run ``run`` under ``save_path`` (read once); NotFound when none."""
        from coordinator.ops.recorded import RecordedCoordinator, locate, open_record

        try:
            url = locate(run, save_path, names_only=True)
            if url not in self._kept:
                self._kept[url] = RecordedCoordinator(open_record(url))
        except (ValueError, OSError) as exc:
            raise NotFound(f"no run {run!r} kept or recorded: {exc}") from None
        self._kept.move_to_end(url)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)
        return self._kept[url]


class CoordinatorLink:
    """The coordinator's handle, looked up by name, and again after it failed."""

    def __init__(self, name: str, namespace: str, handle: Any = None) -> None:
        self.name, self.namespace, self._handle = name, namespace, handle

    def handle(self) -> Any:
        """The handle, looked up now if need be (blocking: for the server's worker threads);
        Unavailable when there is none."""
        import ray

        if self._handle is None:
            try:
                self._handle = ray.get_actor(self.name, namespace=self.namespace)
            except ValueError as exc:
                raise Unavailable(
                    f"the coordinator {self.name!r} cannot be reached: {exc}"
                ) from None
        return self._handle

    async def call(
        self, method: str, *args: Any, timeout: float = CALL_TIMEOUT_S, **kw: Any
    ) -> Any:
        """``method`` on the coordinator; Unavailable, NotFound or BadRequest when it fails."""
        import ray

        try:
            if self._handle is None:
                loop = asyncio.get_running_loop()
                lookup = functools.partial(ray.get_actor, self.name, namespace=self.namespace)
                self._handle = await loop.run_in_executor(None, lookup)
            ref = getattr(self._handle, method).remote(*args, **kw)
            return await asyncio.wait_for(ref, timeout)
        except ray.exceptions.RayTaskError as exc:
            raise _refused(exc) from None
        except (ray.exceptions.RayActorError, ValueError) as exc:  # gone, or never found
            self._handle = None
            raise Unavailable(f"the coordinator {self.name!r} cannot be reached: {exc}") from None
        except (asyncio.TimeoutError, ray.exceptions.GetTimeoutError):
            raise Unavailable(f"the coordinator did not answer {method} in {timeout:g} s") from None


def _refused(exc: Exception) -> Exception:
    """A ValueError the coordinator raised, as NotFound (an unknown window or run) or
    BadRequest; anything else as Unavailable."""
    line = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    line = line.split(": ", 1)[1] if line.startswith("ValueError: ") else line
    if not isinstance(exc, ValueError):
        return Unavailable(f"the coordinator failed: {line}")
    if line.startswith(("no window", "no closed window", "no run")):
        return NotFound(line)
    return BadRequest(line)


def finite(obj: Any) -> Any:
    """``obj`` with NaN and infinities as None (JSON has neither) and tuples as lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def reply(obj: Any, status: int = 200) -> web.Response:
    body = json.dumps(finite(obj), allow_nan=False, default=str)
    return web.Response(text=body, status=status, content_type="application/json")


class WebServer:
    """The aiohttp application: pages, static files and the API, behind ``auth.check``."""

    def __init__(self, link: Any, token: str, host: str, port: int) -> None:
        """``link``: a ``CoordinatorLink``, or a ``RecordLink`` (read-only: every change is
        refused with 409 and its reason)."""
        self.link, self.token = link, token
        self.read_only: str | None = getattr(link, "read_only", None)
        self._records = RecordCache()
        self.expensive = ExpensiveReads()
        self.hosts = auth.allowed_hosts(host, port)
        self.cookie = auth.cookie_name(port)
        self.loopback = auth.is_loopback(host)
        self.static = resources.files("coordinator.ops.web") / "static"
        self.perfetto = perfetto.ui_dir()
        index = self.perfetto / "index.html" if self.perfetto else None
        self.perfetto_policy = perfetto.policy(index.read_bytes()) if index else None

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=MAX_BODY_BYTES, middlewares=[self._errors, self._guard]
        )
        r = app.router
        r.add_get("/", self.page)
        r.add_get("/login", self.login_page)
        r.add_post("/login", self.login)
        r.add_get("/static/{path:.+}", self.static_file)
        r.add_get("/perfetto", self.perfetto_root)
        r.add_get(perfetto.PREFIX + "{path:.*}", self.perfetto_file)
        r.add_get("/api/viewer", self.viewer)
        r.add_get("/api/status", self.status)
        r.add_get("/api/windows/{window}/kernels", self.kernels)
        r.add_get("/api/windows/{window}/stragglers", self.stragglers)
        r.add_get("/api/windows/{window}/collectives", self.collectives)
        r.add_get("/api/windows/{window}/advise", self.advise)
        r.add_get("/api/windows/{window}/traces.tar.gz", self.traces)
        r.add_get("/api/windows/{window}/timeline.json.gz", self.timeline)
        r.add_get("/api/diff", self.diff)
        r.add_get("/api/phases", self.phases)
        r.add_get("/api/chart", self.chart)
        r.add_get("/api/memory", self.memory)
        r.add_post("/api/captures", self.capture)
        r.add_delete("/api/captures/{window}", self.cancel)
        return app

    # ------------------------------------------------------------- middleware

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every error as JSON with a reason and its status; never a traceback."""
        try:
            return await handler(request)
        except BadRequest as exc:
            return reply({"error": str(exc)}, 400)
        except NotFound as exc:
            return reply({"error": str(exc)}, 404)
        except TooLarge as exc:
            return reply({"error": str(exc)}, 413)
        except Conflict as exc:
            return reply({"error": str(exc)}, 409)
        except Unavailable as exc:
            return reply({"error": str(exc)}, 503)
        except Busy as exc:
            busy = reply({"error": str(exc)}, 429)
            busy.headers["Retry-After"] = str(RETRY_AFTER_S)
            return busy
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return reply({"error": exc.reason}, exc.status)
        except Exception:
            log.exception("web request %s %s failed", request.method, request.path)
            return reply({"error": "internal error (see the server's log)"}, 500)

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        refusal = None
        if request.path != "/login":
            refusal = auth.check(
                request.method,
                request.headers.get("Host"),
                request.headers.get("Authorization"),
                request.cookies.get(self.cookie),
                self.token,
                self.hosts,
                request.method in auth.READS and auth.is_open(request.path),
            )
        if refusal is not None:
            return reply({"error": refusal.reason}, refusal.status)
        if self.read_only and request.method not in ("GET", "HEAD") and request.path != "/login":
            return reply({"error": self.read_only}, 409)
        response = await handler(request)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Cache-Control", "no-store")
        response.headers.setdefault(
            "Content-Security-Policy", "default-src 'self'; img-src 'self' data:"
        )
        response.headers.setdefault("Referrer-Policy", "no-referrer")
        response.headers.setdefault("X-Frame-Options", "SAMEORIGIN")
        return response

    # ------------------------------------------------------------------ pages

    async def page(self, request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=(self.static / "index.html").read_bytes(), content_type="text/html"
        )

    async def login_page(self, request: web.Request) -> web.StreamResponse:
        """``GET /login``: the form that sends the token in its body; a token in the address
        (browser history, proxies' logs) is refused, never read."""
        if "token" in request.query:
            raise BadRequest(
                "the token is never taken from an address (it would stay in the browser's "
                "history and in proxies' logs): open /login and type it into the form"
            )
        return web.Response(
            body=(self.static / "login.html").read_bytes(), content_type="text/html"
        )

    async def login(self, request: web.Request) -> web.StreamResponse:
        """``POST /login`` (form field ``token``): the cookie that lets a browser read the
        run's data."""
        given = str((await request.post()).get("token", "")).strip()
        refusal = auth.check(  # (as a header: a wrong token here is 403, not "sign in again")
            "GET",
            request.headers.get("Host"),
            f"Bearer {given}",
            None,
            self.token,
            self.hosts,
            False,
        )
        if refusal is not None:
            return reply({"error": refusal.reason}, refusal.status)
        response = web.Response(status=303, headers={"Location": "/"})
        response.set_cookie(self.cookie, auth.cookie_value(given), httponly=True, samesite="Strict")
        return response

    async def static_file(self, request: web.Request) -> web.StreamResponse:
        parts = files.parts_of(request.match_info["path"])
        node = self.static.joinpath(*parts) if parts else None
        if node is None or not node.is_file():
            raise NotFound("no such file")
        kind = files.content_type(node.name, "text/plain")
        return web.Response(body=node.read_bytes(), content_type=kind)

    async def perfetto_root(self, request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound(perfetto.PREFIX)

    async def perfetto_file(self, request: web.Request) -> web.StreamResponse:
        """Perfetto's UI (``/perfetto/``, from the ``perfetto`` extra), under its own, documented
        security policy; 404 with how to install it when it is not installed."""
        if self.perfetto is None or self.perfetto_policy is None:
            raise NotFound(f"Perfetto's UI is not installed here: {perfetto.INSTALL}")
        path = perfetto.file_in(self.perfetto, request.match_info["path"])
        if path is None:
            raise NotFound("no such file")
        headers = {
            "Content-Type": files.content_type(path.name),
            "Content-Security-Policy": self.perfetto_policy,
        }
        if path.name != "index.html":  # the build's files, under their version's folder
            headers["Cache-Control"] = "private, max-age=3600"

        return web.FileResponse(path, headers=headers)

    async def viewer(self, request: web.Request) -> web.StreamResponse:
        """Where the pages open traces: the served Perfetto, or None and how to install it."""
        served = perfetto.PREFIX if self.perfetto is not None else None
        install = None if served else perfetto.INSTALL
        return reply({"perfetto": served, "install": install, "read_only": self.read_only})

    # -------------------------------------------------------------------- API

    async def status(self, request: web.Request) -> web.StreamResponse:
        return reply(await self.link.call("status"))

    async def kernels(self, request: web.Request) -> web.StreamResponse:
        window = window_index(request.match_info["window"])
        ks = await self.link.call("kernel_summary", window=window, **kernels_args(request.query))
        return reply(ks)

    async def stragglers(self, request: web.Request) -> web.StreamResponse:
        window = window_index(request.match_info["window"])
        args = kernels_args(request.query) | {"top_k": 0, "per_rank": False}
        ks = await self.link.call("kernel_summary", window=window, **args)
        return reply({**ks["stragglers"], "window": ks["window"], "role": ks["role"]})

    async def collectives(self, request: web.Request) -> web.StreamResponse:
        """The window's collectives matched across its ranks (``WindowCollectivesReply``)."""
        window = window_index(request.match_info["window"])
        return reply(await self.link.call("collectives", window, **collectives_args(request.query)))

    async def advise(self, request: web.Request) -> web.StreamResponse:
        """The window's findings across its ranks, costliest first (``FindingsReply``)."""
        window = window_index(request.match_info["window"])
        return reply(await self.link.call("advise", window, **advise_args(request.query)))

    async def diff(self, request: web.Request) -> web.StreamResponse:
        """Window ``b`` against window ``a``; a side whose run the coordinator does not keep
        is read from that run's record under its ``save_path`` (``RUN:WINDOW``, across jobs)."""
        args = diff_args(request.query)
        try:
            return reply(await self.link.call("kernel_diff", **args))
        except NotFound:
            if args["run_a"] is None and args["run_b"] is None:
                raise
        tables = [await self._side(args[s], args[f"run_{s}"], args["trainer_id"]) for s in "ab"]
        try:
            return reply(diff_tables(tables[0], tables[1], args["top_k"]))
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    async def _side(self, window: int, run: str | None, trainer_id: str | None) -> Any:
        """One side's table of every kernel: the coordinator's, else its run's record."""
        try:
            return await self.link.call("kernel_summary", window, ALL_KERNELS, trainer_id,
                                        False, run)  # fmt: skip
        except NotFound:
            if run is None:
                raise
        save_path = (await self.link.call("status"))["config"].get("save_path")
        loop = asyncio.get_running_loop()
        recorded = await loop.run_in_executor(None, self._records.open, run, save_path)
        try:
            return await recorded.call("kernel_summary", window, ALL_KERNELS, trainer_id, False)
        except ValueError as exc:
            raise NotFound(str(exc)) from None

    async def phases(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        last = int_param(q, "last", 200, 0, EXACT_STEPS)  # the coordinator keeps no more
        return reply(await self.link.call("phase_times", last=last, run=str_param(q, "run")))

    async def chart(self, request: web.Request) -> web.StreamResponse:
        """The run at a glance (``RunChart``): the step time over the run, at most ``points``
        spans, with the windows and stalls of the run."""
        points = int_param(request.query, "points", DEFAULT_POINTS, 1, MAX_POINTS)
        series = await self.link.call("step_series", points=points)
        return reply(run_chart(series, await self.link.call("status")))

    async def memory(self, request: web.Request) -> web.StreamResponse:
        """Every rank's memory over the run (``MemoryReply`` with each rank's series)."""
        return reply(await self.link.call("memory", series=True))

    async def capture(self, request: web.Request) -> web.StreamResponse:
        """A capture's answer: 200 when accepted, 409 with its ``reason`` when refused."""
        args = capture_args(await request.read())
        answer = await self.link.call("request_capture", **args, timeout=CALL_TIMEOUT_S + 60)
        return reply(answer, 200 if answer["accepted"] else 409)

    async def cancel(self, request: web.Request) -> web.StreamResponse:
        window = window_index(request.match_info["window"])
        answer = await self.link.call("cancel_capture", window)
        return reply(answer, 200 if answer["cancelled"] else 409)

    async def timeline(self, request: web.Request) -> web.StreamResponse:
        """Every rank of a window (``role``: one role's; ``ranks``: some) in one Chrome trace,
        gzipped: ``collect --merge``."""
        window = window_index(request.match_info["window"])
        q = request.query
        kw: dict[str, Any] = {
            "run": str_param(q, "run"),
            "roles": [role] if (role := role_param(q)) else None,
            "ranks": ranks_param(q, "ranks", TIMELINE_RANKS),
            "min_us": float_param(q, "min_us", 0.0, 0.0, 1e9),
            "max_events": int_param(q, "max_events", DEFAULT_MAX_EVENTS, 1, DEFAULT_MAX_EVENTS),
        }
        fn = functools.partial(_merged, self.link, window, **kw)
        return await self._built(request, fn)

    async def traces(self, request: web.Request) -> web.StreamResponse:
        """Every rank's trace of a window (one role) as one ``.tar.gz``, through ``collect``."""
        window = window_index(request.match_info["window"])
        q = request.query
        role, run = role_param(q), str_param(q, "run")
        fn = functools.partial(_archive, self.link, window, role, run)
        return await self._built(request, fn)

    async def _built(self, request: web.Request, build: Callable[..., Built]) -> web.StreamResponse:
        """The file ``build(work_dir)`` makes, off the event loop, sent and then removed; at
        most ``EXPENSIVE_AT_ONCE`` at once (429 beyond)."""
        async with self.expensive.one():
            work = tempfile.mkdtemp(prefix="ray-profiler-web-")
            try:
                loop = asyncio.get_running_loop()
                built = await loop.run_in_executor(None, functools.partial(build, work=work))
                return await _send_file(request, *built)
            finally:
                shutil.rmtree(work, ignore_errors=True)


Built = tuple[str, str, dict[str, str]]
"""A download made: its path, its name, and "rank" -> why for each trace left out of it."""
MISSING_HEADER = "X-Ray-Profiler-Missing"
"""The header that says, in JSON, which ranks' traces a download left out, and why."""


async def _send_file(
    request: web.Request, path: str, name: str, missing: dict[str, str]
) -> web.StreamResponse:
    """Stream a gzipped file as a download, a megabyte at a time."""
    loop = asyncio.get_running_loop()
    headers = {
        "Content-Type": "application/gzip",
        "Content-Disposition": f'attachment; filename="{name}"',
    }
    if missing:  # (header values are one line of ASCII: json.dumps escapes the rest)
        headers[MISSING_HEADER] = json.dumps(dict(list(missing.items())[:64]))[:4000]
    response = web.StreamResponse(headers=headers)
    await response.prepare(request)
    with open(path, "rb") as f:
        while chunk := await loop.run_in_executor(None, f.read, 1 << 20):
            await response.write(chunk)
    await response.write_eof()
    return response


def _merged(link: CoordinatorLink, window: int, *, work: str, **kw: Any) -> Built:
    """Merge the window's ranks into one trace in ``work`` (a record's: from ``save_path``,
    here); its path, name, and the ranks left out."""
    from coordinator.ops.timeline import TooManyRanks, merge_window

    name, handle = f"window_{window:04d}.timeline.json.gz", link.handle()
    path = os.path.join(work, name)
    try:
        res = merge_window(handle, window, path, wait_s=30, max_ranks=TIMELINE_RANKS, **kw)
    except TooManyRanks as exc:
        raise TooLarge(str(exc)) from None
    except ValueError as exc:
        raise NotFound(str(exc).strip().splitlines()[-1]) from None
    return path, name, {f"window {window} {who}": why for who, why in res["missing"].items()}


def _archive(
    link: CoordinatorLink, window: int, role: str | None, run: str | None, *, work: str
) -> Built:
    """Collect the window's traces into ``work`` and pack them (with ``MISSING.txt`` naming
    each rank whose trace could not be had); the archive's path, name, and those ranks. The
    files in ``work`` are named here (``traces``, ``traces.tar.gz``), never after the query
    or the record; the name the archive is sent as holds the role, a checked name."""
    from coordinator.ops.collect import collect_window

    dest, handle = os.path.join(work, "traces"), link.handle()
    label = f"window_{window:04d}_{role or 'policy'}"
    try:
        res = collect_window(handle, window, dest, run=run, role=role, wait_s=30)
    except ValueError as exc:
        raise NotFound(str(exc).strip().splitlines()[-1]) from None
    missing = {f"window {window} rank {r}": why for r, why in sorted(res["missing"].items())}
    if not res["files"]:
        raise NotFound(f"no trace of window {window} could be collected: {missing}")
    if missing:
        write_atomic(os.path.join(dest, "MISSING.txt"),
                     "".join(f"{who}: {why}\n" for who, why in missing.items()))  # fmt: skip
    path = os.path.join(work, "traces.tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        tar.add(dest, arcname=label)
    return path, f"{label}.tar.gz", missing


def serve(
    handle: Any,
    name: str,
    namespace: str,
    host: str,
    port: int,
    token: str | None = None,
    link: Any = None,
) -> None:
    """Serve until interrupted (``link``: a ``RecordLink`` to serve a record, read-only);
    prints where, and the token when it made one."""
    made = token is None
    token = token or auth.new_token()
    link = link or CoordinatorLink(name, namespace, handle)
    server = WebServer(link, token, host, port)
    shown = f"[{host}]" if ":" in host else host
    what = server.read_only or f"coordinator {namespace}/{name}"
    print(f"ray-profiler serve: http://{shown}:{port}/ ({what})")
    if made:
        print(f"token (every read of the run and every change need it): {token}")
        # (a fragment never reaches a server or a proxy's log; the sign-in page removes it)
        print(f"sign in: http://{shown}:{port}/login#token={token}")
    else:
        print(f"token: from ${auth.TOKEN_ENV}; sign in at http://{shown}:{port}/login")
    if not server.loopback:
        print(
            f"bound to {host}, not loopback: anyone who can reach it can ask; the token guards it"
        )
    with contextlib.suppress(KeyboardInterrupt):
        web.run_app(server.app(), host=host, port=port, print=None, access_log=None)
