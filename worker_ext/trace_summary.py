"""A window's summary from the chrome trace torch wrote: no torch, no Ray, no ``key_averages()``.

One streaming pass over the file (msgspec typed decode, a few MB of events at a time) collects
the CPU events per thread, the device activity and the ``[memory]`` events; one nesting pass per
thread then gives every CPU op its self time (its duration minus that of its direct children on
the same thread, as ``key_averages()`` computes it), the time breakdown and the folded stacks.

Memory stays bounded: the file is read in chunks of ``chunk_bytes`` and split at Kineto's event
boundaries, and events are kept as a few ints each. A file that is not in Kineto's layout is
decoded whole, up to ``max_unsplit_bytes``.
"""

from __future__ import annotations

import gc
import gzip
import math
import re
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import msgspec
import numpy as np

from coordinator.summary_codec import (
    MAX_NAME_CHARS,
    Breakdown,
    KernelRow,
    MemoryRow,
    RankSummary,
    StreamRow,
)

CHUNK_BYTES = 8 << 20
MAX_UNSPLIT_BYTES = 256 << 20
MEMORY_TOP_K = 20

# Kineto writes each top-level event as "\n  {\n ... }," at an indent of two; a raw newline
# never occurs inside a JSON string, so this marks event starts and nothing else.
_BOUNDARY = b"\n  {\n"
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")

# Event categories.
_CPU_CATS = {"cpu_op": 0, "user_annotation": 1, "python_function": 2, "cuda_runtime": 3}
_CPU_CATS["cuda_driver"] = 3
_OP, _ANNOTATION, _PYTHON, _RUNTIME = 0, 1, 2, 3
_DEVICE_CATS = {"kernel": 0, "gpu_memcpy": 1, "gpu_memset": 1}
# Breakdown classes.
COMPUTE, COMM, MEMCPY, OTHER = 0, 1, 2, 3
_COMM = re.compile(r"^(nccl|c10d::|gloo:|record_param_comms)", re.IGNORECASE)
# A ProcessGroup's work span ("gloo:all_reduce") starts on the calling thread and ends on the
# backend's: key_averages() treats it as async, with no self time and outside the op tree.
_ASYNC_WORK = re.compile(r"^(gloo|nccl|mpi|ucc|xccl):")
_CPU_COPY = re.compile(r"^(aten::(copy_|_to_copy|to)$|cudaMemcpy|cudaMemset|Memcpy|Memset)")


class TraceError(ValueError):
    """The trace cannot be summarised: not JSON, truncated, or in an unusable layout."""


class _Args(msgspec.Struct, gc=False):
    stream: Any = None
    device: Any = None
    bytes: Any = msgspec.field(default=None, name="Bytes")
    total_allocated: Any = msgspec.field(default=None, name="Total Allocated")
    device_type: Any = msgspec.field(default=None, name="Device Type")
    device_id: Any = msgspec.field(default=None, name="Device Id")


class _ArgsWithShapes(_Args, gc=False):
    input_dims: Any = msgspec.field(default=None, name="Input Dims")


class _Event(msgspec.Struct, gc=False):
    ph: str = ""
    cat: str = ""
    name: str = ""
    ts: float = 0.0
    dur: float = 0.0
    pid: int | str = 0
    tid: int | str = 0
    args: _Args | None = None


class _EventWithShapes(_Event, gc=False):
    args: _ArgsWithShapes | None = None


class _Doc(msgspec.Struct):
    traceEvents: list[_Event] = []  # noqa: N815 - the trace's own key


class _DocWithShapes(msgspec.Struct):
    traceEvents: list[_EventWithShapes] = []  # noqa: N815


# Input shapes are decoded only when flops are wanted: they are most of a trace's bytes.
_DECODERS = {
    False: (msgspec.json.Decoder(_Doc), msgspec.json.Decoder(list[_Event])),
    True: (msgspec.json.Decoder(_DocWithShapes), msgspec.json.Decoder(list[_EventWithShapes])),
}


def op_flops(name: str, dims: Any) -> int:
    """Flops from an op's input shapes, as ``with_flops`` counts them; 0 for other ops.

    torch also counts ``aten::conv2d`` from its strides and padding; the trace does not give
    those in a usable form, so convolutions count 0 here.
    """
    try:
        if name == "aten::mm":
            (n, k), (_, m) = dims[0], dims[1]
            return 2 * n * k * m
        if name == "aten::addmm":
            (n, k), (_, m) = dims[1], dims[2]
            return 2 * n * k * m
        if name == "aten::bmm":
            (b, n, k), (_, _, m) = dims[0], dims[1]
            return 2 * b * n * k * m
        if name == "aten::baddbmm":
            (b, n, k), (_, _, m) = dims[1], dims[2]
            return 2 * b * n * k * m
        if name == "aten::add" and dims[0]:
            return math.prod(dims[0])  # one flop per element of the first input
        if name == "aten::mul" and dims[0]:
            return math.prod(dims[0])
    except (TypeError, ValueError, IndexError):
        return 0
    return 0


@dataclass
class _Thread:
    start: array = field(default_factory=lambda: array("q"))
    end: array = field(default_factory=lambda: array("q"))
    name: array = field(default_factory=lambda: array("i"))
    kind: array = field(default_factory=lambda: array("b"))  # cpu category; -1: [memory]
    value: array = field(default_factory=lambda: array("q"))  # flops, or bytes for [memory]


@dataclass
class TraceDigest:
    """What one pass over a trace collected; ``summary()`` turns it into a ``RankSummary``."""

    names: list[str] = field(default_factory=list)
    threads: dict[Any, _Thread] = field(default_factory=dict)
    device: list[tuple[int, int, int, int, Any, Any]] = field(default_factory=list)
    steps: list[tuple[int, int, int]] = field(default_factory=list)  # step, start, end (ns)
    peak_allocated: dict[tuple[int, int], int] = field(default_factory=dict)
    events: int = 0
    _ids: dict[str, int] = field(default_factory=dict)
    _base: float | None = None

    def _id(self, name: str) -> int:
        i = self._ids.get(name)
        if i is None:
            i = self._ids[name] = len(self.names)
            self.names.append(name)
        return i

    def _ns(self, ts: float) -> int:
        if self._base is None:
            self._base = float(int(ts))
        return round((ts - self._base) * 1000.0)  # exact: ts - base is small and exact

    def add(self, events: list[_Event]) -> None:
        """Fold a batch of decoded events in."""
        self.events += len(events)
        for e in events:
            ph = e.ph
            if ph == "X":
                cat = e.cat
                kind = _CPU_CATS.get(cat)
                if kind is not None:
                    start = self._ns(e.ts)
                    end = start + round(e.dur * 1000.0)
                    t = self.threads.get((e.pid, e.tid))
                    if t is None:
                        t = self.threads[(e.pid, e.tid)] = _Thread()
                    t.start.append(start)
                    t.end.append(end)
                    t.name.append(self._id(e.name))
                    t.kind.append(kind)
                    dims = getattr(e.args, "input_dims", None)
                    t.value.append(op_flops(e.name, dims) if dims else 0)
                    if kind == _ANNOTATION:
                        m = _STEP.match(e.name)
                        if m:
                            self.steps.append((int(m.group(1)), start, end))
                    continue
                dkind = _DEVICE_CATS.get(cat)
                if dkind is not None:
                    start = self._ns(e.ts)
                    a = e.args
                    self.device.append(
                        (
                            start,
                            start + round(e.dur * 1000.0),
                            self._id(e.name),
                            dkind,
                            a.device if a is not None else None,
                            a.stream if a is not None else None,
                        )
                    )
            elif ph == "i" and e.name == "[memory]" and e.args is not None:
                self._memory(e)

    def _memory(self, e: _Event) -> None:
        a = e.args
        assert a is not None
        key = (_int_or(a.device_type, 0), _int_or(a.device_id, -1))
        total = a.total_allocated
        if type(total) is int and total > self.peak_allocated.get(key, -1):
            self.peak_allocated[key] = total
        nbytes = a.bytes
        if type(nbytes) is int and nbytes > 0:
            t = self.threads.get((e.pid, e.tid))
            if t is None:
                t = self.threads[(e.pid, e.tid)] = _Thread()
            ts = self._ns(e.ts)
            t.start.append(ts)
            t.end.append(ts)
            t.name.append(-1)
            t.kind.append(-1)
            t.value.append(nbytes)

    def summary(
        self,
        *,
        rank: int,
        window: int,
        steps: tuple[int, int],
        partial: bool,
        device: str,
        top_k: int,
        stacks: bool = False,
    ) -> tuple[RankSummary, list[str] | None]:
        """The rank's summary, and folded-stack lines (``a;b;c self_us``) when ``stacks``."""
        first, last = steps
        step_spans = sorted((s, b, e) for s, b, e in self.steps if first <= s <= last)
        if step_spans:
            w0, w1 = min(b for _, b, _ in step_spans), max(e for _, _, e in step_spans)
        else:  # no step markers: the span of the recorded CPU events
            starts = [t.start[0] for t in self.threads.values() if len(t.start)]
            w0 = min(starts, default=0)
            w1 = max((max(t.end) for t in self.threads.values() if len(t.end)), default=w0)
        window_ns = max(0, w1 - w0)
        cpu = _nest(self, stacks)
        cpu.breakdown[COMM] = _union_ns(cpu.comm_spans, w0, w1)  # wall time in collectives
        dev = _device(self, w0, w1)
        if device == "cuda" and self.device:
            rows, brk = dev.rows, dev.breakdown
        else:
            rows, brk = cpu.rows, cpu.breakdown
        named = {}
        for i, (self_ns, count, flops) in rows.items():
            if self_ns <= 0 or _STEP.match(self.names[i]):
                continue
            acc = named.setdefault(normalise_name(self.names[i]), [0, 0, 0])
            acc[0] += self_ns
            acc[1] += count
            acc[2] += flops
        ordered = sorted(named.items(), key=lambda kv: (-kv[1][0], kv[0]))
        kept, dropped = ordered[:top_k], ordered[top_k:]
        busy = brk[COMPUTE] + brk[COMM] + brk[MEMCPY]
        other = max(0, window_ns - busy) if device != "cuda" or not self.device else dev.idle_ns
        device_type = 1 if device == "cuda" else 0  # [memory] events' "Device Type"
        peaks = [v for (dt, _), v in self.peak_allocated.items() if dt == device_type]
        memory = None
        if peaks or cpu.allocations:
            top_alloc = sorted(cpu.allocations.items(), key=lambda kv: (-kv[1][0], kv[0]))
            memory = (
                max(peaks, default=0),
                [MemoryRow(name, b, c) for name, (b, c) in top_alloc[:MEMORY_TOP_K]],
            )
        summary = RankSummary(
            rank=rank,
            window=window,
            steps=steps,
            partial=partial,
            device=device,
            kernels=[KernelRow(n, v[0] / 1e3, int(v[1]), int(v[2])) for n, v in kept],
            dropped_rows=len(dropped),
            dropped_us=sum(v[0] for _, v in dropped) / 1e3,
            step_us=[(s, (e - b) / 1e3) for s, b, e in step_spans],
            breakdown=Breakdown(
                compute_us=brk[COMPUTE] / 1e3,
                comm_us=brk[COMM] / 1e3,
                memcpy_us=brk[MEMCPY] / 1e3,
                other_us=other / 1e3,
                window_us=window_ns / 1e3,
            ),
            streams=dev.streams,
            peak_bytes=memory[0] if memory else None,
            memory=memory[1] if memory else [],
        )
        folded = None
        if stacks:
            folded = [f"{path} {round(ns / 1e3)}" for path, ns in cpu.folded.items() if ns >= 500]
        return summary, folded


@dataclass
class _CpuResult:
    rows: dict[int, list[int]]  # name id -> [self ns, count, flops]
    breakdown: list[int]
    allocations: dict[str, list[int]]  # op name -> [bytes, allocations]
    folded: dict[str, int]
    comm_spans: list[tuple[int, int]]  # outermost collective spans, on every thread


def _nest(d: TraceDigest, stacks: bool) -> _CpuResult:
    """Self time per CPU event, the breakdown and the folded stacks: one pass per thread."""
    rows: dict[int, list[int]] = {}
    brk = [0, 0, 0, 0]
    allocs: dict[str, list[int]] = {}
    folded: dict[str, int] = {}
    names = d.names
    comm = [bool(_COMM.match(n)) for n in names]
    copy = [bool(_CPU_COPY.match(n)) for n in names]
    work = [bool(_ASYNC_WORK.match(n)) for n in names]
    comm_spans: list[tuple[int, int]] = []
    clean = [normalise_name(n).replace(";", ":") for n in names] if stacks else []
    for t in d.threads.values():
        n = len(t.start)
        if not n:
            continue
        start = np.frombuffer(t.start, dtype=np.int64)
        end = np.frombuffer(t.end, dtype=np.int64)
        order = np.lexsort((-end, start)).tolist()
        starts, ends = t.start.tolist(), t.end.tolist()
        name, kind, value = t.name.tolist(), t.kind.tolist(), t.value.tolist()
        child = [0] * n
        children = [0] * n
        parents = [-1] * n
        klass = [OTHER] * n
        path = [""] * n if stacks else None
        stack: list[int] = []
        for i in order:
            s, e = starts[i], ends[i]
            while stack:
                p = stack[-1]
                pe = ends[p]
                if s >= pe or e > pe:
                    stack.pop()
                else:
                    break
            k = kind[i]
            if k == _ANNOTATION and work[name[i]]:
                comm_spans.append((s, e))
                continue  # async work: outside the tree, no self time
            if k < 0:  # a [memory] allocation: charge the innermost enclosing op
                op = next((j for j in reversed(stack) if kind[j] == _OP), None)
                key = names[name[op]] if op is not None else "<outside any op>"
                acc = allocs.setdefault(normalise_name(key), [0, 0])
                acc[0] += value[i]
                acc[1] += 1
                continue
            parent = stack[-1] if stack else None
            nm = name[i]
            if parent is not None:
                child[parent] += e - s
                children[parent] += 1
                parents[i] = parent
                inherited = klass[parent]
            else:
                inherited = OTHER
            if comm[nm] or inherited == COMM:
                klass[i] = COMM
                if inherited != COMM:
                    comm_spans.append((s, e))
            elif copy[nm] or inherited == MEMCPY:
                klass[i] = MEMCPY
            elif k == _OP:
                klass[i] = COMPUTE
            if path is not None:
                base = path[parent] if parent is not None else ""
                if k in (_OP, _PYTHON):
                    path[i] = f"{base};{clean[nm]}" if base else clean[nm]
                else:
                    path[i] = base
            stack.append(i)
        for i in range(n):
            k = kind[i]
            if k < 0:
                continue
            if k == _ANNOTATION and work[name[i]]:
                acc = rows.setdefault(name[i], [0, 0, 0])
                acc[1] += 1
                continue
            self_ns = ends[i] - starts[i] - child[i]
            acc = rows.get(name[i])
            if acc is None:
                acc = rows[name[i]] = [0, 0, 0]
            acc[0] += self_ns
            p = parents[i]
            # key_averages() folds an op into a same-named parent whose only child it is.
            if p < 0 or name[p] != name[i] or children[p] != 1:
                acc[1] += 1
                acc[2] += value[i]
            if klass[i] in (COMPUTE, MEMCPY) and self_ns > 0:
                brk[klass[i]] += self_ns
            if path is not None and k in (_OP, _PYTHON) and self_ns > 0:
                folded[path[i]] = folded.get(path[i], 0) + self_ns
    return _CpuResult(rows, brk, allocs, folded, comm_spans)


@dataclass
class _DeviceResult:
    rows: dict[int, list[int]]
    breakdown: list[int]
    streams: list[StreamRow]
    idle_ns: int


def _device(d: TraceDigest, w0: int, w1: int) -> _DeviceResult:
    """Device activity timed by its own duration; busy and idle time per stream in the window."""
    rows: dict[int, list[int]] = {}
    brk = [0, 0, 0, 0]
    per_stream: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for s, e, nm, kind, dev, stream in d.device:
        dur = e - s
        acc = rows.get(nm)
        if acc is None:
            acc = rows[nm] = [0, 0, 0]
        acc[0] += dur
        acc[1] += 1
        if kind == 1:
            brk[MEMCPY] += dur
        elif _COMM.match(d.names[nm]):
            brk[COMM] += dur
        else:
            brk[COMPUTE] += dur
        per_stream.setdefault((_int_or(dev, 0), _int_or(stream, 0)), []).append((s, e))
    streams = []
    everything = []
    for (dev, stream), spans in sorted(per_stream.items()):
        busy = _union_ns(spans, w0, w1)
        everything.extend(spans)
        streams.append(StreamRow(dev, stream, busy / 1e3, max(0, (w1 - w0) - busy) / 1e3))
    idle = max(0, (w1 - w0) - _union_ns(everything, w0, w1)) if everything else w1 - w0
    return _DeviceResult(rows, brk, streams, idle)


def _union_ns(spans: list[tuple[int, int]], lo: int, hi: int) -> int:
    """Length of the union of ``spans`` clipped to ``[lo, hi]``."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(spans):
        s, e = max(s, lo), min(e, hi)
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def normalise_name(name: str) -> str:
    """Drop memory addresses (``<built-in method ... at 0x7f..>``) and cap the length."""
    name = _ADDRESS.sub("0x?", name)
    if len(name) > MAX_NAME_CHARS:
        name = name[: MAX_NAME_CHARS - 1] + "…"
    return name or "<unnamed>"


def _int_or(value: Any, default: int) -> int:
    return value if type(value) is int else default


# ------------------------------------------------------------------------ reading


def read_trace(
    path: str,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    max_unsplit_bytes: int = MAX_UNSPLIT_BYTES,
    flops: bool = False,
) -> TraceDigest:
    """One streaming pass over a chrome trace (``.json`` or ``.json.gz``).

    Raises ``TraceError`` with the reason for a file that is not JSON, truncated, or unusable.
    """
    digest = TraceDigest()
    gc_was_on = gc.isenabled()
    gc.disable()  # a million small objects, no cycles: collections only cost time
    opener: Callable[..., IO[bytes]] = gzip.open if path.endswith(".gz") else open  # type: ignore[assignment]
    try:
        with opener(path, "rb") as f:
            for batch in _event_batches(f, chunk_bytes, max_unsplit_bytes, flops):
                digest.add(batch)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TraceError(f"{path} is not a valid chrome trace (truncated?): {exc}") from None
    except (OSError, EOFError) as exc:
        raise TraceError(f"{path} cannot be read: {exc}") from None
    finally:
        if gc_was_on:
            gc.enable()
    return digest


def _event_batches(
    f: IO[bytes],
    chunk_bytes: int,
    max_unsplit_bytes: int,
    flops: bool,
) -> Iterator[list[_Event]]:
    doc, events = _DECODERS[flops]
    buf = bytearray()
    in_events = False
    while True:
        data = f.read(chunk_bytes)
        buf += data
        if not in_events:
            i = buf.find(_BOUNDARY)
            if i < 0:
                if not data:  # not Kineto's layout, and small enough: decode it whole
                    if not buf.strip():
                        raise TraceError("the trace file is empty")
                    yield doc.decode(bytes(buf)).traceEvents
                    return
                if len(buf) > max_unsplit_bytes:
                    raise TraceError(
                        f"no event boundary in the first {len(buf) >> 20} MB: the trace is not "
                        "in Kineto's layout and is too large to decode whole"
                    )
                continue
            head = bytes(buf[:i]).rstrip()
            if not head.endswith(b"["):
                raise TraceError("the trace does not start with a traceEvents list")
            yield doc.decode(head + b"]}").traceEvents
            del buf[:i]
            in_events = True
        if not data:  # the last event, then the closing "]" and the trailing keys
            yield doc.decode(b'{"traceEvents":[' + bytes(buf)).traceEvents
            return
        j = buf.rfind(_BOUNDARY)
        if j > 0:
            if buf[0] == 0x0A and buf[j - 1] == 0x2C:  # "\n  {...},": make it "[ {...}]" in place
                buf[0], buf[j - 1] = 0x5B, 0x5D
                with memoryview(buf) as view:
                    yield events.decode(view[:j])
            else:
                body = bytes(buf[:j]).rstrip().removesuffix(b",")
                yield events.decode(b"[" + body.lstrip() + b"]")
            del buf[:j]


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
) -> tuple[RankSummary, list[str] | None]:
    """Read ``path`` once and build the rank's summary (and folded stacks when ``stacks``).

    ``flops``: count matrix-product flops from the recorded input shapes (``with_flops``).
    """
    digest = read_trace(path, chunk_bytes=chunk_bytes, flops=flops)
    return digest.summary(
        rank=rank,
        window=window,
        steps=steps,
        partial=partial,
        device=device,
        top_k=top_k,
        stacks=stacks,
    )
