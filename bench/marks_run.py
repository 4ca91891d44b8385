"""Regression marks on the issue's own steady run, for the docs: `make demo`'s RL trainer (2
policy ranks, a rollout role), a scheduled 3-step window every 44 steps, nothing changed during
the run. Under the old fixed ratio, 7 of the first 10 windows were marked "SLOWER".

Prints, for every window and role, what was judged: the reference, the suspects (beyond their
bar in that window alone), the marks (two windows in a row), and the step ratio against its bar.

    RAY_AUTH_MODE=disabled .venv/bin/python bench/marks_run.py [--windows 24]
"""

from __future__ import annotations

import argparse
import tempfile

import ray

from trainers import ProfilingHooks
from trainers.reference.loops import RunConfig, run_sync_rl
from trainers.reference.workers import make_policy_group, make_rollouts

EVERY = 44  # steps from one window to the next: wait 40, warmup 1, active 3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=24)
    args = ap.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False, namespace="profiler")
    try:
        with tempfile.TemporaryDirectory(prefix="marks-run-") as save:
            policy, rollouts = make_policy_group(2), make_rollouts(1)
            cfg = {
                "enable": True,
                "save_path": save,
                "activities": ["cpu"],
                "export_type": "none",
                "wait": EVERY - 4,
                "warmup": 1,
                "active": 3,
                "repeat": args.windows,
                "roles": {"rollout": {"ranks": [0]}},
            }
            hooks = ProfilingHooks.attach(cfg, policy, trainer_id="rl", name="marks-run")
            run_sync_rl(hooks, policy, rollouts[0], RunConfig(steps=EVERY * args.windows))
            st = _settled(hooks.coordinator)
            print(report(st))
            ray.kill(hooks.coordinator)
    finally:
        ray.shutdown()


def _settled(coord) -> dict:
    import time

    for _ in range(600):
        st = ray.get(coord.status.remote())
        if not any(w["summaries_pending"] for w in st["windows"]):
            return st
        time.sleep(0.1)
    return st


def report(st: dict) -> str:
    """One line per window and role: judged or not, suspects, marks, the step against its bar."""
    lines, marked, suspected, judged = [], 0, 0, 0
    for w in st["windows"]:
        for part in w["roles"].values():
            r = part["regression"]
            if r is None:
                lines.append(f"{w['index']:>3} {part['role']:<8} baseline or before")
                continue
            sus = ", ".join(
                f"{k['name']} x{k['ratio']:.2f} (bar {k['bar']:.2f})" for k in r["suspects"]
            )
            marks = [k["name"] for k in r["kernels"]] + (["step"] if r["step_regressed"] else [])
            judged += r["judged"]
            marked += bool(marks)
            suspected += bool(r["suspects"] or r["step_suspect"])
            step = f"step x{r['step_ratio']}" + (f" (bar {r['step_bar']})" if r["step_bar"] else "")
            lines.append(
                f"{w['index']:>3} {part['role']:<8} {'judged' if r['judged'] else 'learning'} "
                f"{step}; marked {marks or '-'}; suspects {sus or '-'}"
            )
    lines.append(
        f"{judged} role-windows judged: {marked} marked, {suspected} with a suspect; "
        f"counted regressions {st['counters'].get('regressions', 0)}"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
