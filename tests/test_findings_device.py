"""The findings' GPU rules (issue 57; ``core.findings_device``) on the real GPU traces in
``tests/data/gpu-traces`` (two ranks of a 128-rank job on A100s, and one NCCL rank of two),
each cost checked against the raw trace's own events:

- ``host_sync`` fires on both: the pair's ``aten::item`` and the NCCL rank's
  ``cudaEventSynchronize`` calls under ``DistributedDataParallel.forward``; quiet on the NCCL
  rank's trace with those calls taken out (edited), and above a threshold it is under.
- ``memcpy_pageable`` fires on the pair (its ``Pageable`` copies, but ``.item()``'s own copies
  back, ``host_sync``'s); quiet on the NCCL rank (only device-to-device copies).
- ``tf32_off`` is quiet on both (each runs TF32 kernels: TF32 is on); no real trace shows it,
  so it fires on the pair's trace with its TF32 GEMM kernels renamed to the SIMT fp32 kernels
  CUTLASS names (``s1688gemm`` -> ``simt_sgemm``: edited, nothing else changed), naming the
  matmul switch only, and on the NCCL rank's with its TF32 convolutions renamed to cuDNN's fp32
  ones (its GEMMs still TF32), naming cuDNN's only.

Also: the figures' way from the agent's summary through node partials and a saved aggregate,
and a summary from before them.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from typing import Any

import msgspec
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = os.path.join(ROOT, "tests", "data", "gpu-traces")
PAIR = os.path.join(TRACES, "two-ranks")
NCCL = os.path.join(TRACES, "one-rank-nccl")


ANY = {"host_sync": {"min_share": 0.0}, "memcpy_pageable": {"min_share": 0.0}}  # (as nsys)


def _advise(folder: str, settings: dict[str, dict[str, float]] | None = None) -> dict[str, Any]:
    from coordinator.core.findings import window_findings
    from coordinator.ops.offline import summarise_traces

    found, _ = window_findings(summarise_traces([folder]).table, None, settings)
    return {f["rule"]: f for f in found}


def _events(path: str) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as f:
        return list(json.load(f)["traceEvents"])


def _files(folder: str) -> list[str]:
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".json.gz"))


def _steps(ev: list[dict[str, Any]]) -> list[tuple[float, float]]:
    return [
        (e["ts"], e["ts"] + e["dur"]) for e in ev if str(e.get("name")).startswith("ProfilerStep#")
    ]


def _in(e: dict[str, Any], spans: list[tuple[float, float]]) -> bool:
    return any(b <= e["ts"] and e["ts"] + e.get("dur", 0) <= end for b, end in spans)


def _cpu_ms_per_step(path: str, names: set[str]) -> float:
    """The raw trace's CPU events named ``names`` inside its steps: their time, ms a step."""
    ev = _events(path)
    spans = _steps(ev)
    us = sum(e["dur"] for e in ev if e.get("ph") == "X" and e["name"] in names and _in(e, spans))
    return us / 1e3 / len(spans)


def _device_ms_per_step(path: str, named: re.Pattern[str], not_under: str = "") -> float:
    """The raw trace's device events whose name ``named`` searches, launched inside its steps
    (their runtime call's correlation), but (``not_under``) those launched inside a CPU event
    of that name on the same thread: their time, ms a step."""
    durations, steps = _device_events(path, named, not_under)
    return sum(durations) / 1e3 / steps


def _device_events(
    path: str, named: re.Pattern[str], not_under: str = ""
) -> tuple[list[float], int]:
    """``_device_ms_per_step``'s events (their durations, us) and the trace's steps."""
    ev = _events(path)
    spans = _steps(ev)
    outer = [e for e in ev if e.get("ph") == "X" and e["name"] == not_under]
    launched = {
        e["args"]["correlation"]
        for e in ev
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}) and _in(e, spans)
        and not any(o["tid"] == e["tid"] and _in(e, [(o["ts"], o["ts"] + o["dur"])]) for o in outer)
    }  # fmt: skip
    durations = [
        e["dur"]
        for e in ev
        if e.get("cat") in ("kernel", "gpu_memcpy")
        and named.search(e["name"])
        and e["args"].get("correlation") in launched
    ]
    return durations, len(spans)


def _edited(tmp_path: Any, folder: str, edit: Any) -> str:
    """A copy of ``folder``'s traces with ``edit(events)`` applied to each (it returns them)."""
    out = tmp_path / os.path.basename(folder)
    out.mkdir()
    for path in _files(folder):
        with gzip.open(path, "rt") as f:
            trace = json.load(f)
        trace["traceEvents"] = edit(trace["traceEvents"])
        with gzip.open(out / os.path.basename(path), "wt") as f:
            json.dump(trace, f)
    return str(out)


def test_host_sync_names_aten_item_on_both_ranks_of_the_pair_at_their_wait() -> None:
    f = _advise(PAIR, ANY)["host_sync"]
    want = {
        r: _cpu_ms_per_step(p, {"aten::_local_scalar_dense"}) for r, p in enumerate(_files(PAIR))
    }
    assert f["ranks"] == [0, 1] and f["all_ranks"]
    assert f["evidence"]["ms_per_step"] == pytest.approx(want, abs=1e-3)
    assert f["cost_ms_per_step"] == pytest.approx(sum(want.values()) / 2, abs=1e-3)
    assert [c["op"] for c in f["evidence"]["caused_by"]] == ["aten::item"]
    assert "aten::item" in f["advice"] and "non_blocking=True" in f["advice"]
    assert ".item()" in f["advice"]


def test_host_sync_names_ddp_forward_for_the_nccl_ranks_event_syncs() -> None:
    f = _advise(NCCL, ANY)["host_sync"]
    (path,) = _files(NCCL)
    want = _cpu_ms_per_step(path, {"cudaEventSynchronize", "cudaDeviceSynchronize"})
    assert f["ranks"] == [0] and f["cost_ms_per_step"] == pytest.approx(want, abs=1e-3)
    # (its one cudaDeviceSynchronize lies outside the steps: not counted)
    assert f["evidence"]["syncs"] == {0: 24}
    (cause,) = f["evidence"]["caused_by"]
    assert cause["op"] == "DistributedDataParallel.forward" and cause["syncs"] == 24


def test_host_sync_is_quiet_without_the_syncs_or_over_its_threshold(tmp_path: Any) -> None:
    syncs = {"cudaEventSynchronize", "cudaDeviceSynchronize"}
    quiet = _edited(tmp_path, NCCL, lambda ev: [e for e in ev if e.get("name") not in syncs])
    assert "host_sync" not in _advise(quiet, ANY)
    assert "host_sync" not in _advise(NCCL, {"host_sync": {"min_share": 0.001}})
    # By default (1% of the step) the real traces' syncs, 0.01% of their steps, say nothing.
    assert not {"host_sync", "memcpy_pageable"} & (set(_advise(NCCL)) | set(_advise(PAIR)))


def test_memcpy_pageable_costs_the_pairs_pageable_copies_but_item_s_own_copies_back() -> None:
    f = _advise(PAIR, ANY)["memcpy_pageable"]
    pageable = re.compile(r"Pageable")
    item = "aten::_local_scalar_dense"  # its copy back is the wait host_sync counts
    want = {r: _device_ms_per_step(p, pageable, item) for r, p in enumerate(_files(PAIR))}
    whole = {r: _device_ms_per_step(p, pageable) for r, p in enumerate(_files(PAIR))}
    assert all(whole[r] - want[r] > 2e-3 for r in want)  # the pair's .item() copies back
    assert f["ranks"] == [0, 1]
    assert f["evidence"]["ms_per_step"] == pytest.approx(want, abs=1e-3)
    copies = {r: len(_device_events(p, pageable, item)[0]) for r, p in enumerate(_files(PAIR))}
    assert f["evidence"]["copies"] == copies
    assert all(n > 0 for n in f["evidence"]["copies"].values())
    assert "pin_memory=True" in f["advice"] and "non_blocking=True" in f["advice"]


def test_memcpy_pageable_is_quiet_on_device_to_device_copies() -> None:
    assert "memcpy_pageable" not in _advise(NCCL, ANY)


def test_tf32_off_is_quiet_on_ranks_that_run_tf32_kernels() -> None:
    assert "tf32_off" not in _advise(PAIR)
    assert "tf32_off" not in _advise(NCCL)


def test_tf32_off_fires_on_the_pairs_gemms_renamed_to_fp32_kernels(tmp_path: Any) -> None:
    def to_fp32(ev: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for e in ev:
            if e.get("cat") == "kernel":
                e["name"] = e["name"].replace("tensorop_s1688gemm", "simt_sgemm")
        return ev

    edited = _edited(tmp_path, PAIR, to_fp32)
    f = _advise(edited)["tf32_off"]
    # the renamed ones and the trace's own Ampere fp32 ones (not its sgemm_largek_lds64, whose
    # name says no architecture: counted nowhere)
    gemms = re.compile(r"s1688gemm|ampere_sgemm")
    want = {r: _device_ms_per_step(p, gemms) for r, p in enumerate(_files(PAIR))}
    assert f["ranks"] == [0, 1]
    assert f["evidence"]["fp32_gemm_ms_per_step"] == pytest.approx(want, abs=1e-3)
    assert f["cost_ms_per_step"] == pytest.approx(sum(want.values()) / 2 * 0.5, abs=1e-3)
    assert "matmul.allow_tf32 = True" in f["advice"]
    assert "set_float32_matmul_precision" in f["advice"]
    assert "cudnn" not in f["advice"] and "fp32_conv_ms_per_step" not in f["evidence"]
    assert f["evidence"]["switches_off"] == {"torch.backends.cuda.matmul.allow_tf32": 2}
    faster = _advise(edited, {"tf32_off": {"speedup": 4.0}})
    assert faster["tf32_off"]["cost_ms_per_step"] == pytest.approx(
        sum(want.values()) / 2 * 0.75, abs=1e-3
    )


def test_tf32_off_names_cudnn_alone_for_the_nccl_ranks_convolutions_renamed_to_fp32(
    tmp_path: Any,
) -> None:
    tf32_conv = re.compile(r"(fprop|dgrad|wgrad).*tf32")

    def to_fp32(ev: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for e in ev:
            if e.get("cat") == "kernel" and tf32_conv.search(e["name"]):
                fp32 = e["name"].replace("tf32f32_tf32f32", "f32f32_f32f32")  # cuDNN's xmma
                e["name"] = fp32 if fp32 != e["name"] else "ampere_scudnn_128x64_relu_medium_nn_v1"
        return ev

    (path,) = _files(NCCL)
    want = _device_ms_per_step(path, tf32_conv)
    f = _advise(_edited(tmp_path, NCCL, to_fp32))["tf32_off"]  # its GEMMs still run TF32
    assert f["ranks"] == [0]
    assert f["evidence"]["fp32_conv_ms_per_step"] == pytest.approx({0: want}, abs=1e-3)
    assert f["cost_ms_per_step"] == pytest.approx(want * 0.5, abs=1e-3)
    assert f["evidence"]["switches_off"] == {"torch.backends.cudnn.allow_tf32": 1}
    assert "fp32_gemm_ms_per_step" not in f["evidence"]
    assert "cudnn.allow_tf32 = True" in f["advice"] and "matmul" not in f["advice"]


def test_the_gpu_figures_go_from_summaries_through_partials_and_a_saved_aggregate() -> None:
    from coordinator.core.aggregate import WindowAggregate, restored_aggregate, saved_aggregate
    from coordinator.core.findings import window_findings
    from coordinator.core.partial import fold_summaries
    from coordinator.protocol.partial_codec import decode_partial, encode_partial
    from coordinator.protocol.summary_codec import decode_summary, encode_summary
    from worker_ext.agent.trace_summary import summarise_trace

    sent = [
        summarise_trace(
            p, rank=r, window=0, steps=(551, 552), partial=False, device="cuda", top_k=20
        )[0]
        for r, p in enumerate(_files(PAIR))
    ]
    got = [decode_summary(encode_summary(s)) for s in sent]
    assert [s.gpu for s in got] == [s.gpu for s in sent] and all(s.gpu for s in got)
    agg = WindowAggregate(0)
    agg.add_partial(decode_partial(encode_partial(fold_summaries("n", got[:1]))))
    agg.add(got[1])
    table = restored_aggregate(saved_aggregate(agg)).to_dict(20)
    assert table["gpu"][1]["sync_causes"][0][0] == "aten::item"
    found = {f["rule"]: f for f in window_findings(table, None, ANY)[0]}
    assert found["host_sync"]["ranks"] == found["memcpy_pageable"]["ranks"] == [0, 1]


def test_a_summary_from_before_the_gpu_figures_still_decodes() -> None:
    from coordinator.protocol.summary_codec import (
        MAX_SYNC_CAUSES,
        GpuRow,
        RankSummary,
        SyncCause,
        decode_summary,
        encode_summary,
    )

    s = RankSummary(rank=0, window=1, steps=(1, 2), partial=False, device="cuda", kernels=[])
    s.gpu = GpuRow(1.0, 1, (SyncCause("aten::item", 1.0, 1),), 0.0, 0, 0.0, 0.0)
    wire = msgspec.msgpack.decode(encode_summary(s))
    assert decode_summary(msgspec.msgpack.encode(wire)).gpu == s.gpu
    del wire["gpu"]
    assert decode_summary(msgspec.msgpack.encode(wire)).gpu is None
    wire["gpu"] = [1.0, 1, [["aten::item", 1.0, 1]] * (MAX_SYNC_CAUSES + 1), 0.0, 0, 0.0, 0.0]
    with pytest.raises(ValueError, match=r"\$\.gpu\[2\]"):
        decode_summary(msgspec.msgpack.encode(wire))
    wire["gpu"] = [1.0, 1, [], -1.0, 0, 0.0, 0.0]
    with pytest.raises(ValueError, match=r"\$\.gpu\[3\]"):
        decode_summary(msgspec.msgpack.encode(wire))
    wire["gpu"] = [1.0, 1, [], 0.0, 0, 2.0, 3.0]  # an agent's from before the convolutions
    old = decode_summary(msgspec.msgpack.encode(wire)).gpu
    assert old is not None and (old.fp32_gemm_us, old.tf32_gemm_us) == (2.0, 3.0)
    assert (old.fp32_conv_us, old.tf32_conv_us) == (0.0, 0.0)


def test_fp16_and_bf16_tensor_op_kernels_are_not_taken_for_tf32() -> None:
    from worker_ext.agent.device_summary import gpu_kernel_ns

    names = [
        "ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_nn",  # fp16 m16n8k16
        "cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8",  # bf16
        "ampere_s1688gemm_128x128_ldg8_stages_32x3_nn",  # TF32 m16n8k8
        "ampere_sgemm_128x64_nn",  # fp32 without TF32
    ]
    rows = {i: [1000 * (i + 1), 1, 0] for i in range(len(names))}
    assert gpu_kernel_ns(names, rows) == (0, 0, 4000, 3000, 0, 0)


def test_a_sync_under_an_unnamed_annotation_still_makes_a_summary_that_encodes() -> None:
    from coordinator.protocol.summary_codec import GpuRow, SyncCause
    from worker_ext.agent.host_syncs import HostSyncs
    from worker_ext.agent.trace_summary import _gpu_row

    class Dev:  # only the rows _gpu_row reads
        rows: dict[int, list[int]] = {}
        synced_rows: dict[int, list[int]] = {}

    row = _gpu_row(["", "aten::item"], HostSyncs(10_000, 2, {0: [6_000, 1], 1: [4_000, 1]}),
                   Dev(), 1)  # type: ignore[arg-type]  # fmt: skip
    assert [c.name for c in row.causes] == ["<unnamed>", "aten::item"]
    wire = msgspec.msgpack.encode(row)
    back = msgspec.msgpack.decode(wire, type=GpuRow)
    assert back.causes[0] == SyncCause("<unnamed>", 6.0, 1)
