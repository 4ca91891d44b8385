"""One streaming pass over a chrome trace into a few columns of integers: no torch, no Ray.

The file is read ``chunk_bytes`` at a time and split at Kineto's event boundaries (a file in
any other layout, 64 KB at a time after the last event that ends in the piece); each piece is
decoded with msgspec into structs that keep only ``ph, cat, name, ts, dur, pid, tid`` and leave
``args`` undecoded (``msgspec.Raw``). Arguments are decoded only for the few events that need
them: device activity (stream, device), ``[memory]`` events, and the matrix products whose input
shapes give flops. Each batch then becomes numpy columns in a handful of list comprehensions, so
memory grows with the number of events (about 40 bytes a CPU event, about 190 bytes a device
event), not with the file.
"""

from __future__ import annotations

import gc
import gzip
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import msgspec
import numpy as np

CHUNK_BYTES = 1 << 20
MAX_UNSPLIT_BYTES = 256 << 20

# Kineto writes each top-level event as "\n  {\n ... }," at an indent of two; a raw newline
# never occurs inside a JSON string, so this marks event starts and nothing else.
_BOUNDARY = b"\n  {\n"
STEP_NAME = re.compile(r"^ProfilerStep#(\d+)$")

# CPU event kinds, as stored in ``CpuColumns.kind``.
OP, ANNOTATION, PYTHON, RUNTIME = 0, 1, 2, 3
_CPU_KINDS = {
    "cpu_op": OP,
    "user_annotation": ANNOTATION,
    "python_function": PYTHON,
    "cuda_runtime": RUNTIME,
    "cuda_driver": RUNTIME,
}
# Device activity kinds: kernels, and memory copies / sets.
KERNEL, COPY = 0, 1
_DEVICE_KINDS = {"kernel": KERNEL, "gpu_memcpy": COPY, "gpu_memset": COPY}


class TraceError(ValueError):
    """The trace cannot be summarised: not JSON, truncated, or in an unusable layout."""


class _Event(msgspec.Struct, gc=False):
    ph: str = ""
    cat: str = ""
    name: str = ""
    ts: float = 0.0
    dur: float = 0.0
    pid: int | str = 0
    tid: int | str = 0
    args: msgspec.Raw = msgspec.Raw()


class _Doc(msgspec.Struct):
    traceEvents: list[_Event] = []  # noqa: N815 - the trace's own key
    distributedInfo: Any = None  # noqa: N815 - torch writes it with a process group
    rank: Any = None  # preset_metadata_json("rank", ...), read by HTA
    baseTimeNanoseconds: Any = None  # noqa: N815 - the wall clock ``ts`` counts from
    host_name: Any = None  # the host that wrote it (kineto's top-level key)


class _DeviceArgs(msgspec.Struct, gc=False):
    stream: Any = None
    device: Any = None
    correlation: Any = None


class _LaunchArgs(msgspec.Struct, gc=False):
    correlation: Any = None


class _MemoryArgs(msgspec.Struct, gc=False):
    bytes: Any = msgspec.field(default=None, name="Bytes")
    total_allocated: Any = msgspec.field(default=None, name="Total Allocated")
    device_type: Any = msgspec.field(default=None, name="Device Type")
    device_id: Any = msgspec.field(default=None, name="Device Id")


class _ShapeArgs(msgspec.Struct, gc=False):
    input_dims: Any = msgspec.field(default=None, name="Input Dims")


class _MatmulArgs(msgspec.Struct, gc=False):
    input_dims: Any = msgspec.field(default=None, name="Input Dims")
    input_type: Any = msgspec.field(default=None, name="Input type")


class CommArgs(msgspec.Struct, gc=False):
    """The arguments a collective's events may carry (``record_param_comms`` on NCCL; input
    shapes on c10d's and gloo's ops with ``record_shapes``); each may be missing or odd."""

    group: Any = msgspec.field(default=None, name="Process Group Name")
    group_ranks: Any = msgspec.field(default=None, name="Process Group Ranks")
    group_size: Any = msgspec.field(default=None, name="Group size")
    in_nelems: Any = msgspec.field(default=None, name="In msg nelems")
    out_nelems: Any = msgspec.field(default=None, name="Out msg nelems")
    dtype: Any = None
    seq: Any = msgspec.field(default=None, name="Seq")
    collective: Any = msgspec.field(default=None, name="Collective name")
    input_dims: Any = msgspec.field(default=None, name="Input Dims")
    input_type: Any = msgspec.field(default=None, name="Input type")


_DOC = msgspec.json.Decoder(_Doc)
_EVENTS = msgspec.json.Decoder(list[_Event])
_DEVICE_ARGS = msgspec.json.Decoder(_DeviceArgs)
_DEVICE_ARGS_LIST = msgspec.json.Decoder(list[_DeviceArgs])
_LAUNCH_ARGS = msgspec.json.Decoder(_LaunchArgs)
_LAUNCH_ARGS_LIST = msgspec.json.Decoder(list[_LaunchArgs])
_MEMORY_ARGS = msgspec.json.Decoder(_MemoryArgs)
_SHAPE_ARGS = msgspec.json.Decoder(_ShapeArgs)
_COMM_ARGS = msgspec.json.Decoder(CommArgs)
_MATMUL_ARGS = msgspec.json.Decoder(_MatmulArgs)
_MATMUL_ARGS_LIST = msgspec.json.Decoder(list[_MatmulArgs])
# CPU events a collective leaves: c10d's op on the calling thread, NCCL's ``record_param_comms``
# under it, and the backend's own span (``gloo:all_reduce`` on gloo's thread, ``nccl:...``).
_COMM_EVENT = re.compile(r"^(c10d::|gloo:|nccl:|record_param_comms$)")


FLOP_OPS = frozenset(
    {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::add", "aten::mul"}
)


def op_flops(name: str, args: Any) -> int:
    """Flops from an op's input shapes, as ``with_flops`` counts them; 0 for other ops.

    torch also counts ``aten::conv2d`` from its strides and padding; the trace does not give
    those in a usable form, so convolutions count 0 here.
    """
    dims: Any = getattr(args, "input_dims", None)
    try:
        if name == "aten::mm":
            (n, k), (_, m) = dims[0], dims[1]
            return int(2 * n * k * m)
        if name == "aten::addmm":
            (n, k), (_, m) = dims[1], dims[2]
            return int(2 * n * k * m)
        if name == "aten::bmm":
            (b, n, k), (_, _, m) = dims[0], dims[1]
            return int(2 * b * n * k * m)
        if name == "aten::baddbmm":
            (b, n, k), (_, _, m) = dims[1], dims[2]
            return int(2 * b * n * k * m)
        if name in ("aten::add", "aten::mul") and dims[0]:
            return int(math.prod(dims[0]))  # one flop per element of the first input
    except (TypeError, ValueError, IndexError):
        return 0
    return 0


# The findings' ``matmul_alignment`` (issue 57): PyTorch's pattern matcher's
# ``MatMulDimInFP16Pattern`` flags these ops when their first input is fp16 or bf16 and a dim
# among the last two of any input is not a multiple of 8 (Tensor Cores' 16 bytes).
MATMUL_OPS = frozenset({"aten::mm", "aten::bmm", "aten::addmm"})
HALF_TYPES = frozenset({"c10::Half", "c10::BFloat16"})
MATMUL_ALIGN = 8
MAX_SHAPE_CHARS = 120


def misaligned_dims(name: str, args: Any) -> str | None:
    """An fp16/bf16 matmul op's input dims as text (``aten::mm [2047, 64] [64, 512]``) when a
    dim among the last two of an input is not a multiple of ``MATMUL_ALIGN`` (the pattern
    matcher's test); None otherwise, and where the trace has no shapes (not judged)."""
    types: Any = getattr(args, "input_type", None)
    dims: Any = getattr(args, "input_dims", None)
    if not isinstance(types, list) or not types or not isinstance(types[0], str):
        return None
    if types[0] not in HALF_TYPES:
        return None
    if not isinstance(dims, list) or not all(isinstance(d, list) for d in dims):
        return None
    last = [x for d in dims for x in d[-2:]]
    if not all(type(x) is int for x in last) or all(x % MATMUL_ALIGN == 0 for x in last):
        return None
    text = f"{name} " + " ".join(str(d) for d in dims if d)
    return text[:MAX_SHAPE_CHARS]


@dataclass
class CpuColumns:
    """Every CPU event (``X`` events of the CPU categories), one array per field."""

    thread: np.ndarray  # int32: index into ``TraceDigest.threads``
    start: np.ndarray  # int64 ns from the trace's first timestamp
    end: np.ndarray  # int64 ns
    name: np.ndarray  # int32: index into ``TraceDigest.names``
    kind: np.ndarray  # int8: OP, ANNOTATION, PYTHON or RUNTIME
    flops: np.ndarray  # int64: from input shapes when flops were asked for, else 0
    corr: np.ndarray  # int64: a launch's (RUNTIME) correlation with its device activity, else -1


@dataclass
class TraceDigest:
    """What one pass over a trace collected; ``trace_summary`` turns it into a summary."""

    names: list[str] = field(default_factory=list)
    threads: list[tuple[Any, Any]] = field(default_factory=list)  # (pid, tid)
    # device activity: start ns, end ns, name id, KERNEL or COPY, device, stream, correlation
    # (-1: none, so no launch can be found for it)
    device: list[tuple[int, int, int, int, int, int, int]] = field(default_factory=list)
    steps: list[tuple[int, int, int]] = field(default_factory=list)  # step, start ns, end ns
    peak_allocated: dict[tuple[int, int], int] = field(default_factory=dict)
    # per (device type, device id): [ts ns of the peak, bytes allocated, bytes freed]
    memory_flow: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    # [memory] allocations (frees left out): thread, ts ns, bytes
    allocations: list[tuple[int, int, int]] = field(default_factory=list)
    events: int = 0
    rank: int | None = None
    """The rank the trace names (``distributedInfo.rank``, else a top-level ``rank``)."""
    # collectives' CPU events (``_COMM_EVENT``): thread, start ns, end ns, name, args
    comm: list[tuple[int, int, int, str, CommArgs | None]] = field(default_factory=list)
    groups: Any = None
    """``distributedInfo.pg_config`` as the trace has it (checked by its reader), else None."""
    base_ns: int | None = None
    """``baseTimeNanoseconds``: what the trace's ``ts`` count from (None: not in the trace)."""
    host: str | None = None
    """``host_name``: the host that wrote the trace (None: not in the trace)."""
    world_size: int | None = None
    """``distributedInfo.world_size`` (None: not in the trace)."""
    matmuls: list[tuple[int, str]] = field(default_factory=list)
    """fp16/bf16 matmul ops with a dim not a multiple of 8 (``misaligned_dims``): the op's
    index among the CPU events (file order, as ``cpu()`` has them) and its dims as text."""
    _ids: dict[str, int] = field(default_factory=dict)
    _thread_ids: dict[tuple[Any, Any], int] = field(default_factory=dict)
    _chunks: list[CpuColumns] = field(default_factory=list)
    _base: float | None = None
    _comm_names: list[bool] = field(default_factory=list)  # by name id: a collective's event?
    _matmul_names: list[bool] = field(default_factory=list)  # by name id: in MATMUL_OPS?
    _matmul_seen: bool = False  # any of them
    matmuls_shaped: int = 0
    """Matmul ops (``MATMUL_OPS``) recorded with their input types and dims (``record_shapes``):
    the ones ``matmul_alignment`` can judge."""
    _cpu_events: int = 0  # CPU events folded in so far

    @property
    def base_us(self) -> float:
        """The wall-clock microsecond the digest's nanoseconds count from: the trace's
        ``baseTimeNanoseconds`` plus its first ``ts``."""
        return (self.base_ns or 0) / 1e3 + (self._base or 0.0)

    def take_head(self, doc: Any) -> None:
        """The top-level keys around the events: the rank, the process groups, the clock, the
        host."""
        rank = trace_rank(doc)
        if rank is not None:
            self.rank = rank
        info = getattr(doc, "distributedInfo", None)
        if isinstance(info, dict) and info.get("pg_config") is not None:
            self.groups = info.get("pg_config")
        world = info.get("world_size") if isinstance(info, dict) else None
        if type(world) is int and 0 < world < 2**31:
            self.world_size = world
        base = getattr(doc, "baseTimeNanoseconds", None)
        if type(base) is int and 0 <= base < 2**63:
            self.base_ns = base
        host = getattr(doc, "host_name", None)
        if isinstance(host, str) and 0 < len(host) <= 256:
            self.host = host

    def cpu(self) -> CpuColumns:
        """All CPU events collected so far, in file order."""
        if len(self._chunks) != 1:
            cols = [np.concatenate([getattr(c, f) for c in self._chunks]) for f in _CPU_FIELDS]
            self._chunks = [CpuColumns(*cols)] if self._chunks else [_empty_cpu()]
        return self._chunks[0]

    def add(self, events: list[_Event], flops: bool = False) -> None:
        """Fold a batch of decoded events in."""
        self.events += len(events)
        if not events:
            return
        if self._base is None:
            self._base = float(int(events[0].ts))
        cpu = [e for e in events if e.ph == "X" and e.cat in _CPU_KINDS]
        if cpu:
            self._add_cpu(cpu, flops)
        device = [e for e in events if e.ph == "X" and e.cat in _DEVICE_KINDS]
        for e, a in zip(device, _decode_all(_DEVICE_ARGS, _DEVICE_ARGS_LIST, device), strict=True):
            self._add_device(e, _DEVICE_KINDS[e.cat], a)
        for e in events:
            if e.ph == "i" and e.name == "[memory]" and e.args:
                self._add_memory(e)

    def _add_cpu(self, cpu: list[_Event], flops: bool) -> None:
        ids, tids = self._ids, self._thread_ids
        first_new = len(ids)
        name = np.array([ids.setdefault(e.name, len(ids)) for e in cpu], dtype=np.int32)
        self.names.extend(list(ids)[first_new:])
        pids = {e.pid for e in cpu}
        if len(pids) == 1:  # one process (a rank's trace): threads by tid, no tuple per event
            (pid,) = pids
            keys = {tid: (pid, tid) for tid in {e.tid for e in cpu}}
            for key in keys.values():
                tids.setdefault(key, len(tids))
            local = {tid: tids[key] for tid, key in keys.items()}
            thread = np.array([local[e.tid] for e in cpu], dtype=np.int32)
        else:
            thread = np.array(
                [tids.setdefault((e.pid, e.tid), len(tids)) for e in cpu], dtype=np.int32
            )
        if len(tids) > len(self.threads):
            self.threads.extend(list(tids)[len(self.threads) :])
        kind = np.array([_CPU_KINDS[e.cat] for e in cpu], dtype=np.int8)
        start = self._ns(np.array([e.ts for e in cpu]))
        end = start + np.rint(np.array([e.dur for e in cpu]) * 1000.0).astype(np.int64)
        value = np.zeros(len(cpu), dtype=np.int64)
        if flops:
            for i, e in enumerate(cpu):
                if e.name in FLOP_OPS and e.args:
                    value[i] = min(op_flops(e.name, _decode_or_none(_SHAPE_ARGS, e.args)), 2**62)
        for i in np.flatnonzero(kind == ANNOTATION).tolist():
            m = STEP_NAME.match(cpu[i].name)
            if m:
                self.steps.append((int(m.group(1)), int(start[i]), int(end[i])))
        comm_names = self._comm_names
        for n in range(len(comm_names), len(ids)):
            comm_names.append(_COMM_EVENT.match(self.names[n]) is not None)
        if any(comm_names):
            for i in np.flatnonzero(np.array(comm_names, dtype=bool)[name]).tolist():
                e = cpu[i]
                args = _decode_or_none(_COMM_ARGS, e.args) if e.args else None
                self.comm.append((int(thread[i]), int(start[i]), int(end[i]), e.name, args))
        corr = np.full(len(cpu), -1, dtype=np.int64)
        launches = np.flatnonzero(kind == RUNTIME).tolist()
        found = _decode_all(_LAUNCH_ARGS, _LAUNCH_ARGS_LIST, [cpu[i] for i in launches])
        for i, a in zip(launches, found, strict=True):
            corr[i] = _int_or(a.correlation if a else None, -1)
        self._add_matmuls(cpu, name)
        self._chunks.append(CpuColumns(thread, start, end, name, kind, value, corr))
        self._cpu_events += len(cpu)

    def _add_matmuls(self, cpu: list[_Event], name: np.ndarray) -> None:
        """``matmuls``: the batch's misaligned fp16/bf16 matmul ops (their args decoded)."""
        known = self._matmul_names
        new = [n in MATMUL_OPS for n in self.names[len(known) :]]
        known += new
        self._matmul_seen = self._matmul_seen or any(new)
        if not self._matmul_seen:
            return
        idx = np.flatnonzero(np.array(known, dtype=bool)[name]).tolist()
        found = _decode_all(_MATMUL_ARGS, _MATMUL_ARGS_LIST, [cpu[i] for i in idx])
        for i, a in zip(idx, found, strict=True):
            shaped = a is not None and isinstance(a.input_type, list)
            self.matmuls_shaped += shaped and isinstance(a.input_dims, list)
            text = misaligned_dims(cpu[i].name, a)
            if text is not None:
                self.matmuls.append((self._cpu_events + i, text))

    def _add_device(self, e: _Event, kind: int, a: Any) -> None:
        start = self._ns1(e.ts)
        self.device.append(
            (
                start,
                start + round(e.dur * 1000.0),
                self._id(e.name),
                kind,
                _int_or(a.device if a else None, _int_or(e.pid, 0)),
                _int_or(a.stream if a else None, _int_or(e.tid, 0)),
                _int_or(a.correlation if a else None, -1),
            )
        )

    def _add_memory(self, e: _Event) -> None:
        a = _decode_or_none(_MEMORY_ARGS, e.args)
        if a is None:
            return
        key = (_int_or(a.device_type, 0), _int_or(a.device_id, -1))
        flow = self.memory_flow.setdefault(key, [0, 0, 0])
        total = a.total_allocated
        if type(total) is int and total > self.peak_allocated.get(key, -1):
            self.peak_allocated[key] = total
            flow[0] = self._ns1(e.ts)
        nbytes = a.bytes
        if type(nbytes) is int:
            flow[1 if nbytes > 0 else 2] += abs(nbytes)
        if type(nbytes) is int and nbytes > 0:
            tids = self._thread_ids
            thread = tids.setdefault((e.pid, e.tid), len(tids))
            if thread == len(self.threads):
                self.threads.append((e.pid, e.tid))
            self.allocations.append((thread, self._ns1(e.ts), nbytes))

    def _id(self, name: str) -> int:
        i = self._ids.get(name)
        if i is None:
            i = self._ids[name] = len(self.names)
            self.names.append(name)
        return i

    def _ns(self, ts: np.ndarray) -> np.ndarray:
        assert self._base is not None
        return np.rint((ts - self._base) * 1000.0).astype(np.int64)

    def _ns1(self, ts: float) -> int:
        assert self._base is not None
        return round((ts - self._base) * 1000.0)  # exact: ts - base is small and exact


_CPU_FIELDS = ("thread", "start", "end", "name", "kind", "flops", "corr")


def _empty_cpu() -> CpuColumns:
    i32, i64 = np.zeros(0, np.int32), np.zeros(0, np.int64)
    return CpuColumns(i32, i64, i64, i32, np.zeros(0, np.int8), i64, i64)


def trace_rank(doc: Any) -> int | None:
    """The rank a trace's top-level keys name: ``distributedInfo.rank``, else ``rank`` (as
    HTA reads it); None when neither is an int (or a string of one)."""
    info = getattr(doc, "distributedInfo", None)
    for value in (info.get("rank") if isinstance(info, dict) else None, doc.rank):
        if isinstance(value, bool):
            continue
        if isinstance(value, int) and value >= 0:
            return value
        if isinstance(value, str) and value.strip().isdigit():
            return int(value.strip())
    return None


def _decode_or_none(decoder: msgspec.json.Decoder[Any], raw: msgspec.Raw) -> Any:
    try:
        return decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None  # an event's odd args cost that event's extra fields, not the trace


def _decode_all(
    one: msgspec.json.Decoder[Any], many: msgspec.json.Decoder[Any], events: list[_Event]
) -> list[Any]:
    """Each event's ``args`` decoded (None where it has none or they are odd): in one call
    for the batch, one by one only when some event's ``args`` are odd."""
    raws = [bytes(e.args) if e.args else b"{}" for e in events]
    try:
        found: list[Any] = many.decode(b"[" + b",".join(raws) + b"]")
    except (msgspec.DecodeError, msgspec.ValidationError):
        found = [_decode_or_none(one, e.args) if e.args else None for e in events]
    return found


def _int_or(value: Any, default: int) -> int:
    return value if type(value) is int else default


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
            for batch, head in _event_batches(f, chunk_bytes, max_unsplit_bytes):
                digest.add(batch, flops)
                if head is not None:
                    digest.take_head(head)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TraceError(f"{path} is not a valid chrome trace (truncated?): {exc}") from None
    except (OSError, EOFError) as exc:
        raise TraceError(f"{path} cannot be read: {exc}") from None
    finally:
        if gc_was_on:
            gc.enable()
    return digest


def _event_batches(
    f: IO[bytes], chunk_bytes: int, max_unsplit_bytes: int
) -> Iterator[tuple[list[_Event], _Doc | None]]:
    """Decoded events, a chunk at a time, with the top-level keys around them (the head and
    the tail of the file have them). Each piece is decoded from its own
    ``bytes``, which the undecoded ``args`` of its events point into, so the read buffer can
    move on. Kineto's layout is split at its event boundaries; any other layout (one line of
    JSON, say) where its events' JSON structure ends (``_compact_batches``)."""
    buf = bytearray()
    in_events = False
    key: re.Match[bytes] | None = None
    while True:  # (the head is read in small pieces: it may be all a compact file's scan sees)
        data = f.read(chunk_bytes if in_events else min(chunk_bytes, COMPACT_CHUNK_BYTES))
        scan_from = max(0, len(buf) - _LOOKAHEAD)  # the bytes before were searched already
        buf += data
        if not in_events:
            i = buf.find(_BOUNDARY, scan_from)
            if i < 0:
                key = key or _EVENTS_KEY.search(buf, scan_from)
                if key is not None and data and len(buf) - key.end() < _LOOKAHEAD:
                    continue  # Kineto's first boundary may follow just past this chunk
                if key is not None:  # not Kineto's layout: split where each event ends
                    yield from _compact_batches(f, buf, key.end(), chunk_bytes, max_unsplit_bytes)
                    return
                if not data:  # no traceEvents list at all: decode it whole (it is small)
                    if not buf.strip():
                        raise TraceError("the trace file is empty")
                    doc = _DOC.decode(bytes(buf))
                    yield doc.traceEvents, doc
                    return
                if len(buf) > max_unsplit_bytes:
                    raise TraceError(
                        f"no traceEvents list in the first {len(buf) >> 20} MB: not a chrome trace"
                    )
                continue
            head = bytes(buf[:i]).rstrip()
            if not head.endswith(b"["):
                raise TraceError("the trace does not start with a traceEvents list")
            doc = _DOC.decode(head + b"]}")
            yield doc.traceEvents, doc
            del buf[:i]
            in_events = True
        if not data:  # the last event, then the closing "]" and the trailing keys
            doc = _DOC.decode(b'{"traceEvents":[' + bytes(buf))
            yield doc.traceEvents, doc
            return
        j = buf.rfind(_BOUNDARY)
        if j > 0:
            yield _EVENTS.decode(_as_list(buf, j)), None
            del buf[:j]


_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_LOOKAHEAD = 64  # bytes past the key that settle which layout a file has
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_Q, _OPEN, _CLOSE_OBJECT, _CLOSE_LIST = 1, 2, 3, 4
_MARKS = bytes(
    {
        ord('"'): _Q,
        ord("{"): _OPEN,
        ord("["): _OPEN,
        ord("}"): _CLOSE_OBJECT,
        ord("]"): _CLOSE_LIST,
    }.get(c, 0)
    for c in range(256)
)
COMPACT_CHUNK_BYTES = 64 << 10  # the scan's temporaries are a few times the piece it scans


def _compact_batches(
    f: IO[bytes], buf: bytearray, start: int, chunk_bytes: int, max_unsplit_bytes: int
) -> Iterator[tuple[list[_Event], _Doc | None]]:
    """The events of a trace in any layout, ``buf[start:]`` just inside its ``traceEvents``
    list: each piece of the read buffer is cut after the last event that ends in it, so every
    piece decodes by itself and the next one starts clean. The cut is first guessed at the last
    ``},`` (``_cut_at_a_guess``); where no guess decodes, and at the list's end, the buffer's
    structure is scanned (``_event_ends``)."""
    head = bytes(buf[:start]).rstrip()
    try:
        doc = _DOC.decode(head + b"]}")
    except (msgspec.DecodeError, msgspec.ValidationError):
        doc = _Doc()  # a head that is not an object of its own: its events still count
    yield [], doc
    del buf[:start]
    eof = False
    while True:
        cut, events = (0, []) if eof else _cut_at_a_guess(buf)
        if cut == 0:
            last_end, close = _event_ends(buf)
            cut = close if close >= 0 else last_end + 1
            if cut > 0 or close == 0:
                piece = _as_list(buf, cut)
                events = _EVENTS.decode(piece) if len(piece) > 2 else []
            if close >= 0:  # the list's end: the trailing keys follow
                yield events, None
                tail = bytes(buf[close + 1 :]) + f.read()
                doc = _DOC.decode(b'{"traceEvents":[]' + tail)
                yield [], doc
                return
            if eof:
                raise TraceError(
                    "not a valid chrome trace: it ends inside its traceEvents list (truncated?)"
                )
        if cut > 0:
            yield events, None
            del buf[:cut]
        if len(buf) > max_unsplit_bytes:  # what is left is one event that has not ended yet
            raise TraceError(
                f"an event of over {len(buf):,} bytes (the limit is {max_unsplit_bytes:,}): "
                "too large to decode"
            )
        data = f.read(min(chunk_bytes, COMPACT_CHUNK_BYTES))
        eof = not data
        buf += data


_GUESSES = 2  # failed guesses cost a decode each: then the scan, whose cost is bounded


def _cut_at_a_guess(buf: bytearray) -> tuple[int, list[_Event]]:
    """The events before the last ``},`` in ``buf`` (or the one before it), and where they end;
    (0, []) when neither decodes. A guess decodes only where it is right: a cut inside a string
    leaves that string open and one inside an event's arguments leaves a bracket open, and
    msgspec refuses both; so a validating decode is what checks the guess."""
    end = len(buf)
    for _ in range(_GUESSES):
        i = buf.rfind(b"},", 0, end)
        if i < 0:
            break
        try:
            return i + 1, _EVENTS.decode(_as_list(buf, i + 1))
        except (msgspec.DecodeError, msgspec.ValidationError):
            end = i
    return 0, []


def _event_ends(buf: bytearray) -> tuple[int, int]:
    """In ``buf``, events of a JSON list starting clean (outside any string, at the list's
    level): the offset of the last ``}`` that ends an event (-1: none), and of the ``]`` that
    ends the list (-1: not in ``buf``). Strings are skipped by their real quotes (a quote
    after an even run of backslashes); only quote and bracket positions are kept, not one
    value per byte."""
    marks = buf.translate(_MARKS)  # one byte per byte: which of the few that matter it is
    kind = np.frombuffer(marks, dtype=np.uint8)
    pos = np.flatnonzero(kind)
    kind = kind[pos]  # (a copy: fancy indexing)
    del marks
    quote = kind == _Q
    after_backslash = pos[quote & (pos > 0)]
    after_backslash = after_backslash[
        np.frombuffer(buf, np.uint8)[after_backslash - 1] == _BACKSLASH
    ]
    escaped = [i for i in after_backslash.tolist() if _backslashes_before(buf, i) % 2 == 1]
    if escaped:  # (rare: a quote inside a string)
        quote[np.searchsorted(pos, escaped)] = False
    outside = (np.cumsum(quote) % 2 == 0) & (kind >= _OPEN)  # brackets not inside a string
    where, kind = pos[outside], kind[outside]
    depth = np.cumsum(np.where(kind == _OPEN, 1, -1))
    ends = where[(kind == _CLOSE_OBJECT) & (depth == 0)]
    closes = where[(kind == _CLOSE_LIST) & (depth == -1)]
    close = int(closes[0]) if len(closes) else -1
    if close >= 0:
        ends = ends[ends < close]
    return (int(ends[-1]) if len(ends) else -1), close


def _backslashes_before(buf: bytearray, i: int) -> int:
    j = i - 1
    while j >= 0 and buf[j] == _BACKSLASH:
        j -= 1
    return i - 1 - j


def _as_list(buf: bytearray, j: int) -> bytes:
    """``buf[:j]``, a run of ``{...},`` events (a comma and white space around them), as one
    JSON list in a single copy."""
    a, b = 0, j
    while a < b and buf[a] in b" \t\r\n,":  # (the comma after the piece before)
        a += 1
    while b > a and buf[b - 1] in b" \t\r\n":
        b -= 1
    if b > a and buf[b - 1] == 0x2C:  # the comma before the next event
        b -= 1
    with memoryview(buf) as view:
        return b"".join((b"[", view[a:b], b"]"))
