"""The ``optimizer_foreach`` and ``memory_leak`` rules (issue 57; ``core.findings_more``).

On hand-built figures each fires and stays quiet where it should. On a real 2-rank gloo job
(real torch.profiler, read by ``summarise --advise``): rank 1 steps ``AdamW(foreach=False)`` over
many parameters and is named, rank 0 with ``foreach=True`` is not; in the second window both
use ``foreach=True`` and the rule is quiet. On real Ray ranks sampled by their node agent: a
rank that appends tensors each step is named by ``memory_leak`` through ``advise()``, with its
rate; a steady run gets none.

Run as a script (``python tests/test_findings_more.py OUTDIR PORT``) it is the gloo job."""

from __future__ import annotations

import os
import sys
import time
import uuid
from typing import Any

import msgspec
import pytest

from coordinator.core.findings import window_findings
from coordinator.protocol.summary_codec import HostRow
from tests.gloo_windows import join, profiler, run_job

ACTIVE = 3
LAYERS = 100  # Linear(64, 64) layers: 200 parameters, 1,800 per-parameter ops a step (AdamW)
MiB = 1 << 20


def _table(rows: dict[int, dict[str, float]], step_ms: float = 50.0, device: str = "cpu") -> Any:
    base = {"window_us": step_ms * 1e3 * 3, "compute_us": 1.0, "comm_us": 0.0, "other_us": 0.0}
    return {
        "window": 4, "steps": [10, 11, 12], "ranks": sorted(rows), "device": device,
        "trainer_id": "sft", "run": "run",
        "stragglers": {"median_step_ms": step_ms, "threshold": 1.25,
                       "ranks": {str(r): {"step_ms": step_ms, "compute_ms": 1.0} for r in rows}},
        "breakdown": {"ranks": {str(r): {**base, **v} for r, v in rows.items()}},
    }  # fmt: skip


LOOP = {"optimizer_us_per_step": 9000.0, "optimizer_loop_ops_per_step": 1800.0}
FOREACH = {"optimizer_us_per_step": 5000.0, "optimizer_foreach_ops_per_step": 9.0}


def _by_rule(found: list[Any]) -> dict[str, Any]:
    return {f["rule"]: f for f in found}


def test_optimizer_foreach_fires_on_the_looping_rank_at_its_ops_times_the_saving():
    found, quiet = window_findings(_table({0: FOREACH, 1: LOOP}))
    f = _by_rule(found)["optimizer_foreach"]
    assert f["ranks"] == [1] and not f["all_ranks"]
    assert f["cost_ms_per_step"] == pytest.approx(1.8)  # 1,800 ops x 1.0 us
    assert f["evidence"]["per_parameter_ops_per_step"] == {1: 1800.0}
    assert "foreach=True" in f["advice"] and "fused=True" in f["advice"]
    capped, _ = window_findings(_table({1: LOOP}), settings={"optimizer_foreach": {
        "op_saving_us": 100.0}})  # fmt: skip
    assert _by_rule(capped)["optimizer_foreach"]["cost_ms_per_step"] == pytest.approx(9.0)


def test_optimizer_foreach_s_evidence_is_bounded_on_many_ranks():
    """Over ``EVIDENCE_RANKS`` looping ranks, each per-rank figure lists the costliest only
    (``ranks`` names them all), as every rule's does."""
    from coordinator.core.findings import EVIDENCE_RANKS

    rows = {r: {**LOOP, "optimizer_loop_ops_per_step": 1800.0 + r} for r in range(100)}
    f = _by_rule(window_findings(_table(rows))[0])["optimizer_foreach"]
    assert f["ranks"] == list(range(100)) and f["all_ranks"]
    top = list(range(100 - EVIDENCE_RANKS, 100))
    for key in ("ms_per_step", "per_parameter_ops_per_step", "optimizer_step_ms"):
        assert sorted(f["evidence"][key]) == top, (key, f["evidence"][key])
    assert f["evidence"]["ranks_in_evidence"] == f"the {EVIDENCE_RANKS} costliest of 100"


def test_optimizer_foreach_is_quiet_with_foreach_long_cpu_ops_or_under_the_share():
    assert "optimizer_foreach" in window_findings(_table({0: FOREACH, 1: FOREACH}))[1]
    mixed = {**LOOP, "optimizer_foreach_ops_per_step": 2.0}  # a foreach op: not the loop form
    assert "optimizer_foreach" in window_findings(_table({0: mixed}))[1]
    long_ops = {"optimizer_us_per_step": 90000.0, "optimizer_loop_ops_per_step": 1800.0}
    assert "optimizer_foreach" in window_findings(_table({0: long_ops}))[1]  # 50 us an op, CPU
    cuda = _table({0: long_ops}, device="cuda")  # each op a launch, whatever its length
    assert _by_rule(window_findings(cuda)[0])["optimizer_foreach"]["ranks"] == [0]
    assert "optimizer_foreach" in window_findings(_table({0: LOOP}, step_ms=500.0))[1]  # < 2%
    assert "optimizer_foreach" in window_findings(_table({0: {}}))[1]  # no optimizer step


def test_a_straggler_whose_excess_is_its_optimizer_loop_is_not_named_again():
    t = _table({0: FOREACH, 1: FOREACH, 2: LOOP})
    t["stragglers"]["ranks"]["2"]["step_ms"] = 50.0 + 1.8  # its loop's extra time, no more
    t["stragglers"]["threshold"] = 1.01
    found, _ = window_findings(t, settings={"straggler": {"min_share": 0.0}})
    assert _by_rule(found)["optimizer_foreach"]["ranks"] == [2]
    assert "straggler" not in _by_rule(found), found


def test_a_host_row_written_before_the_optimizer_figures_decodes():
    old = msgspec.msgpack.encode([10.0, 2, 3.0, 4])
    row = msgspec.msgpack.decode(old, type=HostRow)
    assert row.optimizer_us == 0.0 and row.optimizer_loop_ops == 0.0 and row.zero_grad_ops == 4


def _memory(growth: dict[int, float | None], trainer: str = "sft") -> dict[str, Any]:
    node = {"total_bytes": 64 << 30, "available_bytes": 32 << 30, "at": 0.0, "source": "host"}
    ranks = [
        {"trainer_id": trainer, "rank": r, "node_id": "n1", "rss_bytes": 900 * MiB,
         "culprit": rate is not None and len(growth) > 1,
         "growth": None if rate is None else {
             "bytes_per_min": rate, "since": 1000.0, "span_s": 10.0,
             "time_left_s": (32 << 30) / (rate / 60)}}
        for r, rate in growth.items()
    ]  # fmt: skip
    return {"ranks": ranks, "nodes": {"n1": node}}


def test_memory_leak_names_the_marked_rank_with_its_rate_and_the_time_left():
    found, _ = window_findings(_table({0: {}, 1: {}}), memory=_memory({0: None, 1: 60e6}))
    f = _by_rule(found)["memory_leak"]
    assert f["ranks"] == [1] and f["cost_ms_per_step"] == 0.0
    ev = f["evidence"]
    assert ev["mb_per_s"] == {1: 1.0} and ev["mb_per_step"] == {1: 0.05}  # 1 MB/s x 50 ms
    assert ev["rss_mb"] == {1: pytest.approx(943.7)} and ev["node_total_mb"][1] > 68000
    assert ev["time_left_s"][1] == pytest.approx((32 << 30) / 1e6, rel=1e-3)
    assert ev["culprit"] == {1: True}
    assert "Rank 1 grows steadily in host memory" in f["advice"] and "tracemalloc" in f["advice"]
    assert "memory --snapshot" in f["advice"] and "gone in about 573 min" in f["advice"]


def test_memory_leak_is_quiet_without_a_mark_another_trainer_s_or_under_its_floor():
    assert "memory_leak" in window_findings(_table({0: {}}), memory=_memory({0: None}))[1]
    assert "memory_leak" in window_findings(_table({0: {}}))[1]  # no memory read (offline)
    other = _memory({0: 60e6}, trainer="rollout")
    assert "memory_leak" in window_findings(_table({0: {}}), memory=other)[1]
    floor = {"memory_leak": {"min_mib_per_min": 100.0}}
    assert "memory_leak" in window_findings(_table({0: {}}), None, floor, _memory({0: 60e6}))[1]


# --- the real gloo job: AdamW(foreach=False) on rank 1 (first window), foreach=True after


def _rank_main(rank: int, world: int, out: str, port: int) -> None:
    import torch
    import torch.distributed as dist

    join(rank, world, port)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(LAYERS)])
    x, per = torch.randn(8, 64), 1 + ACTIVE
    loop = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=rank == 0)
    batched = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    with profiler(out, rank, ("loop", "foreach"), ACTIVE) as prof:
        for step in range(2 * per):
            opt = loop if step < per else batched
            model(x).sum().backward()
            dist.all_reduce(torch.ones(16))  # (the ranks step together)
            opt.step()
            opt.zero_grad()
            prof.step()
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def optimizer_windows(tmp_path_factory: pytest.TempPathFactory) -> str:
    return run_job(__file__, str(tmp_path_factory.mktemp("foreach")), ("loop", "foreach"), 2)


@pytest.mark.subprocess
def test_optimizer_foreach_names_the_looping_rank_offline_and_is_quiet_with_foreach(
    optimizer_windows, capsys
):
    from tests.test_findings_offline import advise_json, by_rule

    reply = advise_json(capsys, os.path.join(optimizer_windows, "loop"))
    f = by_rule(reply)["optimizer_foreach"]
    assert f["ranks"] == [1], reply
    ops = f["evidence"]["per_parameter_ops_per_step"]["1"]
    assert ops == pytest.approx(9 * 2 * LAYERS, rel=0.05)  # AdamW: 9 ops a parameter
    assert f["cost_ms_per_step"] == pytest.approx(ops * 1e-3, rel=0.01)  # 1 us an op
    step_ms = f["evidence"]["optimizer_step_ms"]["1"]
    assert f["cost_ms_per_step"] < step_ms, f  # the conservative side of the loop's time
    quiet = advise_json(capsys, os.path.join(optimizer_windows, "foreach"))
    assert "optimizer_foreach" in quiet["quiet"], quiet


# --- real Ray ranks: one appends tensors each step


SPAN_S = 10.0
RATE = 3 * MiB  # bytes a second
MEMORY = {"sample_s": 0.2, "leak_span_s": SPAN_S, "leak_min_mib_per_min": 20}


@pytest.fixture(scope="module")
def leakers(ray_session):
    from tests.ray_workers import LeakyWorker

    class Leaker(LeakyWorker):
        def leaky_step(self, bytes_per_s: int, rise_bytes: int = 0) -> int:
            import torch

            self.train_step()
            time.sleep(0.05)
            now = time.monotonic()
            self.leak_from = self.leak_from or now
            owed = int(bytes_per_s * (now - self.leak_from)) - sum(t.numel() for t in self.kept)
            if owed > 0:
                self.kept.append(torch.ones(owed, dtype=torch.uint8))  # type: ignore[arg-type]
            return sum(t.numel() for t in self.kept)

    workers = [ray_session.remote(num_cpus=0)(Leaker).remote() for _ in range(2)]
    ray_session.get([w.pid.remote() for w in workers])
    yield workers
    for w in workers:
        ray_session.kill(w)


def _advise_after(ray: Any, workers: list[Any], tmp_path: Any, rates: tuple[int, int]) -> Any:
    from tests.configs import profiler_config
    from tests.test_memory_real_run import train
    from trainers.hooks import ProfilingHooks

    ray.get([w.reset.remote() for w in workers])
    cfg = profiler_config(tmp_path, wait=10, warmup=1, active=2, repeat=1, memory=MEMORY)
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    hooks = ProfilingHooks.attach(cfg, workers, trainer_id="sft", name=name)
    try:
        memory = train(ray, hooks, workers, SPAN_S * 1.8, rates=rates)
        return ray.get(hooks.coordinator.advise.remote()), memory
    finally:
        ray.kill(hooks.coordinator)


@pytest.mark.ray
def test_memory_leak_names_the_rank_that_keeps_tensors_live(ray_session, leakers, tmp_path):
    reply, memory = _advise_after(ray_session, leakers, tmp_path, (0, RATE))
    f = _by_rule(reply["findings"]).get("memory_leak")
    assert f is not None, (reply, [(r["rank"], r["growth"]) for r in memory["ranks"]])
    assert f["ranks"] == [1] and f["cost_ms_per_step"] == 0.0
    assert f["evidence"]["mb_per_s"][1] == pytest.approx(RATE / 1e6, rel=0.3), f
    assert f["evidence"]["time_left_s"][1] > 0 and f["evidence"]["node_available_mb"][1]


@pytest.mark.ray
def test_memory_leak_is_quiet_on_a_steady_run_live(ray_session, leakers, tmp_path):
    reply, _ = _advise_after(ray_session, leakers, tmp_path, (0, 0))
    assert reply["window"] is not None and "memory_leak" in reply["quiet"], reply


if __name__ == "__main__":  # the job: its two ranks
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(2, sys.argv[1], int(sys.argv[2])), nprocs=2)
