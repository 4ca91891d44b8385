"""The findings' GPU rules (issue 57; docs/advise.md): a CUDA rank's device synchronizations,
its copies from pageable memory, its fp32 GEMMs without TF32 and its fp16/bf16 matmuls whose
dims are not multiples of 8. Pure: no Ray, torch.

Each reads the window table's ``gpu`` entry of a CUDA rank (``replies.GpuEntry``, from the
agent's ``summary_codec.GpuRow``), each figure a mean a recorded step, and answers each rank's
cost, the evidence and the advice (``Judged``); ``findings.RULES`` holds their thresholds, with
where each number came from, makes the finding and runs them after ``gpu_idle``.
What each counts, and why no other rule counts it again:

- ``host_sync``: the host's wait in device synchronizations (``cudaDeviceSynchronize``,
  ``cudaStreamSynchronize``, ``cudaEventSynchronize``, a synchronous ``cudaMemcpy``, and
  ``aten::_local_scalar_dense``, the op under ``.item()``), outermost only, none inside a
  collective (the collective's wait: ``collective_wait`` and ``exposed_comm`` count it). The
  host waits while the device runs: this is host time, not device idle (the idle after the
  sync, while the host launches again, is ``gpu_idle``'s).
- ``memcpy_pageable``: the device time of copies from or to pageable memory (busy device
  time: no other rule counts it), but those a counted sync launched (``.item()``'s copy back:
  inside ``host_sync``'s wait, and pinning would not help it).
- ``tf32_off``: the device time of fp32 GEMM and convolution kernels an Ampere or later device
  ran without TF32, each kind judged on its own, as each has its own process-wide switch
  (GEMMs: ``torch.backends.cuda.matmul.allow_tf32``, off by default; cuDNN's convolutions:
  ``torch.backends.cudnn.allow_tf32``, on by default): a kind counts on a rank that ran none
  of its kernels with TF32 (one TF32 kernel says its switch is on: cuBLAS and cuDNN still pick
  an fp32 kernel for some shapes), times the share TF32 would save (``1 - 1 / speedup``).
- ``matmul_alignment``: the device time of the kernels of fp16/bf16 ``aten::mm``, ``bmm`` and
  ``addmm`` ops with a dim not a multiple of 8 (PyTorch's pattern matcher's
  ``MatMulDimInFP16Pattern``), times the share padding would save (``1 - 1 / speedup``): busy
  device time of half-precision kernels, which ``tf32_off`` (fp32 kernels) never counts.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Any, Protocol

SYNC_ADVICE = (
    "The host waits for the device inside the step ({ops}): keep .item(), .cpu(), .tolist() "
    "and print(tensor) out of the step (log every N steps, or accumulate on the device), copy "
    "with tensor.to(device, non_blocking=True), and drop torch.cuda.synchronize() calls."
)
PAGEABLE_ADVICE = (
    "Copies between the device and pageable host memory run synchronously: pin the host side "
    "(DataLoader(pin_memory=True), tensor.pin_memory()) and copy with non_blocking=True."
)
TF32_SWITCHES = {
    "gemm": (
        "matmuls",
        "torch.backends.cuda.matmul.allow_tf32",
        "torch.backends.cuda.matmul.allow_tf32 = True (or "
        'torch.set_float32_matmul_precision("high"))',
    ),
    "conv": (
        "convolutions",
        "torch.backends.cudnn.allow_tf32",
        "torch.backends.cudnn.allow_tf32 = True (its default: something turned it off)",
    ),
}
"""Each kind of ``tf32_off``: what it is, its switch, the advice's setting."""
TF32_ADVICE = (
    "fp32 {what} run without TF32 on an Ampere or later device: set {how}, or train with AMP "
    "(torch.autocast)."
)
ALIGN_ADVICE = (
    "fp16/bf16 matmuls with dims not multiples of 8 ({shapes}) run slower kernels: pad the dims "
    "to multiples of 8 (the vocabulary and hidden sizes, batch x sequence length), e.g. "
    "tokenizer(..., padding=True, pad_to_multiple_of=8), "
    "DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8), a vocabulary padded to a "
    "multiple of 64."
)
TOP_SHAPES = 3
"""The example shapes a ``matmul_alignment`` finding names (over its costliest ranks)."""
TOP_CAUSES = 4
"""The causing ops a ``host_sync`` finding names, the costliest first..."""
CAUSE_RANKS = 32
"""... summed over its costliest ranks at most (those its evidence lists, as in ``findings``)."""
Judged = tuple[dict[int, float], dict[str, Any], str] | None
"""A judge's answer: each rank's cost in ms a step, the evidence beyond it, the advice."""


class GpuWindow(Protocol):
    """What the judges read of ``findings.Figures``."""

    step_ms: dict[int, float]
    median_step_ms: float
    gpu: dict[int, Mapping[str, Any]]


def _over_share(
    fig: GpuWindow, key: str, share: float, more: str | None = None
) -> dict[int, float]:
    """Each CUDA rank's ``key`` of its ``gpu`` entry (us a step) as ms a step, where it is over
    ``share`` of the rank's step (and, with ``more``, that count is over 0)."""
    out: dict[int, float] = {}
    step_ms, median = fig.step_ms, fig.median_step_ms
    for r, row in fig.gpu.items():
        ms = row.get(key, 0.0) / 1e3
        if ms > 0 and ms > share * (step_ms.get(r) or median) and (more is None or row[more]):
            out[r] = ms
    return out


def host_sync(fig: GpuWindow, th: dict[str, float]) -> Judged:
    """The ranks whose host waits for their device over ``min_share`` of their step."""
    costs = _over_share(fig, "sync_wait_us", th["min_share"], "syncs")
    if not costs:
        return None
    top = heapq.nlargest(CAUSE_RANKS, costs, key=costs.__getitem__)
    causes = _causes([fig.gpu[r] for r in top], len(top))
    ops = ", ".join(c["op"] for c in causes[:2]) + (" ..." if len(causes) > 2 else "")
    more = {"syncs": {r: fig.gpu[r]["syncs"] for r in costs}, "caused_by": causes}
    return costs, more, SYNC_ADVICE.format(ops=ops)


def _causes(rows: list[Mapping[str, Any]], n: int) -> list[dict[str, Any]]:
    """The ops that caused the syncs of ``rows`` (``n`` ranks: its costliest), the
    ``TOP_CAUSES`` costliest: each its mean wait over the ranks (ms a step) and its syncs over
    them all."""
    acc: dict[str, list[float]] = {}
    for row in rows:
        for name, wait_us, syncs in row.get("sync_causes") or []:
            a = acc.setdefault(str(name), [0.0, 0])
            a[0] += float(wait_us)
            a[1] += int(syncs)
    top = sorted(acc.items(), key=lambda kv: (-kv[1][0], kv[0]))[:TOP_CAUSES]
    return [{"op": k, "ms_per_step": round(v[0] / n / 1e3, 3), "syncs": int(v[1])} for k, v in top]


def memcpy_pageable(fig: GpuWindow, th: dict[str, float]) -> Judged:
    """The ranks whose copies from or to pageable memory take over ``min_share`` of their
    step on the device."""
    costs = _over_share(fig, "pageable_us", th["min_share"], "pageable_copies")
    if not costs:
        return None
    return costs, {"copies": {r: fig.gpu[r]["pageable_copies"] for r in costs}}, PAGEABLE_ADVICE


def tf32_off(fig: GpuWindow, th: dict[str, float]) -> Judged:
    """The ranks whose fp32 GEMMs or convolutions without TF32 take over ``min_share`` of
    their step, each kind on a rank that ran none of its kernels with TF32 (its switch is
    off), each costing that time times ``1 - 1 / speedup``; the advice names those switches."""
    off: dict[str, dict[int, float]] = {}
    for kind in TF32_SWITCHES:
        fp32 = _over_share(fig, f"fp32_{kind}_us", th["min_share"])
        fp32 = {r: ms for r, ms in fp32.items() if not fig.gpu[r].get(f"tf32_{kind}_us")}
        if fp32:
            off[kind] = fp32
    if not off:
        return None
    saved = 1.0 - 1.0 / th["speedup"]
    costs: dict[int, float] = {}
    for by_rank in off.values():
        for r, ms in by_rank.items():
            costs[r] = costs.get(r, 0.0) + ms * saved
    more: dict[str, Any] = {
        f"fp32_{k}_ms_per_step": {r: round(v.get(r, 0.0), 3) for r in costs} for k, v in off.items()
    }
    more["switches_off"] = {TF32_SWITCHES[k][1]: len(v) for k, v in off.items()}
    more["assumed_speedup"] = th["speedup"]
    what = " and ".join(TF32_SWITCHES[k][0] for k in off)
    how = " and ".join(TF32_SWITCHES[k][2] for k in off)
    return costs, more, TF32_ADVICE.format(what=what, how=how)


def matmul_alignment(fig: GpuWindow, th: dict[str, float]) -> Judged:
    """The ranks whose fp16/bf16 matmuls with a dim not a multiple of 8 take over
    ``min_share`` of their step on the device, each costing that time times
    ``1 - 1 / speedup``."""
    slow = _over_share(fig, "misaligned_mm_us", th["min_share"], "misaligned_mm_ops")
    if not slow:
        return None
    saved = 1.0 - 1.0 / th["speedup"]
    costs = {r: ms * saved for r, ms in slow.items()}
    top = heapq.nlargest(CAUSE_RANKS, costs, key=costs.__getitem__)
    shapes: dict[str, None] = {}
    for r in top:
        shapes.update(dict.fromkeys(fig.gpu[r].get("misaligned_mm_shapes") or []))
    examples = list(shapes)[:TOP_SHAPES]
    more: dict[str, Any] = {
        "misaligned_ms_per_step": {r: round(ms, 3) for r, ms in slow.items()},
        "ops": {r: fig.gpu[r]["misaligned_mm_ops"] for r in slow},
        "shapes": examples,
        "assumed_speedup": th["speedup"],
    }
    return costs, more, ALIGN_ADVICE.format(shapes="; ".join(examples) or "shapes not recorded")
