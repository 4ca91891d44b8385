"""An operator beside an attached job: ``python -m tests.scripts.attach_operator JOB OUT NAME``.

Starts the user's driver (``tests.scripts.attach_job JOB OUT --hook``) with
``RAY_PROFILER_CONFIG`` from this environment, waits for its coordinator (``NAME``) to see
step ``AFTER_STEP`` (with ``--restart``: window 0 closed, then it kills the coordinator's process,
Ray restarts it from its checkpoint, and it waits for ``AFTER_STEP`` more steps), asks for a
capture of 2 steps, reads every rank's stack while the job runs;
then waits for the job and every window's traces, reads ``/api/status`` and a window's table
from ``ray-profiler serve`` (the web view's API), and writes ``{OUT}/operator.json``: the
capture's reply, the stacks, ``status()``, each window's table and the web view's answers.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request

import ray

AFTER_STEP = 8  # rank 0 has reported enough steps for the coordinator to know their pace
CHECKPOINT_S = 2.0  # the coordinator checkpoints a change within a second


def main() -> None:
    job, out, name, restart = sys.argv[1], sys.argv[2], sys.argv[3], "--restart" in sys.argv
    user = subprocess.Popen(
        [sys.executable, "-m", "tests.scripts.attach_job", job, out, "--hook"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    ray.init(address=os.environ["RAY_ADDRESS"], namespace="operator", log_to_driver=False)
    coord, cap, deadline, after = None, None, time.monotonic() + 240, AFTER_STEP
    while cap is None and user.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
        try:
            coord = coord or ray.get_actor(name, namespace="profiler")
        except ValueError:
            continue  # (not made yet: made at the first optimizer step)
        st = ray.get(coord.status.remote())
        step = st["global_step"] or 0
        if restart and [(w["index"], w["rank_count"]) for w in st["windows"]] == [(0, 2)]:
            restart = False  # (window 0 closed on both ranks: no close is in flight)
            time.sleep(CHECKPOINT_S)  # (and its closes are in the checkpoint)
            ray.kill(coord, no_restart=False)  # (as a crash: Ray restarts it from its checkpoint)
            back_up(coord)
            after = step + AFTER_STEP  # (its step clock starts again: a few reports first)
        elif not restart and step >= after:
            cap = ray.get(coord.request_capture.remote(active=2, warmup=1, wait_s=30))
    stacks = ray.get(coord.stacks.remote(timeout_s=30)) if cap is not None else None
    printed, _ = user.communicate(timeout=400)
    assert user.returncode == 0 and "JOB-DONE" in printed, printed[-4000:]
    assert coord is not None and cap is not None, f"the coordinator never saw step {AFTER_STEP}"
    st = ray.get(coord.status.remote())
    for w in st["windows"]:
        ray.get(coord.wait_window.remote(w["index"], until="traces", timeout_s=60))
    st = ray.get(coord.status.remote(ranks="all"))
    tables = {
        w["index"]: ray.get(coord.kernel_summary.remote(window=w["index"], top_k=5))
        for w in st["windows"]
    }
    web = web_view(name, st["windows"][-1]["index"])
    with open(os.path.join(out, "operator.json"), "w") as f:
        json.dump({"capture": cap, "stacks": stacks, "status": st, "tables": tables,
                   "web": web}, f, default=str)  # fmt: skip
    ray.kill(coord)
    print("OPERATOR-DONE", flush=True)


def back_up(coord: object) -> None:
    """Until the coordinator answers as restarted (``ray.kill`` returns before the kill lands;
    at most 120 s)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            if ray.get(coord.ping.remote(), timeout=10)["restarts"] >= 1:  # type: ignore[attr-defined]
                return
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, "the coordinator did not come back"
        time.sleep(0.5)


def web_view(name: str, window: int) -> dict:
    """``ray-profiler serve`` on a free loopback port: its ``/api/status`` and the window's
    ``/api/windows/N/kernels``, as a browser's page reads them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_urlsafe(16)  # (every read of the run needs it, on loopback too)
    serve = subprocess.Popen(
        [sys.executable, "-m", "coordinator", "--name", name, "serve", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "RAY_PROFILER_TOKEN": token},
    )  # fmt: skip
    try:
        base, got, deadline = f"http://127.0.0.1:{port}", {}, time.monotonic() + 90
        for path in ("/api/status", f"/api/windows/{window}/kernels?top_k=5"):
            while path not in got:
                try:
                    req = urllib.request.Request(
                        base + path, headers={"Authorization": f"Bearer {token}"}
                    )
                    with urllib.request.urlopen(req, timeout=30) as r:
                        got[path] = json.loads(r.read())
                except OSError:
                    assert time.monotonic() < deadline and serve.poll() is None, "no web view"
                    time.sleep(0.5)
        return got
    finally:
        serve.terminate()
        serve.wait(timeout=30)


if __name__ == "__main__":
    main()
