"""One training process with libkineto's daemon mode on, whose windows alternate engines.

    python -m tests.scripts.kineto_rank_run <run dir> <plan json>

The plan: ``{"steps": N, "sleep_s": s, "windows": [[engine, warmup_start, first, last], ...],
"user_profiler_at": k | null}``. Each window is run by a rank profiler of its engine (the local
agent plays the daemon); a ``torch.profiler`` of the script's own runs during step
``user_profiler_at``; ``"schedule"``: the config's (its windows are posted ahead); with
``"no_optimizer"``, no optimizer steps; with ``"finish_s"``, the profilers' ``finish`` is
called after the last step, as a loop's end does, and the windows libkineto had still not
written are said, and the files still queued for the process once the agent is done. Prints
one JSON line: every summary, failure, skip and agent error, and the files left in the run
directory.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

import torch

from coordinator.core.config import ProfilerConfig
from coordinator.core.schedule import Window
from coordinator.protocol.summary_codec import decode_summary
from worker_ext.rank.kineto_rank import kineto_directory, profiler_class


def main(run_dir: str, plan: dict) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64)
    profilers = {}
    for engine in {w[0] for w in plan["windows"]}:
        cfg = ProfilerConfig.from_dict(
            {
                "enable": True,
                "ranks": "all",
                "engine": engine,
                "export_type": "chrome_trace",
                "save_path": os.path.dirname(run_dir),
                **plan.get("schedule", {}),
            }  # fmt: skip
        )
        profilers[engine] = profiler_class(cfg)(0, cfg, run_dir)
    out: dict = {"summaries": [], "failures": [], "skips": [], "errors": [], "closed": []}

    def keep(st: dict) -> None:
        for blob in st["summaries"]:
            s = decode_summary(blob)
            out["summaries"].append(
                {
                    "window": s.window,
                    "steps": list(s.steps),
                    "partial": s.partial,
                    "step_us": [u for _, u in s.step_us],
                    "kernels": {k.name: [k.count, k.self_us] for k in s.kernels},
                }  # fmt: skip
            )
        out["failures"] += [f["message"] for f in st["summary_failures"]]
        if st["closed"]:
            out["closed"].append(st["closed"])
        for key, into in (("last_skip_reason", "skips"), ("last_agent_error", "errors")):
            value = st[key]
            text = value if isinstance(value, str) or value is None else value["message"]
            if text and text not in out[into]:
                out[into].append(text)

    windows = [(e, Window(i, a, b, c)) for i, (e, a, b, c) in enumerate(plan["windows"])]
    for k in range(plan["steps"]):
        for engine, w in windows:
            if k == w.warmup_start:
                keep(profilers[engine].start_window(w, k))
        if k == plan.get("user_profiler_at"):
            user = torch.profiler.profile()
            user.start()
        loss = model(x).sum()
        loss.backward()
        if not plan.get("no_optimizer"):  # (a process that only generates: no step hook)
            opt.step()
        opt.zero_grad()
        if k == plan.get("user_profiler_at"):
            user.stop()
        time.sleep(plan["sleep_s"])
        for rp in profilers.values():
            keep(rp.step(k))
    if plan.get("finish_s") is not None:  # as a loop's end does: then what is left unwritten
        for rp in profilers.values():
            rp.finish(plan["finish_s"])
        out["unwritten"] = sorted(i for rp in profilers.values() for i in (rp._writing or {}))
    for rp in profilers.values():
        keep(rp.wait_for_summaries(90))
    if plan.get("finish_s") is not None:  # (the agent done: what it took back is gone)
        requests = os.path.join(kineto_directory(), "requests")
        out["queued"] = sorted(n for n in os.listdir(requests) if n.startswith(f"{os.getpid()}."))
    out["files"] = sorted(
        os.path.relpath(p, run_dir) for p in glob.glob(os.path.join(run_dir, "**"), recursive=True)
    )
    out["hidden"] = sorted(
        os.path.relpath(p, run_dir)
        for p in glob.glob(os.path.join(run_dir, "**", ".*"), recursive=True)
    )
    out["states"] = {e: rp.status()["state"] for e, rp in profilers.items()}
    out["reasons"] = {e: rp.status()["reason"] for e, rp in profilers.items()}
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
