"""The findings' ``matmul_alignment`` rule (issue 57; ``core.findings_device``): fp16/bf16
``aten::mm`` / ``bmm`` / ``addmm`` ops whose dims are not multiples of 8, as PyTorch's pattern
matcher's ``MatMulDimInFP16Pattern`` finds them, costing their kernels' device time times
``1 - 1 / speedup``.

- The agent flags exactly the ops the pattern matcher flags (a real CPU profile of fp16, bf16
  and fp32 products), reading only their ``Input type`` and ``Input Dims``.
- Quiet on the real GPU traces (``tests/data/gpu-traces``): their matmuls are fp32, or carry
  no shapes. It fires on the pair's traces rewritten so their ``aten::mm`` say ``c10::Half``
  and their ``aten::addmm`` ``c10::BFloat16`` (their real dims kept: many are not multiples
  of 8), its cost the kernels under those ops, found from the raw JSON here, times
  ``1 - 1 / speedup``; quiet again when the same rewrite also pads every dim to a multiple of 8.
- The rule alone, in milliseconds, and a ``GpuRow`` from an agent before these fields.
"""

from __future__ import annotations

import gzip
import json
import os
from collections import defaultdict
from typing import Any

import msgspec
import pytest

from coordinator.core.findings import RULES, window_findings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = os.path.join(ROOT, "tests", "data", "gpu-traces")
PAIR = os.path.join(TRACES, "two-ranks")
NCCL = os.path.join(TRACES, "one-rank-nccl")
MATMULS = {"aten::mm", "aten::bmm", "aten::addmm"}
HALF = {"c10::Half", "c10::BFloat16"}
SPEEDUP = RULES["matmul_alignment"].thresholds["speedup"].default


def _files(folder: str) -> list[str]:
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".json.gz"))


def _advise(folder: str, settings: Any = None) -> dict[str, Any]:
    from coordinator.ops.offline import summarise_traces

    table = summarise_traces([folder]).table
    found, quiet = window_findings(table, None, settings)
    assert "matmul_alignment" in quiet or any(f["rule"] == "matmul_alignment" for f in found)
    return {"table": table, **{f["rule"]: f for f in found}}


def _rewritten(tmp_path: Any, pad: bool) -> str:
    """The pair's traces with ``aten::mm`` in fp16 and ``aten::addmm`` in bf16 (``pad``: each
    tensor's last two dims rounded up to a multiple of 8 too); nothing else changed."""
    out = tmp_path / ("padded" if pad else "half")
    out.mkdir()
    for path in _files(PAIR):
        with gzip.open(path, "rt") as f:
            trace = json.load(f)
        for e in trace["traceEvents"]:
            args = e.get("args") or {}
            if e.get("name") not in ("aten::mm", "aten::addmm") or "Input type" not in args:
                continue
            half = "c10::Half" if e["name"] == "aten::mm" else "c10::BFloat16"
            args["Input type"] = [half if t == "float" else t for t in args["Input type"]]
            if pad:
                args["Input Dims"] = [
                    d[:-2] + [-(-x // 8) * 8 for x in d[-2:]] for d in args["Input Dims"]
                ]
        with gzip.open(out / os.path.basename(path), "wt") as f:
            json.dump(trace, f)
    return str(out)


def _misaligned(e: dict[str, Any]) -> bool:
    """MatMulDimInFP16Pattern's test, on an op of the raw JSON."""
    args = e.get("args") or {}
    types, dims = args.get("Input type"), args.get("Input Dims")
    if e.get("name") not in MATMULS or not types or types[0] not in HALF or dims is None:
        return False
    return not all(x % 8 == 0 for d in dims for x in d[-2:])


def _oracle(path: str) -> tuple[float, int]:
    """From the raw JSON: the device time (ms a step) of the events launched inside the steps
    whose innermost CPU op around the launch is a misaligned fp16/bf16 matmul, and how many such
    ops start inside the steps. The innermost op: the shortest that holds the launch, of two
    alike the later in the file (torch writes a parent first: ``aten::matmul`` then its
    ``aten::mm``, with the same span)."""
    with gzip.open(path, "rt") as f:
        ev = json.load(f)["traceEvents"]
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in ev if str(e.get("name")).startswith("Profi")]

    def in_steps(ts: float) -> bool:
        return any(b <= ts < end for b, end in steps)

    ops: dict[tuple[Any, Any], list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    for i, e in enumerate(ev):
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            ops[(e["pid"], e["tid"])].append((i, e))
    corrs = set()
    for e in ev:
        corr = (e.get("args") or {}).get("correlation")
        if e.get("cat") != "cuda_runtime" or corr is None or not in_steps(e["ts"]):
            continue
        around = [
            (o["dur"], -i, o)
            for i, o in ops[(e["pid"], e["tid"])]
            if o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"]
        ]
        if around and _misaligned(min(around, key=lambda x: (x[0], x[1]))[2]):
            corrs.add(corr)
    us = sum(
        e["dur"]
        for e in ev
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
        and e["args"].get("correlation") in corrs
    )
    n = sum(1 for e in ev if e.get("cat") == "cpu_op" and _misaligned(e) and in_steps(e["ts"]))
    return us / 1e3 / len(steps), n


def test_the_agent_flags_the_ops_torchs_pattern_matcher_flags(tmp_path: Any) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._pattern_matcher import MatMulDimInFP16Pattern

    from worker_ext.agent.trace_reader import read_trace

    h, b, f = torch.half, torch.bfloat16, torch.float
    cases: list[tuple[Any, list[tuple[Any, ...]]]] = [
        (torch.mm, [(9, 16, h), (16, 8, h)]),  # 9
        (torch.mm, [(16, 16, h), (16, 8, h)]),  # aligned
        (torch.mm, [(8, 12, b), (12, 8, b)]),  # 12, bf16
        (torch.mm, [(9, 16, f), (16, 8, f)]),  # fp32: not judged
        (torch.bmm, [(3, 16, 16, h), (3, 16, 8, h)]),  # a batch of 3: only the last two dims
        (torch.bmm, [(8, 16, 15, b), (8, 15, 8, b)]),  # 15
        (torch.addmm, [(8, h), (8, 9, h), (9, 8, h)]),  # 9
        (torch.addmm, [(1, h), (8, 16, h), (16, 8, h)]),  # the broadcast bias's 1 (as torch)
        (torch.addmm, [(8, h), (8, 16, h), (16, 8, h)]),  # aligned
    ]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
        for op, inputs in cases:
            op(*(torch.ones(*s[:-1], dtype=s[-1]) for s in inputs))
    theirs = [
        f"{e.name} "
        + " ".join(str(list(i.sizes)) for i in e.extra_fields.inputs if getattr(i, "sizes", ()))
        for e in MatMulDimInFP16Pattern(prof).matched_events()
    ]
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    ours = [text for _, text in read_trace(str(tmp_path / "t.json")).matmuls]
    assert ours == theirs and len(ours) == 5
    assert ours[0] == "aten::mm [9, 16] [16, 8]"


def test_misaligned_dims_judges_only_ops_with_their_types_and_shapes() -> None:
    from worker_ext.agent.trace_reader import MAX_SHAPE_CHARS, misaligned_dims

    class Args:
        def __init__(self, dims: Any, types: Any) -> None:
            self.input_dims, self.input_type = dims, types

    odd = [[9, 16], [16, 8]]
    assert misaligned_dims("aten::mm", Args(odd, ["c10::Half"] * 2)) == "aten::mm [9, 16] [16, 8]"
    assert misaligned_dims("aten::mm", Args(odd, ["c10::BFloat16"] * 2)) is not None
    assert misaligned_dims("aten::mm", Args(odd, ["float", "float"])) is None
    assert misaligned_dims("aten::mm", Args(None, ["c10::Half"] * 2)) is None  # no shapes
    assert misaligned_dims("aten::mm", Args(odd, None)) is None
    assert misaligned_dims("aten::mm", None) is None
    assert misaligned_dims("aten::mm", Args([[8, 16], [16, 8]], ["c10::Half"] * 2)) is None
    assert misaligned_dims("aten::mm", Args([[9, "x"]], ["c10::Half"])) is None  # odd: unjudged
    assert misaligned_dims("aten::mm", Args([[9, 8]], [["c10::Half"]])) is None  # a list: odd
    scalars = Args([[8], [8, 9], [9, 8], [], []], ["c10::Half"] * 3 + ["Scalar"] * 2)
    assert misaligned_dims("aten::addmm", scalars) == "aten::addmm [8] [8, 9] [9, 8]"
    huge = Args([[9, 2**40]] * 20, ["c10::Half"] * 20)
    assert len(misaligned_dims("aten::mm", huge) or "") == MAX_SHAPE_CHARS


def test_quiet_on_the_real_gpu_traces_whose_matmuls_are_fp32_or_unshaped() -> None:
    from coordinator.core.findings_inputs import not_judged

    for folder, shaped in ((PAIR, True), (NCCL, False)):
        got = _advise(folder, {"matmul_alignment": {"min_share": 0.0}})
        assert "matmul_alignment" not in got
        gpu = got["table"]["gpu"].values()
        assert all(g["misaligned_mm_ops"] == 0 for g in gpu)
        # the pair's fp32 matmuls were judged (quiet); the NCCL rank's, recorded without their
        # shapes, could not be, and advise says so rather than calling the rule quiet
        assert (
            all(g["mm_ops_shaped"] > 100 for g in gpu)
            if shaped
            else all(g["mm_ops_shaped"] == 0 for g in gpu)
        )
        missing = not_judged(got["table"], {}, True)
        assert ("matmul_alignment" in missing) is not shaped, missing


def test_fires_on_the_pairs_matmuls_in_half_precision_at_their_kernels_time(
    tmp_path: Any,
) -> None:
    got = _advise(_rewritten(tmp_path, pad=False))
    f = got["matmul_alignment"]
    want = {r: _oracle(p) for r, p in enumerate(_files(str(tmp_path / "half")))}
    ev = f["evidence"]
    assert f["ranks"] == [0, 1] and f["all_ranks"]
    assert ev["misaligned_ms_per_step"] == pytest.approx({r: w[0] for r, w in want.items()},
                                                         abs=1e-3)  # fmt: skip
    assert ev["ops"] == {r: w[1] for r, w in want.items()} and all(
        n > 100 for n in ev["ops"].values()
    )
    saved = 1 - 1 / SPEEDUP
    assert ev["ms_per_step"] == pytest.approx({r: w[0] * saved for r, w in want.items()}, abs=1e-3)
    assert f["cost_ms_per_step"] == pytest.approx(sum(w[0] for w in want.values()) / 2 * saved,
                                                  abs=1e-3)  # fmt: skip
    assert 1 <= len(ev["shapes"]) <= 3 and all(s.startswith("aten::") for s in ev["shapes"])
    assert ev["shapes"][0] in f["advice"] and "pad_to_multiple_of=8" in f["advice"]
    assert ev["assumed_speedup"] == SPEEDUP
    faster = _advise(str(tmp_path / "half"), {"matmul_alignment": {"speedup": 4.0}})
    assert faster["matmul_alignment"]["cost_ms_per_step"] == pytest.approx(
        sum(w[0] for w in want.values()) / 2 * 0.75, abs=1e-3
    )
    # about 3% of their 610-630 ms steps: quiet above that share
    assert "matmul_alignment" not in _advise(
        str(tmp_path / "half"), {"matmul_alignment": {"min_share": 0.05}}
    )


def test_quiet_when_the_half_precision_dims_are_multiples_of_8(tmp_path: Any) -> None:
    got = _advise(_rewritten(tmp_path, pad=True), {"matmul_alignment": {"min_share": 0.0}})
    assert "matmul_alignment" not in got
    assert all(g["misaligned_mm_us"] == 0 for g in got["table"]["gpu"].values())


def _table(gpu: dict[int, dict[str, Any]], step_ms: float = 100.0) -> dict[str, Any]:
    ranks = {r: {"step_ms": step_ms} for r in range(4)}
    return {"window": 2, "steps": [1, 2], "ranks": list(range(4)), "device": "cuda",
            "stragglers": {"median_step_ms": step_ms, "ranks": ranks}, "gpu": gpu}  # fmt: skip


def _gpu(ms: float, ops: int = 12, shapes: Any = ("aten::mm [9, 16] [16, 8]",)) -> dict[str, Any]:
    return {"misaligned_mm_us": ms * 1e3, "misaligned_mm_ops": ops,
            "misaligned_mm_shapes": list(shapes)}  # fmt: skip


def test_the_rule_costs_the_share_padding_saves_of_the_ranks_over_min_share() -> None:
    gpu = {0: _gpu(6.0), 1: _gpu(1.0), 2: _gpu(3.0, shapes=["aten::bmm [3, 9, 8] [3, 8, 8]"])}
    gpu[3] = {"sync_wait_us": 0.0}  # an older agent's entry: not judged
    found, _ = window_findings(_table(gpu))
    (f,) = [f for f in found if f["rule"] == "matmul_alignment"]
    assert f["ranks"] == [0, 2]  # rank 1: 1% of its step, under 2%
    assert f["evidence"]["ms_per_step"] == {0: 2.0, 2: 1.0}  # x (1 - 1/1.5)
    assert f["cost_ms_per_step"] == pytest.approx(1.5)
    assert f["evidence"]["ops"] == {0: 12, 2: 12}
    assert f["evidence"]["shapes"] == ["aten::mm [9, 16] [16, 8]", "aten::bmm [3, 9, 8] [3, 8, 8]"]
    found, _ = window_findings(_table(gpu), settings={"matmul_alignment": {"min_share": 0.0}})
    assert [f["ranks"] for f in found if f["rule"] == "matmul_alignment"] == [[0, 1, 2]]
    none = {r: _gpu(5.0, ops=0) for r in range(4)}  # time but no op: nothing judged
    assert "matmul_alignment" in window_findings(_table(none))[1]


def test_the_rules_evidence_is_bounded_over_many_ranks() -> None:
    from coordinator.core.findings import EVIDENCE_RANKS

    gpu = {r: _gpu(3.0 + r / 100, shapes=[f"aten::mm [{r}, 9] [9, 8]"] * 1) for r in range(100)}
    table = _table(gpu)
    table["ranks"] = list(range(100))
    table["stragglers"]["ranks"] = {r: {"step_ms": 100.0} for r in range(100)}
    (f,) = [f for f in window_findings(table)[0] if f["rule"] == "matmul_alignment"]
    assert len(f["ranks"]) == 100 and len(f["evidence"]["ops"]) == EVIDENCE_RANKS
    assert len(f["evidence"]["misaligned_ms_per_step"]) == EVIDENCE_RANKS
    assert f["evidence"]["shapes"] == [f"aten::mm [{r}, 9] [9, 8]" for r in (99, 98, 97)]


def test_a_gpu_row_from_before_the_matmul_fields_still_decodes() -> None:
    from coordinator.core.device_views import gpu_entry
    from coordinator.protocol.summary_codec import (
        MAX_MATMUL_SHAPES,
        GpuRow,
        RankSummary,
        decode_summary,
        encode_summary,
    )

    s = RankSummary(rank=0, window=1, steps=(1, 2), partial=False, device="cuda", kernels=[])
    s.gpu = GpuRow(1.0, 1, (), 0.0, 0, 0.0, 0.0, 2.5, 3, ("aten::mm [9, 8] [8, 8]",))
    wire = msgspec.msgpack.decode(encode_summary(s))
    assert decode_summary(msgspec.msgpack.encode(wire)).gpu == s.gpu
    old = wire["gpu"][:7]
    wire["gpu"] = old
    back = decode_summary(msgspec.msgpack.encode(wire)).gpu
    assert back is not None and back.misaligned_mm_ops == 0 and back.misaligned_mm_shapes == ()
    assert gpu_entry(back)["misaligned_mm_us"] == 0.0
    wire["gpu"] = [*old, 1.0, 1, ["aten::mm [9, 8] [8, 8]"] * (MAX_MATMUL_SHAPES + 1)]
    with pytest.raises(ValueError, match=r"\$\.gpu\[9\]"):
        decode_summary(msgspec.msgpack.encode(wire))
