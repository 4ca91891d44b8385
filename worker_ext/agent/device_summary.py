"""A CUDA rank's window read from its device activity: what ran on the GPU for the window's steps.

A device event (kernel, memcpy, memset) belongs to the step that launched it: its launch is the
CPU runtime or driver call with the same ``correlation`` (on any thread: the autograd thread
launches the backward's kernels), and the step is the ``ProfilerStep`` whose span holds that
launch. An event whose launch is not in the trace, or lies outside the window's steps, is
counted apart (``unattributed``) and nowhere else. The window on the device is the span from the
first to the last of its events; compute, communication and memory time are the unions of their
kinds' events (two streams at once count once), ``idle`` is the span minus the union of all, and
``overlap`` the communication time during which a compute kernel also runs. The kinds are
Holistic Trace Analysis's: NCCL kernels are communication; ``Memcpy``, ``Memset`` and ``dma``
are memory; the rest is compute.

Each event's time also goes to the innermost CPU op around its launch (``key_averages()``'s
self device time), and the launches give HTA's launch statistics. Pure numpy: no torch, no Ray.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from coordinator.protocol.summary_codec import MAX_MATMUL_SHAPES
from worker_ext.agent.host_syncs import CpuEvents
from worker_ext.agent.trace_reader import COPY, OP, RUNTIME

COMM_KERNEL = re.compile(r"^nccl.*Kernel")
MEMORY_KERNEL = re.compile(r"^(Memcpy|Memset|dma)")
COMPUTE, COMM, MEMORY = 0, 1, 2
LAUNCH_CALLS = frozenset(
    {
        "cudaLaunchKernel",
        "cudaLaunchKernelExC",
        "cudaMemcpyAsync",
        "cudaMemsetAsync",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
    }
)
"""The launches HTA's ``get_cuda_kernel_launch_stats`` reads, and the driver's own two."""
LAUNCH_BOUND_IDLE = 0.5
"""A step is launch-bound when the device idles over this share of its span..."""
LAUNCH_BOUND_SHORT = 0.5
"""...and over this share of its kernels ran shorter than their launch call took."""
OP_TOP_KERNELS = 5
"""Kernels kept per op per rank (the cross-rank tables show each op's top three)."""
NO_OP = "<no op>"
"""Where a launch made outside every CPU op puts its device time."""


@dataclass
class LaunchStats:
    """HTA's launch statistics over the window's launches of kernels, copies and sets."""

    kernels: int
    delay_p50_ns: int  # the device event's start minus its launch's end (at least 0)
    delay_p95_ns: int
    short_share: float  # of events that ran shorter than their launch call took


@dataclass
class DeviceWindow:
    """What the device did for the window's steps (times in ns)."""

    rows: dict[int, list[int]]  # kernel name id -> [ns, events, 0]
    window_ns: int
    compute_ns: int
    comm_ns: int
    memory_ns: int
    busy_ns: int  # the union of every event
    overlap_ns: int  # communication with a compute kernel running
    unattributed_ns: int
    streams: list[tuple[int, int, int]]  # (device, stream, busy ns)
    step_device: list[tuple[int, int, int]]  # (step, busy ns, span ns)
    launch: LaunchStats | None
    launch_bound: list[int]
    op_device: dict[int, int] = field(default_factory=dict)  # op name id (-1: NO_OP) -> ns
    op_kernels: dict[tuple[int, int], int] = field(default_factory=dict)  # (op, kernel) -> ns
    synced_rows: dict[int, list[int]] = field(default_factory=dict)  # as rows: under a host sync

    @property
    def idle_ns(self) -> int:
        return self.window_ns - self.busy_ns


def kind_of(name: str, category_kind: int) -> int:
    """COMM, MEMORY or COMPUTE, as HTA names kernels (a copy or set event is memory)."""
    if COMM_KERNEL.match(name):
        return COMM
    if category_kind == COPY or MEMORY_KERNEL.match(name):
        return MEMORY
    return COMPUTE


def device_window(
    names: list[str],
    device: list[tuple[int, int, int, int, int, int, int]],
    launches: Launches,
    steps: list[tuple[int, int, int]],
) -> DeviceWindow:
    """The window of ``steps`` (``(step, begin, end)``, the recorded steps) on the device."""
    n = len(device)
    cols = np.array(device, dtype=np.int64).reshape(n, 7) if n else np.zeros((0, 7), np.int64)
    start, end, name, cat, dev, stream, corr = (cols[:, i] for i in range(7))
    at = launches.find(corr)  # each event's launch (a row of ``launches``), or -1
    step = _step_of(launches.start[np.maximum(at, 0)], steps)
    step[at < 0] = -1
    mine = step >= 0
    unattributed = int((end[~mine] - start[~mine]).sum())
    start, end, name, cat, dev, stream = (x[mine] for x in (start, end, name, cat, dev, stream))
    at, step = at[mine], step[mine]
    kinds = _kinds(names, name, cat)
    dur = end - start
    rows = _by_name(name, dur)
    compute = union_ns(start[kinds == COMPUTE], end[kinds == COMPUTE])
    comm = union_ns(start[kinds == COMM], end[kinds == COMM])
    both = union_ns(
        np.concatenate([start[kinds == COMPUTE], start[kinds == COMM]]),
        np.concatenate([end[kinds == COMPUTE], end[kinds == COMM]]),
    )
    streams = []
    for d, s in sorted({(int(a), int(b)) for a, b in zip(dev, stream, strict=True)}):
        on = (dev == d) & (stream == s)
        streams.append((d, s, union_ns(start[on], end[on])))
    result = DeviceWindow(
        rows=rows,
        window_ns=int(end.max() - start.min()) if len(start) else 0,
        compute_ns=compute,
        comm_ns=comm,
        memory_ns=union_ns(start[kinds == MEMORY], end[kinds == MEMORY]),
        busy_ns=union_ns(start, end),
        overlap_ns=compute + comm - both,
        unattributed_ns=unattributed,
        streams=streams,
        step_device=_step_device(step, start, end, [s for s, _, _ in steps]),
        launch=None,
        launch_bound=[],
    )
    _launch_stats(result, names, launches, at, step, start, end)
    _op_time(result, launches, at, name, dur)
    if launches.synced is not None and len(at):
        synced = launches.synced[at]
        result.synced_rows = _by_name(name[synced], dur[synced])
    return result


def _by_name(name: np.ndarray, dur: np.ndarray) -> dict[int, list[int]]:
    """Device events by name id: ``[ns, events, 0]``."""
    if not len(name):
        return {}
    ids, inverse = np.unique(name, return_inverse=True)
    ns, counts = np.bincount(inverse, weights=dur), np.bincount(inverse)
    return {int(i): [int(t), int(c), 0] for i, t, c in zip(ids, ns, counts, strict=True)}


@dataclass
class Launches:
    """The trace's launch calls (CPU RUNTIME events with a correlation), by correlation, with
    the innermost CPU op around each (``op``: its name id, -1 for none) and whether a host
    sync the findings count holds it (``synced``; None: none does)."""

    corr: np.ndarray  # sorted
    start: np.ndarray
    end: np.ndarray
    name: np.ndarray
    op: np.ndarray
    synced: np.ndarray | None = None

    def find(self, corr: np.ndarray) -> np.ndarray:
        """The row of each correlation's launch, or -1."""
        if not len(self.corr) or not len(corr):
            return np.full(len(corr), -1, dtype=np.int64)
        i = np.minimum(np.searchsorted(self.corr, corr), len(self.corr) - 1)
        return np.where((self.corr[i] == corr) & (corr >= 0), i, -1)


def launches_of(ev: CpuEvents, corr: np.ndarray, synced: np.ndarray | None = None) -> Launches:
    """The launches among ``ev`` (each event's ``corr``), each with the innermost ``OP`` event
    around it; ``synced``: the events inside a counted host sync (it included), or None."""
    kind, name, parent = ev.kind, ev.name, ev.parent
    is_launch = (kind == RUNTIME) & (corr >= 0)
    rows = np.flatnonzero(is_launch)
    op = np.full(len(rows), -1, dtype=np.int64)
    for n, i in enumerate(rows.tolist()):
        p = int(parent[i])
        while p >= 0 and kind[p] != OP:
            p = int(parent[p])
        if p >= 0:
            op[n] = int(name[p])
    # One launch per correlation (the first, if a trace repeats one).
    keys, first = np.unique(corr[rows], return_index=True)
    pick = rows[first]
    out = Launches(keys, ev.start[pick], ev.end[pick], name[pick], op[first])
    out.synced = None if synced is None else synced[pick]
    return out


def _kinds(names: list[str], name: np.ndarray, cat: np.ndarray) -> np.ndarray:
    memo: dict[tuple[int, int], int] = {}
    out = np.empty(len(name), dtype=np.int8)
    for i, key in enumerate(zip(name.tolist(), cat.tolist(), strict=True)):
        k = memo.get(key)
        if k is None:
            k = memo[key] = kind_of(names[key[0]], key[1])
        out[i] = k
    return out


def _step_of(at: np.ndarray, steps: list[tuple[int, int, int]]) -> np.ndarray:
    """The step whose span ``[begin, end)`` holds each time, or -1."""
    out = np.full(len(at), -1, dtype=np.int64)
    for s, b, e in steps:
        out[(at >= b) & (at < e) & (out < 0)] = s
    return out


def union_ns(
    start: np.ndarray, end: np.ndarray, lo: int | None = None, hi: int | None = None
) -> int:
    """The length of the union of the spans ``[start, end)``, each clipped to ``[lo, hi]``
    when given (the window's span; a span wholly outside counts nothing)."""
    if lo is not None or hi is not None:
        start, end = np.clip(start, lo, hi), np.clip(end, lo, hi)
        keep = end > start
        start, end = start[keep], end[keep]
    if not len(start):
        return 0
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    heads = np.flatnonzero(new)
    return int((np.maximum.reduceat(e, heads) - s[heads]).sum())


def _step_device(
    step: np.ndarray, start: np.ndarray, end: np.ndarray, steps: list[int]
) -> list[tuple[int, int, int]]:
    out = []
    for s in steps:
        on = step == s
        if on.any():
            out.append((s, union_ns(start[on], end[on]), int(end[on].max() - start[on].min())))
    return out


def _launch_stats(
    r: DeviceWindow,
    names: list[str],
    launches: Launches,
    at: np.ndarray,
    step: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
) -> None:
    call = launches.name[at] if len(at) else np.zeros(0, np.int64)
    counted = np.array([names[c] in LAUNCH_CALLS for c in call.tolist()], dtype=bool)
    if not counted.any():
        return
    l0, l1 = launches.start[at[counted]], launches.end[at[counted]]
    delay = np.maximum(start[counted] - l1, 0)
    short = (end[counted] - start[counted]) < (l1 - l0)
    p50, p95 = np.percentile(delay, [50, 95])
    r.launch = LaunchStats(int(counted.sum()), round(p50), round(p95), float(short.mean()))
    by_step = step[counted]
    for s, busy, span in r.step_device:
        on = by_step == s
        if span > 0 and on.any():
            idle = 1.0 - busy / span
            if idle > LAUNCH_BOUND_IDLE and float(short[on].mean()) > LAUNCH_BOUND_SHORT:
                r.launch_bound.append(s)


def _op_time(
    r: DeviceWindow, launches: Launches, at: np.ndarray, name: np.ndarray, dur: np.ndarray
) -> None:
    if not len(at):
        return
    op = launches.op[at]
    pairs: dict[tuple[int, int], int] = {}
    for o, k, d in zip(op.tolist(), name.tolist(), dur.tolist(), strict=True):
        pairs[(o, k)] = pairs.get((o, k), 0) + d
    by_op: dict[int, list[tuple[int, int]]] = {}
    for (o, k), d in pairs.items():
        r.op_device[o] = r.op_device.get(o, 0) + d
        by_op.setdefault(o, []).append((d, k))
    for o, kernels in by_op.items():
        for d, k in sorted(kernels, key=lambda x: (-x[0], x[1]))[:OP_TOP_KERNELS]:
            r.op_kernels[(o, k)] = d


# The findings' GPU rules (issue 57, ``core.findings_device``): a copy from or to pageable
# memory (kineto names its kinds), and fp32 GEMM and convolution kernels with TF32 (cuBLAS's
# and CUTLASS's ``s1688`` tensor-op kernels, TF32's m16n8k8 MMA; ``s16816`` is fp16's and
# bf16's m16n8k16, not TF32; ``tf32`` in cuDNN's and cuBLASLt's names) or without it on an
# Ampere or later device (its SIMT ``sgemm``/``scudnn`` and ``f32f32_f32f32`` kernels: a
# pre-Ampere device's are named ``volta_``/``turing_``/``maxwell_``); of those, cuDNN's
# convolutions (``torch.backends.cudnn.allow_tf32``, not the matmul switch) by their names:
# ``scudnn``, ``cudnn``, ``conv``, ``fprop``/``dgrad``/``wgrad`` (cuDNN's implicit-GEMM ones).
PAGEABLE_COPY = re.compile(r"^Memcpy \w+ \(.*Pageable")
TF32_KERNEL = re.compile(r"tf32|s1688", re.IGNORECASE)
FP32_KERNEL = re.compile(
    r"^(void )?(\w+::Kernel<)?(ampere|sm_?(8|9|1\d)\d|cutlass_(8|9|1\d)\d)_\w*?"
    r"(sgemm|scudnn|f32f32_f32f32)"
)
CONV_KERNEL = re.compile(r"cudnn|conv|fprop|dgrad|wgrad", re.IGNORECASE)


def gpu_kernel_ns(
    names: list[str], rows: dict[int, list[int]], synced: dict[int, list[int]] | None = None
) -> tuple[int, ...]:
    """Of a window's device rows (``DeviceWindow.rows``): the time and number of copies from or
    to pageable memory (less those of ``synced``: launched by a counted host sync), the time of
    fp32 GEMM kernels without TF32 on an Ampere or later device (``FP32_KERNEL``) and of TF32
    ones (``TF32_KERNEL``), then the same two of convolution kernels (``CONV_KERNEL``)."""
    out = [0] * 6  # pageable, copies, fp32 GEMM, TF32 GEMM, fp32 conv, TF32 conv
    synced = synced or {}
    for i, (ns, count, _) in rows.items():
        n = names[i]
        if PAGEABLE_COPY.match(n):
            by_sync = synced.get(i, (0, 0))
            out[0], out[1] = out[0] + ns - by_sync[0], out[1] + count - by_sync[1]
            continue
        at = 3 if TF32_KERNEL.search(n) else 2 if FP32_KERNEL.match(n) else 0
        if at:
            out[at + 2 * bool(CONV_KERNEL.search(n))] += ns
    return tuple(out)


@dataclass
class MisalignedMatmuls:
    """The fp16/bf16 matmul ops of a window whose dims are not multiples of 8
    (``trace_reader.misaligned_dims``): the correlations of the launches whose innermost op is
    one of them (sorted), how many such ops, and the first ``MAX_MATMUL_SHAPES`` distinct
    shapes (in time)."""

    corrs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    ops: int = 0
    shapes: tuple[str, ...] = ()


def misaligned_matmuls(
    flagged: dict[int, str],
    kind: np.ndarray,
    corr: np.ndarray,
    start: np.ndarray,
    parent: np.ndarray,
    span: tuple[int, int],
) -> MisalignedMatmuls:
    """``MisalignedMatmuls`` of CPU events (``parent``: indices into the same arrays, -1 at the
    top), ``flagged`` the misaligned ops among them (index -> dims as text); the ops counted
    are those that start inside ``span``. Each launch goes to its innermost op, as
    ``launches_of`` finds it: one walk up a level a pass, over the launches only."""
    if not flagged:
        return MisalignedMatmuls()
    mine = np.zeros(len(kind), dtype=bool)
    mine[list(flagged)] = True
    rows = np.flatnonzero((kind == RUNTIME) & (corr >= 0))
    up = parent[rows]
    live = np.flatnonzero(up >= 0)
    while len(live := live[kind[up[live]] != OP]):
        up[live] = parent[up[live]]
        live = live[up[live] >= 0]
    under = (up >= 0) & mine[np.maximum(up, 0)]
    ops = sorted((i for i in flagged if span[0] <= start[i] < span[1]), key=start.item)
    shapes = tuple(dict.fromkeys(flagged[i] for i in ops))[:MAX_MATMUL_SHAPES]
    return MisalignedMatmuls(np.unique(corr[rows[under]]), len(ops), shapes)


def launched_ns(
    device: list[tuple[int, int, int, int, int, int, int]],
    launches: Launches,
    corrs: np.ndarray,
    steps: list[tuple[int, int, int]],
) -> int:
    """The device time of the events launched by ``corrs`` (correlations) whose launch
    lies in one of ``steps`` (``device_window``'s attribution)."""
    if not len(corrs):
        return 0
    wanted = set(corrs.tolist())
    picked = [(s, e, c) for s, e, _, _, _, _, c in device if c in wanted]
    if not picked:
        return 0
    cols = np.array(picked, dtype=np.int64)
    at = launches.find(cols[:, 2])
    step = _step_of(launches.start[np.maximum(at, 0)], steps)
    keep = (at >= 0) & (step >= 0)
    return int((cols[keep, 1] - cols[keep, 0]).sum())
