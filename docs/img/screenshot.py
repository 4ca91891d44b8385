"""Remake docs/img's screenshots from real runs, in headless Chromium (Debian's chromium).

- window.png: a private Ray head, `make demo` joining it (the coordinator stays alive),
  `ray-profiler serve`, then the window page.
- run.png, perfetto.png and strip.png: the web tests' real run (2 ranks under torch.profiler,
  two windows, then stalled after step 7: tests/test_web.py's ``served``): the run page with
  its chart, the served Perfetto with the merged two-rank window, and the step strip of 100
  ranks (one slow). The tests write them here when ``RAY_PROFILER_DOCS_IMG`` is set.

    .venv/bin/python docs/img/screenshot.py        # about two minutes
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable


def main() -> None:
    tmp = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # short: Ray's socket paths are capped
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": ROOT}
    port, web = 6391, 8279
    head = [PY, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}"]
    head += ["--num-cpus=8", "--include-dashboard=false", f"--temp-dir={tmp}"]
    # its own process group: this cluster is stopped, and no other
    ray = subprocess.Popen(head, env=env, stdout=subprocess.DEVNULL, start_new_session=True)
    address = f"127.0.0.1:{port}"
    server = None
    try:
        time.sleep(15)
        demo = [PY, "-m", "trainers.demo", "--address", address, "--trainer", "rl"]
        demo += ["--steps", "16", "--save-path", f"{tmp}/profiles"]
        subprocess.run(demo, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        cli = [PY, "-m", "coordinator", "--address", address, "serve", "--port", str(web)]
        token = "screenshot-" + os.urandom(8).hex()  # (every read of the run needs it)
        server = subprocess.Popen(cli, env={**env, "RAY_PROFILER_TOKEN": token}, cwd=ROOT,
                                  stdout=subprocess.DEVNULL)  # fmt: skip
        url = f"http://127.0.0.1:{web}"
        for _ in range(120):
            try:
                urllib.request.urlopen(url + "/login", timeout=5)
                break
            except OSError:
                time.sleep(0.5)
        shoot(url, token, os.path.join(ROOT, "docs", "img", "window.png"))
        tests = [PY, "-m", "pytest", "-q", "tests/test_web.py", "-k"]
        tests += ["charts_the_step_time or perfetto_shows_one_process or strips_every"]
        img = {"RAY_PROFILER_DOCS_IMG": os.path.join(ROOT, "docs", "img")}
        subprocess.run(tests, env={**env, **img}, cwd=ROOT, check=True)
    finally:
        if server is not None:
            server.terminate()
        os.killpg(ray.pid, signal.SIGTERM)
        time.sleep(5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(ray.pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


def shoot(url: str, token: str, out: str) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(f"{url}/login#token={token}")  # (the sign-in address serve prints)
        page.wait_for_url(url + "/")
        page.goto(url + "/#/window/1")
        page.wait_for_selector("text=Rank x top kernel", timeout=60_000)
        page.wait_for_timeout(500)
        page.screenshot(path=out, full_page=True)
        browser.close()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
