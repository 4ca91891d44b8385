"""A window's summary from the chrome trace torch wrote: no torch, no Ray, no ``key_averages()``.

``trace_reader.read_trace`` turns the file into columns in one streaming pass; this module nests
the CPU events of each thread (one tight pass with a stack: the parent of an event is the
innermost earlier event that contains it) and derives everything else with numpy: every event's
self time (its duration minus that of its direct children, as ``key_averages()`` computes it),
the per-op rows, the time breakdown, the memory table and the folded stacks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from coordinator.protocol.collective_replies import CollectiveBlock
from coordinator.protocol.summary_codec import (
    MAX_NAME_CHARS,
    MAX_SYNC_CAUSES,
    Breakdown,
    GpuRow,
    HostRow,
    KernelRow,
    LaunchRow,
    MemoryRow,
    OpRow,
    RankSummary,
    StreamRow,
    SyncCause,
)
from worker_ext.agent.collective_reader import DEFAULT_CAP, collectives_of
from worker_ext.agent.device_summary import (
    NO_OP,
    DeviceWindow,
    Launches,
    MisalignedMatmuls,
    device_window,
    gpu_kernel_ns,
    launched_ns,
    launches_of,
    misaligned_matmuls,
    union_ns,
)
from worker_ext.agent.host_syncs import CpuEvents, HostSyncs, host_syncs
from worker_ext.agent.trace_reader import (
    ANNOTATION,
    CHUNK_BYTES,
    OP,
    PYTHON,
    STEP_NAME,
    TraceDigest,
    read_trace,
)

MEMORY_TOP_K = 20

# Breakdown classes.
COMPUTE, COMM, MEMCPY, OTHER = 0, 1, 2, 3
_COMM = re.compile(r"^(nccl|c10d::|gloo:|record_param_comms)", re.IGNORECASE)
# A ProcessGroup's work span ("gloo:all_reduce") starts on the calling thread and ends on the
# backend's: key_averages() treats it as async, with no self time and outside the op tree.
_ASYNC_WORK = re.compile(r"^(gloo|nccl|mpi|ucc|xccl):")
_CPU_COPY = re.compile(r"^(aten::(copy_|_to_copy|to)$|cudaMemcpy|cudaMemset|Memcpy|Memset)")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
# The findings' host time (issue 57): torch.profiler's span of a DataLoader iterator's
# ``__next__``; the scopes of a ``zero_grad`` (the optimizer's span, a Python frame with
# ``with_stack``) and the ops under them that zero a gradient (not those of a new zeros tensor).
_DATALOADER = re.compile(r"^enumerate\(DataLoader\)#.*\.__next__$")
_ZERO_GRAD_SCOPE = re.compile(r"(^Optimizer\.zero_grad#|: zero_grad$)")
_ZEROING = frozenset({"aten::zero_", "aten::fill_", "aten::_foreach_zero_"})
_NEW_ZEROS = frozenset({"aten::zeros", "aten::zeros_like", "aten::new_zeros"})
# ``optimizer_foreach``: the step of a torch optimizer that has a foreach form, the
# per-parameter math its single-tensor loop runs, and the multi-tensor ops of its other forms.
_OPTIMIZER = re.compile(
    r"^Optimizer\.step#(SGD|Adam|AdamW|Adagrad|Adamax|Adadelta|ASGD|NAdam|RAdam|RMSprop|Rprop)"
    r"\.step$"
)
_LOOP_OP = re.compile(
    r"^aten::(add|sub|mul|div|addcdiv|addcmul|lerp|sqrt|rsqrt|pow|neg|sign|abs|maximum|"
    r"clamp|exp)_?$"
)
_FOREACH_OP = re.compile(r"^aten::_(foreach|fused)_")


def summarise_trace(
    path: str,
    *,
    rank: int,
    window: int,
    steps: tuple[int, int],
    partial: bool,
    device: str,
    top_k: int,
    stacks: bool = False,
    flops: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
    clip: bool = False,
    collectives_cap: int = DEFAULT_CAP,
    cpu_wait_ns: int | None = None,
) -> tuple[RankSummary, list[str] | None]:
    """Read ``path`` once and build the rank's summary (and folded stacks when ``stacks``).

    ``flops``: count matrix-product flops from the recorded input shapes (``with_flops``).
    ``clip``: leave out the CPU events outside the recorded steps' span (a trace that began
    or ended off the steps: libkineto's, whose collection starts and stops on its own thread).
    ``cpu_wait_ns``: the training thread's wait for a CPU, a recorded step's mean, as the rank
    measured it (``TraceJob.cpu_wait_ns``; None: not measured; one longer than the window's
    span is refused: not measured).
    Raises ``trace_reader.TraceError`` for a trace that cannot be read.
    """
    digest = read_trace(path, chunk_bytes=chunk_bytes, flops=flops)
    return summarise(
        digest,
        rank=rank,
        window=window,
        steps=steps,
        partial=partial,
        device=device,
        top_k=top_k,
        stacks=stacks,
        clip=clip,
        collectives_cap=collectives_cap,
        cpu_wait_ns=cpu_wait_ns,
    )


def summarise(
    d: TraceDigest,
    *,
    rank: int,
    window: int,
    steps: tuple[int, int],
    partial: bool,
    device: str,
    top_k: int,
    stacks: bool = False,
    clip: bool = False,
    collectives_cap: int = DEFAULT_CAP,
    cpu_wait_ns: int | None = None,
) -> tuple[RankSummary, list[str] | None]:
    """The rank's summary of a read trace, and folded-stack lines (``a;b;c self_us``); its
    collectives (``collective_reader``) whole steps up to ``collectives_cap``; ``cpu_wait_ns``
    as ``summarise_trace``'s."""
    step_spans, w0, w1 = _window_span(d, steps)
    cpu = _nest(d, stacks, (w0, w1), clip and bool(step_spans))
    comm = np.array(cpu.comm_spans, dtype=np.int64).reshape(-1, 2)
    cpu.breakdown[COMM] = union_ns(comm[:, 0], comm[:, 1], w0, w1)  # wall time in collectives
    peak, memory = _memory(d, cpu, device)
    flow = _memory_flow(d, device, step_spans) if peak is not None else None
    summary = RankSummary(
        rank=rank,
        window=window,
        steps=steps,
        partial=partial,
        device=device,
        kernels=[],
        step_us=[(s, (e - b) / 1e3) for s, b, e in step_spans],
        peak_bytes=peak,
        memory=memory,
        memory_flow=flow,
        collectives=_collectives(d, collectives_cap, clip and bool(step_spans)),
        host=_host_row(cpu.host_ns, max(len(step_spans), 1), _plausible(cpu_wait_ns, w1 - w0)),
    )
    if device == "cuda" and d.device:
        # Attributed by their launch: to each recorded step, or (no step marker: the trace
        # read whole as one window) to the window.
        owners = step_spans or [(steps[0], -(2**62), 2**62)]
        dev = device_window(d.names, d.device, cpu.launches, owners)
        _on_device(summary, d, cpu, dev, top_k)
        mm = cpu.matmuls  # (their kernels: by launch, to the steps as ``dev``'s)
        matmul = (launched_ns(d.device, cpu.launches, mm.corrs, owners), mm.ops, mm.shapes,
                  d.matmuls_shaped)  # fmt: skip
        summary.gpu = _gpu_row(d.names, cpu.syncs, dev, max(len(step_spans), 1), matmul)
    else:
        _on_cpu(summary, d, cpu, w1 - w0, top_k)
    folded = None
    if stacks:
        folded = [f"{path} {round(ns / 1e3)}" for path, ns in cpu.folded.items() if ns >= 500]
    return summary, folded


def _collectives(d: TraceDigest, cap: int, in_steps: bool) -> CollectiveBlock | None:
    """``collectives_of`` (``in_steps``: as the other tables clip), whose failure costs the
    collectives (a note says why), never the rank's summary."""
    try:
        return collectives_of(d, cap, in_steps)
    except Exception as exc:  # noqa: BLE001 - a reader's bug must not lose the window
        return CollectiveBlock((), (), 0, (), (f"its collectives could not be read: {exc!r:.300}",))


def _on_cpu(s: RankSummary, d: TraceDigest, cpu: _CpuResult, window_ns: int, top_k: int) -> None:
    """A CPU rank's tables: self CPU time per op, the breakdown over the CPU window."""
    kept, dropped = _top_rows(d, cpu.rows, top_k)
    brk = cpu.breakdown
    busy = brk[COMPUTE] + brk[COMM] + brk[MEMCPY]
    s.kernels = [KernelRow(n, v[0] / 1e3, int(v[1]), int(v[2])) for n, v in kept]
    s.dropped_rows, s.dropped_us = len(dropped), sum(v[0] for _, v in dropped) / 1e3
    s.breakdown = Breakdown(
        compute_us=brk[COMPUTE] / 1e3,
        comm_us=brk[COMM] / 1e3,
        memcpy_us=brk[MEMCPY] / 1e3,
        other_us=max(0, window_ns - busy) / 1e3,
        window_us=window_ns / 1e3,
    )


def _on_device(
    s: RankSummary, d: TraceDigest, cpu: _CpuResult, dev: DeviceWindow, top_k: int
) -> None:
    """A CUDA rank's tables: device time per kernel and per op, the breakdown over the device
    span, launches (``device_summary``)."""
    kept, dropped = _top_rows(d, dev.rows, top_k)
    s.kernels = [KernelRow(n, v[0] / 1e3, int(v[1]), int(v[2])) for n, v in kept]
    s.dropped_rows, s.dropped_us = len(dropped), sum(v[0] for _, v in dropped) / 1e3
    s.breakdown = Breakdown(
        compute_us=dev.compute_ns / 1e3,
        comm_us=dev.comm_ns / 1e3,
        memcpy_us=dev.memory_ns / 1e3,
        other_us=dev.idle_ns / 1e3,
        window_us=dev.window_ns / 1e3,
        overlap_us=dev.overlap_ns / 1e3,
    )
    s.streams = [
        StreamRow(a, b, busy / 1e3, (dev.window_ns - busy) / 1e3) for a, b, busy in dev.streams
    ]
    s.unattributed_us = dev.unattributed_ns / 1e3
    s.step_device = [(step, busy / 1e3, span / 1e3) for step, busy, span in dev.step_device]
    if dev.launch is not None:
        la = dev.launch
        s.launch = LaunchRow(
            la.kernels, la.delay_p50_ns / 1e3, la.delay_p95_ns / 1e3, la.short_share
        )
    s.launch_bound = dev.launch_bound
    s.ops = _op_rows(d, cpu, dev, top_k)


def _op_rows(d: TraceDigest, cpu: _CpuResult, dev: DeviceWindow, top_k: int) -> list[OpRow]:
    """The op table: every CPU op's device time, self CPU time, calls and largest kernels,
    by normalised name, the ``top_k`` largest by device time (then CPU time)."""
    acc: dict[str, list[int]] = {}  # name -> [device ns, cpu ns, calls]
    kernels: dict[str, dict[str, int]] = {}
    for i in cpu.op_names:
        self_ns, count, _ = cpu.rows.get(i, (0, 0, 0))
        row = acc.setdefault(normalise_name(d.names[i]), [0, 0, 0])
        row[1] += self_ns
        row[2] += count
    for op, ns in dev.op_device.items():
        acc.setdefault(NO_OP if op < 0 else normalise_name(d.names[op]), [0, 0, 0])[0] += ns
    for (op, k), ns in dev.op_kernels.items():
        mine = kernels.setdefault(NO_OP if op < 0 else normalise_name(d.names[op]), {})
        name = normalise_name(d.names[k])
        mine[name] = mine.get(name, 0) + ns
    ordered = sorted(
        (kv for kv in acc.items() if kv[1][0] > 0 or kv[1][1] > 0),
        key=lambda kv: (-kv[1][0], -kv[1][1], kv[0]),
    )
    return [
        OpRow(
            name,
            dev_ns / 1e3,
            cpu_ns / 1e3,
            calls,
            [
                (k, ns / 1e3)
                for k, ns in sorted(kernels.get(name, {}).items(), key=lambda x: (-x[1], x[0]))[:5]
            ],
        )
        for name, (dev_ns, cpu_ns, calls) in ordered[:top_k]
    ]


def _window_span(
    d: TraceDigest, steps: tuple[int, int]
) -> tuple[list[tuple[int, int, int]], int, int]:
    """The recorded steps' spans ``(step, begin, end)`` and the window they make (ns): from
    the first step's begin to the last step's end, or, without step markers, the span of the
    recorded CPU events."""
    first, last = steps
    step_spans = sorted((s, b, e) for s, b, e in d.steps if first <= s <= last)
    cols = d.cpu()
    if step_spans:
        w0, w1 = min(b for _, b, _ in step_spans), max(e for _, _, e in step_spans)
    elif len(cols.start):
        w0, w1 = int(cols.start.min()), int(cols.end.max())
    else:
        w0 = w1 = 0
    return step_spans, w0, max(w0, w1)


def _top_rows(
    d: TraceDigest, rows: dict[int, list[int]], top_k: int
) -> tuple[list[tuple[str, list[int]]], list[tuple[str, list[int]]]]:
    """Rows by normalised name (step markers left out), the ``top_k`` by self time and the rest."""
    named: dict[str, list[int]] = {}
    for i, (self_ns, count, fl) in rows.items():
        if self_ns <= 0 or STEP_NAME.match(d.names[i]):
            continue
        acc = named.setdefault(normalise_name(d.names[i]), [0, 0, 0])
        acc[0] += self_ns
        acc[1] += count
        acc[2] += fl
    ordered = sorted(named.items(), key=lambda kv: (-kv[1][0], kv[0]))
    return ordered[:top_k], ordered[top_k:]


def _memory(d: TraceDigest, cpu: _CpuResult, device: str) -> tuple[int | None, list[MemoryRow]]:
    """Peak allocated bytes on the rank's device and the top allocating ops, or (None, [])
    when the trace has no memory events."""
    device_type = 1 if device == "cuda" else 0  # [memory] events' "Device Type"
    peaks = [v for (dt, _), v in d.peak_allocated.items() if dt == device_type]
    if not peaks and not cpu.allocations:
        return None, []
    top_alloc = sorted(cpu.allocations.items(), key=lambda kv: (-kv[1][0], kv[0]))
    return max(peaks, default=0), [MemoryRow(n, b, c) for n, (b, c) in top_alloc[:MEMORY_TOP_K]]


def _memory_flow(
    d: TraceDigest, device: str, step_spans: list[tuple[int, int, int]]
) -> tuple[int, int, int]:
    """On the rank's device: the step its peak fell in (-1: outside every recorded step), and
    the bytes allocated and freed in the window."""
    device_type = 1 if device == "cuda" else 0
    keys = [k for k in d.memory_flow if k[0] == device_type]
    if not keys:
        return (-1, 0, 0)
    top = max(keys, key=lambda k: d.peak_allocated.get(k, -1))
    at = d.memory_flow[top][0]
    step = next((s for s, b, e in step_spans if b <= at <= e), -1)
    return (step, sum(d.memory_flow[k][1] for k in keys), sum(d.memory_flow[k][2] for k in keys))


@dataclass
class _CpuResult:
    rows: dict[int, list[int]]  # name id -> [self ns, count, flops]
    breakdown: list[int]
    allocations: dict[str, list[int]]  # op name -> [bytes, allocations]
    folded: dict[str, int]
    comm_spans: list[tuple[int, int]]  # outermost collective spans, on every thread
    launches: Launches  # the launch calls, each with the innermost op around it
    op_names: set[int]  # the name ids of ops (``OP`` events)
    host_ns: tuple[int, ...]  # DataLoader ns and calls, zeroing ns and ops, ... (_host_ns)
    syncs: HostSyncs = field(default_factory=HostSyncs)  # the host's waits for the device
    matmuls: MisalignedMatmuls = field(default_factory=MisalignedMatmuls)  # fp16/bf16, not x8


def _nest(d: TraceDigest, stacks: bool, span: tuple[int, int], clip: bool = False) -> _CpuResult:
    """Self time per CPU event, the breakdown (of the events inside ``span``, the window),
    allocations and folded stacks; with ``clip``, of the events inside ``span`` only."""
    c = d.cpu()
    names = d.names
    is_work = np.array([bool(_ASYNC_WORK.match(n)) for n in names] or [False])
    is_comm = np.array([bool(_COMM.match(n)) for n in names] or [False])
    is_copy = np.array([bool(_CPU_COPY.match(n)) for n in names] or [False])
    work = (c.kind == ANNOTATION) & is_work[c.name]
    comm_spans = list(zip(c.start[work].tolist(), c.end[work].tolist(), strict=True))
    # Async work spans sit outside the op tree; everything else is nested per thread.
    keep = np.flatnonzero(~work & ((c.start >= span[0]) & (c.end <= span[1]) if clip else True))
    order = keep[np.lexsort((-c.end[keep], c.start[keep], c.thread[keep]))]
    thread, start, end = c.thread[order], c.start[order], c.end[order]
    name, kind, flops, corr = c.name[order], c.kind[order], c.flops[order], c.corr[order]
    n = len(order)
    parent = _parents(thread, start, end)
    has_parent = parent >= 0
    p = np.where(has_parent, parent, 0)
    dur = end - start
    child_ns = np.bincount(parent[has_parent], weights=dur[has_parent], minlength=n)
    n_children = np.bincount(parent[has_parent], minlength=n)
    self_ns = dur - np.rint(child_ns).astype(np.int64)
    # key_averages() folds an op into a same-named parent whose only child it is.
    folded_in = has_parent & (name[p] == name) & (n_children[p] == 1)
    counted = ~folded_in
    in_comm = _inherited(is_comm[name] if n else np.zeros(0, bool), parent)
    in_copy = _inherited(is_copy[name] if n else np.zeros(0, bool), parent)
    klass = np.where(in_comm, COMM, np.where(in_copy, MEMCPY, np.where(kind == OP, COMPUTE, OTHER)))
    outer_comm = in_comm & ~(has_parent & in_comm[p])
    comm_spans += list(zip(start[outer_comm].tolist(), end[outer_comm].tolist(), strict=True))
    positive = (self_ns > 0) & (start >= span[0]) & (end <= span[1])
    brk = [0, 0, 0, 0]
    brk[COMPUTE] = int(self_ns[(klass == COMPUTE) & positive].sum())
    brk[MEMCPY] = int(self_ns[(klass == MEMCPY) & positive].sum())
    rows: dict[int, list[int]] = {}
    if n:
        size = len(names)
        self_by_name = np.bincount(name, weights=self_ns, minlength=size)
        count_by_name = np.bincount(name[counted], minlength=size)
        for i in np.flatnonzero(count_by_name | (self_by_name != 0)).tolist():
            rows[i] = [int(round(float(self_by_name[i]))), int(count_by_name[i]), 0]
        for i in np.flatnonzero(counted & (flops > 0)).tolist():
            rows[int(name[i])][2] += int(flops[i])
    allocs = _allocations(d, thread, start, end, kind, name, parent)
    folded = _folded(names, name, kind, parent, self_ns) if stacks else {}
    ev = CpuEvents(names, name, kind, start, end, parent)
    syncs = host_syncs(ev, span, skip=in_comm)  # (a wait inside a collective is its wait)
    launches = launches_of(ev, corr, _under(syncs.counted, parent))
    op_names = set(name[kind == OP].tolist())  # (np.unique would import numpy.ma: 7 ms)
    host = _host_ns(ev, span)
    result = _CpuResult(rows, brk, allocs, folded, comm_spans, launches, op_names, host)
    result.syncs = syncs
    if d.matmuls:
        result.matmuls = _misaligned(d.matmuls, order, kind, corr, start, parent, span)
    return result


def _misaligned(
    matmuls: list[tuple[int, str]],
    order: np.ndarray,
    kind: np.ndarray,
    corr: np.ndarray,
    start: np.ndarray,
    parent: np.ndarray,
    span: tuple[int, int],
) -> MisalignedMatmuls:
    """``misaligned_matmuls`` of the digest's ``matmuls`` (file-order indices) among the sorted
    ``_nest`` arrays (``order``: the file-order index of each; an op left out is not counted)."""
    at = np.full(int(order.max(initial=-1)) + 1, -1, dtype=np.int64)
    at[order] = np.arange(len(order))
    flagged = {int(at[i]): text for i, text in matmuls if i < len(at) and at[i] >= 0}
    return misaligned_matmuls(flagged, kind, corr, start, parent, span)


def _under(events: list[int], parent: np.ndarray) -> np.ndarray | None:
    """The events under any of ``events`` (they included), or None for none."""
    if not events:
        return None
    flag = np.zeros(len(parent), dtype=bool)
    flag[events] = True
    return _inherited(flag, parent)


def _host_ns(ev: CpuEvents, span: tuple[int, int]) -> tuple[int, ...]:
    """Inside ``span`` (each event clipped to it): the inclusive time of the outermost
    DataLoader ``__next__`` spans and their number; of the outermost gradient-zeroing ops under
    a ``zero_grad`` scope (``_ZERO_GRAD_SCOPE``; none under a new zeros tensor) and their
    number; of the outermost optimizer steps (``_OPTIMIZER``) and their number, and the number
    of outermost per-parameter ops and of foreach ops under them (their time: unused). Events
    of the sorted ``_nest`` arrays; a trace without such names costs one scan of its names, one
    with them a walk up from those events only (``_above``)."""
    bits = np.array([_host_bits(n) for n in ev.names] or [0], dtype=np.int16)
    if not len(ev.name) or not (bits & (_LOADER | _ZEROES | _OPT)).any():
        return (0,) * 10
    mine = bits[ev.name]
    found = []
    # (events, their kind, what their ancestors may be: of ``mask``, exactly ``required``)
    wanted = (
        (_LOADER, ANNOTATION, _LOADER, 0),
        (_ZEROES, OP, _ZEROES | _SCOPE | _NEW, _SCOPE),
        (_OPT, ANNOTATION, _OPT, 0),
        (_LOOP, OP, _OPT | _LOOP | _MULTI, _OPT),
    )
    for flag, what, mask, required in (*wanted, (_MULTI, OP, _OPT | _MULTI, _OPT)):
        idx = np.flatnonzero(((mine & flag) != 0) & (ev.kind == what))
        idx = idx[ev.inside(idx, span) > 0]
        idx = idx[(_above(mine, idx, ev.parent) & mask) == required]  # outermost, scoped, not new
        found += [int(ev.inside(idx, span).sum()), len(idx)]
    return tuple(found)


_LOADER, _ZEROES, _SCOPE, _NEW, _OPT, _LOOP, _MULTI = 1, 2, 4, 8, 16, 32, 64


def _host_bits(name: str) -> int:
    """What a name is to ``_host_ns``: a DataLoader ``__next__``, a zeroing op, a
    ``zero_grad`` scope, a new zeros tensor (bits)."""
    return (
        _LOADER * bool(_DATALOADER.match(name))
        | _ZEROES * (name in _ZEROING)
        | _SCOPE * bool(_ZERO_GRAD_SCOPE.search(name))
        | _NEW * (name in _NEW_ZEROS)
        | _OPT * bool(_OPTIMIZER.match(name))
        | _LOOP * bool(_LOOP_OP.match(name))
        | _MULTI * bool(_FOREACH_OP.match(name))
    )


def _above(bits: np.ndarray, idx: np.ndarray, parent: np.ndarray) -> np.ndarray:
    """For each event of ``idx``, its ancestors' ``bits`` OR-ed: one step up a pass, over
    those events only (a pass per level of the deepest)."""
    acc = np.zeros(len(idx), dtype=bits.dtype)
    cur = parent[idx]
    live = np.flatnonzero(cur >= 0)
    while len(live):
        up = cur[live]
        acc[live] |= bits[up]
        cur[live] = parent[up]
        live = live[cur[live] >= 0]
    return acc


def _plausible(wait_ns: int | None, span_ns: int) -> int | None:
    """A rank's CPU wait a step (ns), or None where it is not a count or longer than the window
    (``span_ns``): a wait a step cannot outlast the steps themselves."""
    if type(wait_ns) is not int or not 0 <= wait_ns <= max(span_ns, 0):
        return None
    return wait_ns


def _host_row(ns: tuple[int, ...], steps: int, cpu_wait_ns: int | None = None) -> HostRow:
    """``_host_ns`` as ``HostRow`` (times and the optimizer's op counts a mean over
    ``steps``), zeros included: a row of zeros says "measured, none found" where a summary
    without one (an older agent's) says "not measured" (``core.findings_inputs``); the
    rank's CPU wait a step, None when it was not measured."""
    loader_ns, calls, zero_ns, ops, opt_ns, _, _, loop, _, multi = ns
    per = 1 / steps
    wait = cpu_wait_ns / 1e3 if cpu_wait_ns is not None else None  # (a step's, as sent)
    return HostRow(
        loader_ns / 1e3 * per, calls, zero_ns / 1e3 * per, ops,
        opt_ns / 1e3 * per, loop * per, multi * per, wait,
    )  # fmt: skip


def _gpu_row(
    names: list[str],
    syncs: HostSyncs,
    dev: DeviceWindow,
    steps: int,
    matmul: tuple[int, int, tuple[str, ...], int] = (0, 0, (), 0),
) -> GpuRow:
    """A CUDA rank's ``GpuRow``: its host syncs (the ``MAX_SYNC_CAUSES`` costliest causes)
    and device figures, each a mean over ``steps``; ``matmul``: its misaligned fp16/bf16
    matmuls' device time (ns), ops and shapes, and the matmul ops recorded with shapes."""
    top = sorted(syncs.causes.items(), key=lambda kv: (-kv[1][0], kv[0]))[:MAX_SYNC_CAUSES]
    causes = tuple(
        SyncCause(normalise_name(names[c]) if c >= 0 else NO_OP, ns / 1e3 / steps, n)
        for c, (ns, n) in top
    )
    pageable, copies, fp32, tf32, fp32_conv, tf32_conv = gpu_kernel_ns(
        names, dev.rows, dev.synced_rows
    )
    return GpuRow(
        syncs.wait_ns / 1e3 / steps, syncs.syncs, causes,
        pageable / 1e3 / steps, copies, fp32 / 1e3 / steps, tf32 / 1e3 / steps,
        misaligned_mm_us=matmul[0] / 1e3 / steps, misaligned_mm_ops=matmul[1],
        misaligned_mm_shapes=tuple(normalise_name(t) for t in matmul[2]),
        fp32_conv_us=fp32_conv / 1e3 / steps, tf32_conv_us=tf32_conv / 1e3 / steps,
        mm_ops_shaped=matmul[3],
    )  # fmt: skip


def _parents(thread: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Each event's parent (an index, -1 for none) among events sorted by thread, start, -end.

    The parent is the innermost open event on the same thread that contains it; an event that
    starts at or after another's end, or ends after it, is not inside it.
    """
    n = len(start)
    parent = [-1] * n
    starts, ends = start.tolist(), end.tolist()
    bounds = np.flatnonzero(np.diff(thread)) + 1
    for lo, hi in zip([0, *bounds.tolist()], [*bounds.tolist(), n], strict=True):
        stack: list[int] = []
        push, pop = stack.append, stack.pop
        for i in range(lo, hi):
            s, e = starts[i], ends[i]
            while stack:
                pe = ends[stack[-1]]
                if s >= pe or e > pe:
                    pop()
                else:
                    parent[i] = stack[-1]
                    break
            push(i)
    return np.array(parent, dtype=np.int64)


def _inherited(flag: np.ndarray, parent: np.ndarray) -> np.ndarray:
    """``flag`` OR-ed over every event's ancestors (pointer doubling: log(depth) passes)."""
    out, anc = flag.copy(), parent.copy()
    while True:
        live = np.flatnonzero(anc >= 0)
        if not len(live):
            return out
        up = anc[live]
        out[live] |= out[up]
        anc[live] = anc[up]


def _allocations(
    d: TraceDigest,
    thread: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    kind: np.ndarray,
    name: np.ndarray,
    parent: np.ndarray,
) -> dict[str, list[int]]:
    """Bytes allocated per op: each allocation goes to the innermost op running at that time."""
    out: dict[str, list[int]] = {}
    if not d.allocations:
        return out
    # Positions of each thread's events in the sorted arrays, for a binary search by time.
    lo_of = np.searchsorted(thread, np.arange(len(d.threads)), side="left")
    hi_of = np.searchsorted(thread, np.arange(len(d.threads)), side="right")
    for t, ts, nbytes in d.allocations:
        lo, hi = int(lo_of[t]), int(hi_of[t])
        i = lo + int(np.searchsorted(start[lo:hi], ts, side="right")) - 1
        while i >= lo and not (end[i] > ts and kind[i] == OP):  # up to the enclosing op
            i = int(parent[i])
        key = normalise_name(d.names[int(name[i])]) if i >= lo else "<outside any op>"
        acc = out.setdefault(key, [0, 0])
        acc[0] += nbytes
        acc[1] += 1
    return out


def _folded(
    names: list[str],
    name: np.ndarray,
    kind: np.ndarray,
    parent: np.ndarray,
    self_ns: np.ndarray,
) -> dict[str, int]:
    """Self time per stack of Python frames and ops (``a;b;op``); parents precede children."""
    clean = [normalise_name(n).replace(";", ":") for n in names]
    paths = [""] * len(name)
    folded: dict[str, int] = {}
    for i, (nm, k, p, ns) in enumerate(
        zip(name.tolist(), kind.tolist(), parent.tolist(), self_ns.tolist(), strict=True)
    ):
        base = paths[p] if p >= 0 else ""
        if k in (OP, PYTHON):
            paths[i] = f"{base};{clean[nm]}" if base else clean[nm]
            if ns > 0:
                folded[paths[i]] = folded.get(paths[i], 0) + ns
        else:
            paths[i] = base
    return folded


def normalise_name(name: str) -> str:
    """Drop memory addresses (``<built-in method ... at 0x7f..>``) and cap the length."""
    name = _ADDRESS.sub("0x?", name)
    if len(name) > MAX_NAME_CHARS:
        name = name[: MAX_NAME_CHARS - 1] + "…"
    return name or "<unnamed>"
