"""The CUDA memory paths, checked on a GPU machine in one command (this project's CPU machine
tests them with torch's CUDA memory calls replaced).

    .venv/bin/python bench/memory_check_gpu.py [--out DIR]

Each check prints PASS or FAIL with what it saw; the exit status is 1 when one fails:

1. ``window``: history recorded for a window, the snapshot written beside its trace, loadable,
   with the window's allocations in it; history off again after.
2. ``demand``: a snapshot asked through the demand pipe, as the node agent asks.
3. ``oom``: an allocation past the device's memory: the observer writes the snapshot before
   torch raises ``OutOfMemoryError``, and notes it for the agent.
4. ``nvml``: the node agent's sampler reads this process's GPU memory through NVML.
5. ``profile_memory``: a CUDA window's ``[memory]`` events summarised: the device peak, the step
   it fell in, bytes allocated and freed, the top allocating op.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from coordinator.core.memory_config import MemorySnapshot
from worker_ext.agent.memory_sampler import (
    MemorySampler,
    ask_for_snapshot,
    memory_dir,
)
from worker_ext.agent.trace_summary import summarise_trace
from worker_ext.rank.memory_snapshot import MemorySnapshots

MiB = 1 << 20
RESULTS: list[tuple[str, bool, str]] = []


def check(name: str) -> Callable[[Callable[[str], str]], Callable[[str], None]]:
    def wrap(fn: Callable[[str], str]) -> Callable[[str], None]:
        def run(out: str) -> None:
            try:
                RESULTS.append((name, True, fn(out)))
            except Exception as exc:  # a failed check is reported, the others still run
                RESULTS.append((name, False, f"{type(exc).__name__}: {exc}"))

        return run

    return wrap


def load(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        snap: dict[str, Any] = pickle.load(f)
    assert "segments" in snap and "device_traces" in snap, sorted(snap)
    return snap


@check("window")
def window(out: str) -> str:
    cfg = MemorySnapshot(on=["window"], max_entries=100_000).validate()
    snaps = MemorySnapshots(cfg, "cuda", 0, out)
    snaps.window_started()
    kept = [torch.empty(64 * MiB, dtype=torch.uint8, device="cuda") for _ in range(3)]
    path = snaps.window_ended(os.path.join(out, "window_0000_steps_1-2", "policy"))
    assert path is not None and path.endswith("rank0.memory.pickle"), path
    snap = load(path)
    events = sum(len(t) for t in snap["device_traces"])
    assert events >= 3, f"{events} trace events"
    assert not snaps.recording
    del kept
    return f"{path} ({os.path.getsize(path)} bytes, {events} allocator events)"


@check("demand")
def demand(out: str) -> str:
    MemorySnapshots(MemorySnapshot(on=["demand"]).validate(), "cuda", 0, out)
    target = os.path.join(out, "memory", "demand-001", "policy", "rank0.memory.pickle")
    why = ask_for_snapshot(os.getpid(), target)
    assert why is None, why
    deadline = time.monotonic() + 30
    while not os.path.exists(target) and time.monotonic() < deadline:
        time.sleep(0.1)
    load(target)
    return target


@check("oom")
def oom(out: str) -> str:
    MemorySnapshots(MemorySnapshot(on=["oom"]).validate(), "cuda", 0, out)
    free, _total = torch.cuda.mem_get_info()
    try:
        torch.empty(free * 4, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        pass
    else:
        raise AssertionError("no OutOfMemoryError")
    folder = os.path.join(out, "memory", "policy")
    files = [f for f in os.listdir(folder) if f.startswith("rank0.oom-")]
    assert files, f"no OOM snapshot in {folder}"
    load(os.path.join(folder, files[0]))
    notes = (memory_dir() / f"{os.getpid()}.snapshots.jsonl").read_text()
    assert '"on": "oom"' in notes, notes
    return os.path.join(folder, files[0])


@check("nvml")
def nvml(out: str) -> str:
    held = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    sampler = MemorySampler("gpu-check")
    watch = {"targets": [{"pid": os.getpid()}], "sample_s": 0.1}
    first = sampler.watch(watch)  # type: ignore[arg-type]
    time.sleep(1.0)
    got = sampler.watch(watch)  # type: ignore[arg-type]
    sampler.close()
    assert first["gpu"] is None, first["gpu"]
    gpu = [s[3] for s in got["processes"][0]["samples"]]
    assert gpu and all(g is not None and g >= 256 * MiB for g in gpu), gpu[:3]
    del held
    return f"{len(gpu)} samples, GPU memory {gpu[-1] / MiB:.0f} MiB"


@check("profile_memory")
def profile_memory(out: str) -> str:
    from torch.profiler import ProfilerAction, ProfilerActivity, profile

    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
    x = torch.randn(256, 1024, device="cuda")
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
        profile_memory=True,
        schedule=lambda _: ProfilerAction.RECORD,
    ) as prof:
        prof.step_num = 5
        for _ in range(3):
            model(x).sum().backward()
            prof.step()
    path = os.path.join(out, "cuda_window.json")
    prof.export_chrome_trace(path)
    s, _ = summarise_trace(
        path, rank=0, window=0, steps=(5, 7), partial=False, device="cuda", top_k=5
    )
    assert s.peak_bytes and s.peak_bytes > 4 * MiB, s.peak_bytes
    assert s.memory_flow is not None and s.memory_flow[1] > 0, s.memory_flow
    assert s.memory and s.memory[0].bytes > 0
    return (
        f"peak {s.peak_bytes / MiB:.1f} MiB in step {s.memory_flow[0]}, allocated "
        f"{s.memory_flow[1] / MiB:.1f} MiB, freed {s.memory_flow[2] / MiB:.1f} MiB, top op "
        f"{s.memory[0].name}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None, help="where the snapshots go (default: a temp dir)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: run this on a GPU machine")
        return 2
    out = args.out or tempfile.mkdtemp(prefix="memory-check-gpu-")
    os.environ.setdefault("RAY_PROFILER_NODE_DIR", os.path.join(out, "node"))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, files in {out}")
    for run in (window, demand, nvml, profile_memory, oom):  # the OOM last: it fills the device
        run(out)
    for name, ok, said in RESULTS:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {said}")
    return 0 if all(ok for _, ok, _ in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
