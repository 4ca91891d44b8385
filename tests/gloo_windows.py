"""A real gloo job of a few ranks whose profiler writes each window's traces to a folder of
its own (``<out>/<name>/rank<r>.json``): what the offline findings tests read."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def join(rank: int, world: int, port: int) -> None:
    """Join the gloo group on ``port`` (one torch thread a rank: the ranks share a few cores)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def profiler(out: str, rank: int, folders: tuple[str, ...], active: int) -> Any:
    """A CPU ``torch.profiler.profile`` of ``len(folders)`` windows of one warm-up step and
    ``active`` recorded steps, writing window n's trace to ``out/folders[n]/rank<rank>.json``."""
    from torch.profiler import ProfilerActivity, profile, schedule

    names = iter(folders)

    def export(p: Any) -> None:
        folder = os.path.join(out, next(names))
        os.makedirs(folder, exist_ok=True)
        p.export_chrome_trace(os.path.join(folder, f"rank{rank}.json"))

    return profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=1, active=active, repeat=len(folders)),
        on_trace_ready=export,
    )


def run_job(script: str, out: str, folders: tuple[str, ...], world: int) -> str:
    """Run ``script OUT PORT`` (the job) on a free port; check it wrote every rank's trace of
    each of ``folders``; ``out``."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # (free again for the job's rank 0)
    argv = [sys.executable, os.path.abspath(script), out, str(port)]
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    traces = [f"rank{r}.json" for r in range(world)]
    for name in folders:
        assert sorted(os.listdir(os.path.join(out, name))) == traces
    return out
