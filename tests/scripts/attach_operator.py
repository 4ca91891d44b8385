"""An operator beside an attached job: ``python -m tests.scripts.attach_operator JOB OUT NAME``.

Starts the user's driver (``tests.scripts.attach_job JOB OUT --hook``) with
``RAY_PROFILER_CONFIG`` from this environment, waits for its coordinator (``NAME``) to see
step ``AFTER_STEP``, asks for a capture of 2 steps, waits for the job and every window's traces, and
writes ``{OUT}/operator.json``: the capture's reply, ``status()`` and each window's table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import ray

AFTER_STEP = 8  # rank 0 has reported enough steps for the coordinator to know their pace


def main() -> None:
    job, out, name = sys.argv[1], sys.argv[2], sys.argv[3]
    user = subprocess.Popen(
        [sys.executable, "-m", "tests.scripts.attach_job", job, out, "--hook"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    ray.init(address=os.environ["RAY_ADDRESS"], namespace="operator", log_to_driver=False)
    coord, cap, deadline = None, None, time.monotonic() + 240
    while cap is None and user.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
        try:
            coord = coord or ray.get_actor(name, namespace="profiler")
        except ValueError:
            continue  # (not made yet: made at the first optimizer step)
        if (ray.get(coord.status.remote())["global_step"] or 0) >= AFTER_STEP:
            cap = ray.get(coord.request_capture.remote(active=2, warmup=1, wait_s=30))
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
    with open(os.path.join(out, "operator.json"), "w") as f:
        json.dump({"capture": cap, "status": st, "tables": tables}, f, default=str)
    ray.kill(coord)
    print("OPERATOR-DONE", flush=True)


if __name__ == "__main__":
    main()
