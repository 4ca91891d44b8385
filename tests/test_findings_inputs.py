"""Which rules could not judge a window (``core.findings_inputs``): a window whose summaries
lack a rule's figures (an older agent's, or a record's) says so, rule by rule, instead of
calling the rule quiet; a window whose summaries carry them, zeros included, is judged."""

from __future__ import annotations

from typing import Any

from coordinator.core.findings import RULES
from coordinator.core.findings_inputs import GPU_RULES, HOST_ROW_RULES, advise_parts, not_judged
from tests.test_findings_core import table
from tests.test_findings_host import _hosted

GPU = {"wait_us": 0.0, "syncs": 0, "sync_causes": [], "pageable_us": 0.0}


def _parts(t: dict[str, Any], settings: Any = None, memory: Any = None) -> Any:
    found, quiet, missing = advise_parts(t, None, settings, memory)
    assert set(quiet) | set(missing) | {f["rule"] for f in found} == set(RULES)
    assert not set(quiet) & set(missing)
    return found, quiet, missing


def test_a_window_without_host_figures_says_its_host_rules_could_not_judge() -> None:
    _, quiet, missing = _parts(table(4))
    assert {*HOST_ROW_RULES} <= set(missing) and not {*HOST_ROW_RULES} & set(quiet)
    assert "older than this rule" in missing["dataloader"]
    assert "memory_leak" in missing  # (no memory book was read)


def test_a_row_of_zeros_is_judged_quiet_not_missing() -> None:
    t = _hosted(4)
    for row in t["breakdown"]["ranks"].values():
        row["dataloader_us_per_step"] = row["zero_grad_us_per_step"] = 0.0
    _, quiet, missing = _parts(t, memory={"ranks": [], "nodes": {}})
    assert {"dataloader", "zero_grad", "memory_leak"} <= set(quiet), (quiet, missing)
    assert not {"dataloader", "zero_grad", "memory_leak"} & set(missing)


def _measured(t: dict[str, Any]) -> dict[str, Any]:
    """``t`` with every rank's CPU wait measured (a live rank's, as the agent sends it)."""
    for row in t["breakdown"]["ranks"].values():
        row["cpu_wait_us_per_step"] = 0.0
    return t


def test_a_window_without_the_cpu_wait_says_host_contention_could_not_judge() -> None:
    missing = not_judged(_hosted(2), {}, True)
    assert set(missing) == {"host_contention"} and "schedstat" in missing["host_contention"]
    assert not not_judged(_measured(_hosted(2)), {}, True)


def test_a_cuda_window_without_gpu_figures_says_its_gpu_rules_could_not_judge() -> None:
    t = _measured(_hosted(2, device="cuda"))
    missing = not_judged(t, {}, True)
    assert set(GPU_RULES) <= set(missing) and "memory_peak" in missing
    assert "device_gib" in missing["memory_peak"]
    t["gpu"] = {0: dict(GPU), 1: dict(GPU)}  # (no matmul recorded with its shapes)
    missing = not_judged(t, {"memory_peak": {"device_gib": 80.0}}, True)
    assert (
        set(missing) == {"matmul_alignment"} and "record_shapes=True" in missing["matmul_alignment"]
    )
    t["gpu"][1]["mm_ops_shaped"] = 3
    assert not not_judged(t, {"memory_peak": {"device_gib": 80.0}}, True)
    assert not not_judged(_measured(_hosted(2)), {}, True)  # a CPU window: no device to miss


def test_the_agent_sends_a_row_of_zeros_where_it_found_no_host_time(tmp_path) -> None:
    """A real trace with no DataLoader, no zeroing and no optimizer: its summary still says
    the host time was measured (zeros), so its window's host rules are judged quiet."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from coordinator.protocol.summary_codec import HostRow
    from worker_ext.agent.trace_summary import summarise_trace

    model = torch.nn.Linear(16, 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(torch.ones(4, 16)).sum().backward()
    path = str(tmp_path / "trace.json")
    prof.export_chrome_trace(path)
    s, _ = summarise_trace(
        path, rank=0, window=0, steps=(0, 0), partial=False, device="cpu", top_k=5
    )
    assert s.host == HostRow(0.0, 0, 0.0, 0), s.host
