"""``status()["findings"]`` and the tracker's findings, without Ray (issue 57): each trainer's
entry bounded (3 findings, ranks as the evidence bounds them), a window's findings made once
per change of the window and kept, bounded, and a rule that raises said as a problem line."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from coordinator.core import findings as rules
from coordinator.core.config import ProfilerConfig
from coordinator.core.findings import EVIDENCE_RANKS, window_findings
from coordinator.core.records import TrainerRecord
from coordinator.core.run import new_run
from coordinator.core.schedule import Window
from coordinator.core.state import kernel_summary
from coordinator.core.tracker_figures import finding_figures, findings_text
from coordinator.protocol.summary_codec import KernelRow, RankSummary, encode_summary
from coordinator.service.status_findings import MAKING, REMAKING, FindingCache, bounded

SLOW_RANK, STEP_US, SLOW_US = 1, 10_000.0, 20_000.0  # rank 1: twice the median step


def finding(rule: str, cost: float, ranks: list[int]) -> dict:
    top = sorted(ranks)[-EVIDENCE_RANKS:]  # (the costliest: the highest ranks, here)
    return {
        "rule": rule, "ranks": ranks, "all_ranks": False, "steps": [1, 2],
        "cost_ms_per_step": cost, "evidence": {"ms_per_step": {r: 1.0 for r in top}},
        "advice": f"fix {rule}", "where": {"window": 0, "page": "#/window/0"},
    }  # fmt: skip


def reply(found: list[dict], problems: list[str] | None = None) -> dict:
    return {
        "run": "r", "window": 0, "steps": [1, 2], "trainer_id": "t", "role": "policy",
        "findings": found, "quiet": ["memory_peak"], "problems": problems or [],
    }  # fmt: skip


def test_an_entry_lists_the_three_costliest_its_ranks_bounded_as_the_evidence():
    many = list(range(1024))
    got = bounded(reply([finding("exposed_comm", 9.0, many), finding("straggler", 5.0, [3]),
                         finding("gpu_idle", 2.0, [0, 1]), finding("launch_bound", 1.0, [2])],
                        problems=[f"p{i}" for i in range(10)]))  # fmt: skip
    assert [f["rule"] for f in got["findings"]] == ["exposed_comm", "straggler", "gpu_idle"]
    assert got["findings_total"] == 4 and len(got["problems"]) == 4
    wide = got["findings"][0]
    assert wide["ranks"] == list(range(1024 - EVIDENCE_RANKS, 1024)) and wide["ranks_total"] == 1024
    assert set(wide) == {"rule", "ranks", "ranks_total", "all_ranks", "cost_ms_per_step", "advice"}
    assert (got["window"], got["trainer_id"], got["role"]) == (0, "t", "policy")


def test_the_tracker_gets_each_rule_s_cost_a_quiet_rule_as_zero_and_a_table_of_text():
    r = reply([finding("straggler", 5.0, [3])])
    assert finding_figures(r) == {
        "profiler/finding/straggler_ms_per_step": 5.0,
        "profiler/finding/memory_peak_ms_per_step": 0.0,
        "profiler/findings": 1.0,
    }
    assert finding_figures({**r, "role": "rollout"})["profiler/rollout/findings"] == 1.0
    assert finding_figures(reply([], ["the findings could not be made: X"]) | {"quiet": []}) == {}
    text = findings_text([bounded(r)])
    assert "| policy | 5 | straggler | 3 | fix straggler |" in text.splitlines()


def run_with_window(index: int = 0, pending: bool = False):
    """A run whose trainer ``t`` of two ranks closed window ``index``, rank 1 twice as slow
    (summaries ingested as the coordinator ingests them; ``pending``: rank 1's not yet)."""
    run = new_run(ProfilerConfig(max_windows=4), set())
    run.state.register(TrainerRecord("t", "policy", [0, 1], {}, None), None, lambda r: True)
    add_window(run, index, pending)
    return run


def add_window(run, index: int, pending: bool = False):
    keys = [("t", 0), ("t", 1)]
    rec = run.state.open_window(Window(index, 10 * index, 10 * index + 1, 10 * index + 2), keys)
    for key in keys[: 1 if pending else 2]:
        ingest(run, key, index)
    run.state.close_window(rec)
    return rec


def ingest(run, key, index: int) -> None:
    us = SLOW_US if key[1] == SLOW_RANK else STEP_US
    rows = [KernelRow("aten::mm", us * 0.9, 2, 0)]
    steps = [(10 * index + 1, us), (10 * index + 2, us)]
    summary = RankSummary(key[1], index, (10 * index + 1, 10 * index + 2), False, "cpu", rows,
                          step_us=steps)  # fmt: skip
    run.state.ingest_summary(key, encode_summary(summary))


def advise_of(target):
    """``advise()``'s reply as the coordinator makes it, from ``target``'s own state."""

    async def advise(window: int, trainer_id: str, run: str) -> dict:
        table = kernel_summary(target.state, window, 0, trainer_id, False, "kernel")
        found, quiet = window_findings(table, None, {})
        return {"run": run, "window": table["window"], "steps": table["steps"],
                "trainer_id": trainer_id, "role": table["role"], "findings": found,
                "quiet": quiet, "problems": []}  # fmt: skip

    return advise


async def settled(cache: FindingCache, run) -> list:
    """``status()``'s findings once what a poll has had made is made."""
    await cache.latest(run)
    await asyncio.gather(*list(cache._making.values()))
    return await cache.latest(run)


def test_a_window_s_findings_are_made_in_the_background_once_and_again_when_it_changes():
    run = run_with_window(pending=True)
    cache = FindingCache(advise_of(run), kept=2)

    async def first_polls() -> list:
        (now,) = await cache.latest(run)  # never waits for the rules: says they are coming
        assert now["findings"] == [] and now["problems"] == [MAKING] and cache.made == 0
        assert now["window"] == 0 and now["trainer_id"] == "t"
        return [await settled(cache, run) for _ in range(3)][-1]

    first = asyncio.run(first_polls())
    assert cache.made == 1 and first[0]["findings_total"] == 0  # (one rank: no straggler)
    assert first[0]["problems"] == []
    ingest(run, ("t", 1), 0)  # the slow rank's summary comes

    async def changed() -> list:
        (stale,) = await cache.latest(run)  # the kept ones meanwhile, said to be remade
        assert stale["problems"] == [REMAKING] and stale["findings_total"] == 0, stale
        return [await settled(cache, run) for _ in range(3)][-1]

    (entry,) = asyncio.run(changed())
    assert cache.made == 2, "made again once the window changed, then kept"
    assert [(f["rule"], f["ranks"]) for f in entry["findings"]] == [("straggler", [SLOW_RANK])]
    assert entry["findings"][0]["cost_ms_per_step"] == pytest.approx(
        (SLOW_US - (SLOW_US + STEP_US) / 2) / 1e3, rel=0.05
    )

    async def together() -> list:  # (polled twice at once: made once)
        add_window(run, 1)
        a, b = await asyncio.gather(cache.latest(run), cache.latest(run))
        assert a == b
        return await settled(cache, run)

    (a,) = asyncio.run(together())
    assert a["window"] == 1 and cache.made == 3 and not a["problems"]
    add_window(run, 2)
    asyncio.run(settled(cache, run))
    assert len(cache._done) == 2 and (run.name, 0, "t") not in cache._done  # kept: 2


def test_a_record_s_status_waits_for_its_findings():
    run = run_with_window()
    cache = FindingCache(advise_of(run))
    (entry,) = asyncio.run(cache.latest(run, wait=True))
    assert cache.made == 1 and not entry["problems"] and entry["window"] == 0


def test_a_rule_that_raises_is_a_problem_line_and_the_next_change_tries_again(monkeypatch):
    run = run_with_window()
    cache = FindingCache(advise_of(run))

    def broken(fig, th):
        raise RuntimeError("a rule's fault")

    faulty = dataclasses.replace(rules.RULES["straggler"], judge=broken)
    monkeypatch.setitem(rules.RULES, "straggler", faulty)  # (the fault injected)
    (entry,) = asyncio.run(settled(cache, run))
    assert entry["findings"] == [] and entry["window"] == 0 and entry["trainer_id"] == "t"
    fault = "the findings could not be made: RuntimeError: a rule's fault"
    assert entry["problems"] == [fault], entry
    asyncio.run(settled(cache, run))
    assert cache.made == 1, "a fault is kept for the window, not made again at each poll"
    monkeypatch.undo()
    add_window(run, 1)
    (entry,) = asyncio.run(settled(cache, run))
    assert [f["rule"] for f in entry["findings"]] == ["straggler"] and not entry["problems"]


def test_a_leak_costing_no_step_is_listed_before_cheaper_findings_are():
    found = [finding("exposed_comm", 9.0, [0]), finding("straggler", 5.0, [3]),
             finding("gpu_idle", 2.0, [0, 1]), finding("memory_leak", 0.0, [2])]  # fmt: skip
    got = bounded(reply(found))
    assert [f["rule"] for f in got["findings"]] == ["exposed_comm", "straggler", "memory_leak"]
    assert got["findings_total"] == 4
