"""What the run page's chart of the step time over the run costs, for 100,000 and 1,000,000
steps: the coordinator's side (``step_series``) and the drawing in a real headless Chromium.

- **Coordinator.** A ``PhaseLog`` of N steps (two regions, a spike) holds the last 10,000 steps
  exactly and 100-step buckets before them. Baseline: ``phase_times`` asked for all of it
  (``reply(last=10000, buckets=10000)``, what a chart would have to fetch without the series).
  Measured: ``step_series(points=1000)``. Seconds (the best of 5) and JSON bytes of each.
- **Browser.** The web view's own ``drawRunChart`` (served by ``ray-profiler serve``'s static
  files, no coordinator needed) on that series, a 2-step window every 1,000 steps (100 bands
  at 100k steps) and a stall; baseline: a bare Chart.js line of the same 1,000 points. The
  median of 7 draws, each into a fresh canvas.

    .venv/bin/python bench/run_chart.py [--steps 100000 1000000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from coordinator.core.phases import PhaseLog  # noqa: E402
from coordinator.core.step_series import step_series  # noqa: E402
from coordinator.ops.run_chart import run_chart  # noqa: E402

BARE = """c => { const box = document.createElement('div'); box.className = 'chart';
  document.body.append(box); const canvas = document.createElement('canvas'); box.append(canvas);
  const t0 = performance.now();
  const made = new Chart(canvas, { type: 'line', data: { datasets: [{ label: 'step',
    pointRadius: 0, data: c.series.points.map(p => ({ x: (p.first + p.last) / 2, y: p.mean_ms }))
  }] }, options: { animation: false, responsive: true, maintainAspectRatio: false,
    parsing: false, normalized: true, scales: { x: { type: 'linear' } } } });
  const ms = performance.now() - t0; made.destroy(); box.remove(); return ms; }"""
OURS = """c => { const box = document.createElement('div'); box.className = 'chart';
  document.body.append(box); const t0 = performance.now(); const made = drawRunChart(box, c);
  const ms = performance.now() - t0; made.destroy(); box.remove(); return ms; }"""


def make_log(steps: int) -> PhaseLog:
    log = PhaseLog()
    for start in range(0, steps, 10_000):
        log.add(
            [
                [k, 0.9 if k == steps // 3 else 0.1, {"generate": 0.05, "train": 0.03}]
                for k in range(start, min(steps, start + 10_000))
            ]
        )
    return log


def best(fn, n: int = 5) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def chart_of(log: PhaseLog, steps: int) -> dict:
    windows = [
        {"index": i, "kind": "scheduled", "steps": [k + 500, k + 501], "partial": False,
         "stragglers": [], "roles": {}, "regression": None}
        for i, k in enumerate(range(0, steps, 1_000))
    ]  # fmt: skip
    stall = {"index": 1, "trainer_id": "t", "last_step": steps // 2, "resumed_step": None,
             "detected_at": 0.0, "resumed_at": None}  # fmt: skip
    return run_chart(step_series(log, 1_000), {"windows": windows, "stalls": [stall]})


def serve_static() -> tuple[str, str, object]:
    """The web view's server on a free loopback port with no coordinator behind it: its static
    pages and scripts answer, its API 503s. Its address and its token (a fresh one: every read
    of the run needs it, on loopback too, so the page signs in first)."""
    from aiohttp import web

    from coordinator.ops.web.server import CoordinatorLink, Unavailable, WebServer
    from tests.s3_server import free_port

    class NoCoordinator(CoordinatorLink):
        """Every API call 503s at once (no Ray: the pages only need their scripts here)."""

        def handle(self) -> None:
            raise Unavailable("no coordinator in this benchmark")

        async def call(self, method: str, *args: object, **kw: object) -> None:
            raise Unavailable("no coordinator in this benchmark")

    port = free_port()
    token = "run-chart-" + os.urandom(8).hex()
    server = WebServer(NoCoordinator("none", "none"), token, "127.0.0.1", port)
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(server.app(), access_log=None)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        ready.set()
        loop.run_forever()

    threading.Thread(target=run, daemon=True).start()
    assert ready.wait(30)
    return f"http://127.0.0.1:{port}", token, loop


def draw_times(url: str, token: str, charts: dict[int, dict]) -> dict[int, tuple[float, float]]:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    out = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        # sign in as ``serve``'s printed address does (the token in the fragment, posted by
        # the sign-in page), else the page's first API read sends it to /login
        page.goto(f"{url}/login#token={token}")
        page.wait_for_url(url + "/")
        page.wait_for_function("typeof drawRunChart === 'function'")
        for steps, chart in charts.items():
            bare = [page.evaluate(BARE, chart) for _ in range(7)]
            ours = [page.evaluate(OURS, chart) for _ in range(7)]
            out[steps] = (statistics.median(bare), statistics.median(ours))
        browser.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, nargs="+", default=[100_000, 1_000_000])
    args = ap.parse_args()
    charts = {}
    print("| steps | phase_times (all) | step_series(1000) | ratio | bytes all / series |")
    print("|---|---|---|---|---|")
    for steps in args.steps:
        log = make_log(steps)
        full = best(lambda log=log: log.reply(last=10_000, buckets=10_000))
        series = best(lambda log=log: step_series(log, 1_000))
        big = len(json.dumps(log.reply(last=10_000, buckets=10_000)))
        small = len(json.dumps(step_series(log, 1_000)))
        print(
            f"| {steps:,} | {full * 1e3:.1f} ms | {series * 1e3:.1f} ms | {series / full:.2f}x | "
            f"{big / 1e6:.2f} MB / {small / 1e3:.0f} KB |"
        )
        charts[steps] = chart_of(log, steps)
    url, token, _ = serve_static()
    print("\n| steps | bare Chart.js line (baseline) | the run chart | ratio | bands |")
    print("|---|---|---|---|---|")
    for steps, (bare, ours) in draw_times(url, token, charts).items():
        bands = len(charts[steps]["windows"])
        print(f"| {steps:,} | {bare:.0f} ms | {ours:.0f} ms | {ours / bare:.2f}x | {bands:,} |")


if __name__ == "__main__":
    main()
