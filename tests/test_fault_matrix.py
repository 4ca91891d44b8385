"""The fault matrix: every fault, on one rank and on all ranks, against the same SFT training.

Each case asserts that training finishes all its steps with losses bit-identical to an
unprofiled run of the same seed, that the healthy ranks' traces of every window are there and
parse, that ``status()`` names the fault, the rank and the place, and that nothing is left
running: no torch profiler, no actor besides the coordinator. The table prints at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests import fault_cases as fc
from tests.configs import ROOT, profiler_config
from trainers.hooks import ProfilingHooks
from trainers.reference.workers import PolicyWorker

RESULTS: dict[tuple[str, str], str] = {}
ONE, ALL = "one rank", "all ranks"

# fault -> (the state a faulted rank ends in, the place status() names for it)
RANK_FAULTS = {
    "begin": ("disabled", "start_window"),
    "step": ("disabled", "step"),
    "end": ("disabled", "step"),  # a window closes inside the step that ends it
    "export": ("disabled", "export"),
    "summary": ("ok", "summary"),  # costs that window's summary only; the rank profiles on
    "unwritable": ("disabled", "export"),
    "disk_full": ("disabled", "export"),
    "hang": ("unresponsive", "profile_step"),
    "kill": ("lost", "profile_step"),
}


@pytest.fixture(scope="module")
def ranks(ray_session):
    """Two SFT ranks for the cases that leave them alive (killed ones are made per case)."""
    made = [make_rank(ray_session, r) for r in range(2)]
    yield made
    for w in made:
        ray_session.kill(w)


def make_rank(ray, rank):
    return ray.remote(num_cpus=0)(PolicyWorker).remote(rank, 1, fc.SEED)


@pytest.fixture(scope="module")
def baseline(ray_session, ranks):
    """The losses of the same training, unprofiled."""
    hooks = ProfilingHooks.attach({"enable": False}, ranks)
    out = fc.train(ray_session, ranks, hooks)
    assert out.steps_run == fc.STEPS
    return out.losses


def attach(tmp_path, workers, **kw):
    cfg = profiler_config(tmp_path, **{**fc.SCHEDULE, "worker_timeout_s": 20.0, **kw})
    name = f"fm-{uuid.uuid4().hex[:8]}"
    return ProfilingHooks.attach(cfg, workers, trainer_id="sft", name=name, namespace="fm")


def check(ray, out, baseline, hooks, faulted, healthy, state, where, before_actors):
    """The four promises of every case."""
    assert out.steps_run == fc.STEPS
    for r, losses in out.losses.items():  # bit-identical, for every step each rank ran
        assert losses == baseline[r][: len(losses)], r
        if r in healthy:
            assert len(losses) == fc.STEPS
    st = fc.wait_for_windows(ray, hooks.coordinator)
    recorded = [w for w in st["windows"] if w["steps"]]
    assert recorded or not healthy, "no window recorded"
    for w in recorded:
        assert fc.traces_parse(w, [r for r in healthy if r in w["ranks"]]) == []
        assert set(healthy) <= set(w["ranks"]) or w["partial"], w
    ranks = {r["rank"]: r for r in st["ranks"]}
    for r in faulted:
        rec = ranks[r]
        assert rec["state"] == state, rec
        if state == "ok":  # a lost summary: the rank says where, the window says why
            err = rec["last_agent_error"]
            assert err["where"] == where and "not a valid chrome trace" in err["message"]
            for w in recorded:
                ks = ray.get(hooks.coordinator.kernel_summary.remote(window=w["index"]))
                assert "not a valid chrome trace" in ks["bad_ranks"][r], ks["bad_ranks"]
        else:
            assert rec["reason"]["where"] == where, rec["reason"]
            assert rec["reason"]["message"], rec["reason"]
    for r in healthy:
        assert ranks[r]["state"] == "ok", ranks[r]
    assert not any(out.profiler_running.values()), out.profiler_running
    assert all(s["phase"] == "idle" for s in out.rank_status.values())
    leftover = fc.alive_actors(ray) - before_actors - {hooks.coordinator._actor_id.hex()}
    assert leftover == set(), leftover


@pytest.mark.parametrize("scope", [ONE, ALL])
@pytest.mark.parametrize("fault", sorted(RANK_FAULTS))
def test_rank_fault(ray_session, ranks, baseline, tmp_path, fault, scope):
    ray = ray_session
    RESULTS[(fault, scope)] = "FAIL"
    killing = fault == "kill"
    workers = [make_rank(ray, r) for r in range(2)] if killing else ranks
    faulted = [1] if scope == ONE else [0, 1]
    healthy = [r for r in range(2) if r not in faulted]
    before = fc.alive_actors(ray, starting_too=True)
    hooks = attach(tmp_path, workers, worker_timeout_s=3.0 if fault == "hang" else 20.0)
    at_step = {}
    try:
        if fault in ("begin", "step", "end", "export", "summary", "disk_full"):
            ray.get([workers[r].__ray_call__.remote(fc._inject, fault) for r in faulted])
        elif fault == "unwritable":  # after window 0 (steps 2-3): window 1 cannot be written
            at_step[4] = lambda: ray.get(
                [workers[r].__ray_call__.remote(fc._inject, fault, str(tmp_path)) for r in faulted]
            )
        elif fault == "hang":  # the rank answers profile_step after worker_timeout_s
            ray.get([workers[r].__ray_call__.remote(fc._inject, fault, 4.5) for r in faulted])
        elif fault == "kill":  # inside window 1, which records steps 6-7
            at_step[6] = lambda: [ray.kill(workers[r]) for r in faulted]
        out = fc.train(ray, workers, hooks, at_step)
        state, where = RANK_FAULTS[fault]
        check(ray, out, baseline, hooks, faulted, healthy, state, where, before)
        RESULTS[(fault, scope)] = "pass"
    finally:
        if not killing:
            ray.get([w.__ray_call__.remote(fc._undo) for w in workers])
        for w in workers if killing else []:
            ray.kill(w)
        ray.kill(hooks.coordinator)


def test_coordinator_killed(ray_session, ranks, baseline, tmp_path):
    """SIGKILL inside window 0: Ray restarts it, the hooks go on, window 1 is captured."""
    ray = ray_session
    RESULTS[("coordinator", "-")] = "FAIL"
    before = fc.alive_actors(ray, starting_too=True)
    hooks = attach(tmp_path, ranks, worker_timeout_s=5.0)
    coord = hooks.coordinator

    def kill():
        os.kill(ray.get(coord.status.remote())["process"]["pid"], signal.SIGKILL)
        time.sleep(4)  # a long step: Ray restarts the coordinator meanwhile

    try:
        out = fc.train(ray, ranks, hooks, {2: kill})
        check(ray, out, baseline, hooks, [], [0, 1], "ok", "", before)
        st = ray.get(coord.status.remote())
        assert st["restarts"] == 1
        cut, later = st["windows"][0], [w for w in st["windows"][1:] if w["steps"]]
        assert "the coordinator restarted inside the window" in cut["reason"]
        assert later and later[0]["ranks"] == [0, 1] and later[0]["kept"]
        RESULTS[("coordinator", "-")] = "pass"
    finally:
        ray.kill(coord)


def test_node_removed(baseline):
    """A node with one rank (or both) goes mid-window: cluster_utils, in a subprocess."""
    RESULTS[("node removed", ONE)] = RESULTS[("node removed", ALL)] = "FAIL"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.scripts.node_fault_run"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "RAY_AUTH_MODE": "disabled"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    for scope, faulted in ((ONE, ["1"]), (ALL, ["0", "1"])):
        case = out[scope]
        assert case["steps_run"] == fc.STEPS
        for r, losses in case["losses"].items():
            assert losses == baseline[int(r)][: len(losses)], (scope, r)
        for r in faulted:
            assert case["ranks"][r]["state"] == "lost", case["ranks"][r]
        for r in set(case["ranks"]) - set(faulted):
            assert case["ranks"][r]["state"] == "ok" and len(case["losses"][r]) == fc.STEPS
        assert case["trace_problems"] == [] and not any(case["profiler_running"].values())
        assert case["leftover"] == []
        RESULTS[("node removed", scope)] = "pass"


def matrix_table() -> str:
    """The fault x scope table of this run (printed at the end of the test session)."""
    faults = [*sorted(RANK_FAULTS), "coordinator", "node removed"]
    lines = [f"{'fault':<14} {ONE:<10} {ALL:<10}", f"{'-' * 14} {'-' * 10} {'-' * 10}"]
    for f in faults:
        one = RESULTS.get((f, ONE), RESULTS.get((f, "-"), "not run"))
        both = RESULTS.get((f, ALL), "n/a" if (f, "-") in RESULTS else "not run")
        lines.append(f"{f:<14} {one:<10} {both:<10}")
    return "\n".join(lines)
