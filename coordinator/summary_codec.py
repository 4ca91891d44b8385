"""Per-rank, per-window kernel summary and its msgpack wire format.

The decoder is strict: it caps the payload, every string, list and map before it allocates, checks
every type and range, and raises ``SummaryDecodeError`` (a ValueError) on anything else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgpack

SUMMARY_VERSION = 2
MAX_PAYLOAD_BYTES = 4 * 1024 * 1024
MAX_NAME_CHARS = 2048
MAX_KERNELS = 10_000
MAX_STEPS = 100_000
MAX_STREAMS = 1_024
MAX_MEMORY_ROWS = 1_000
DEVICES = ("cpu", "cuda")
UNIT = "us"
_TOP_KEYS = {
    "v",
    "rank",
    "window",
    "steps",
    "partial",
    "device",
    "unit",
    "kernels",
    "dropped",
    "step_us",
    "breakdown",
    "streams",
    "memory",
}
_MAX_INT = 2**62
_BREAKDOWN_FIELDS = ("compute", "comm", "memcpy", "other", "window")


class SummaryDecodeError(ValueError):
    """A summary payload that is malformed, oversized or of an unknown version."""


@dataclass(frozen=True)
class KernelRow:
    """One op or kernel: self time in microseconds, call count, flops (0 when not measured)."""

    name: str
    self_us: float
    count: int
    flops: int = 0


@dataclass(frozen=True)
class Breakdown:
    """Where the window's time went on this rank, in microseconds.

    CPU ranks: the wall time with a collective in flight on any thread (``comm``), self CPU time
    of copies (``memcpy``) and of every other op (``compute``), and the rest of the window
    (``other``: Python, waiting, idle). CUDA ranks: device time of NCCL kernels, memcpy/memset
    and other kernels; ``other`` is device idle time.
    """

    compute_us: float = 0.0
    comm_us: float = 0.0
    memcpy_us: float = 0.0
    other_us: float = 0.0
    window_us: float = 0.0

    def share(self, what: str) -> float:
        """``what``'s share of the window (``compute``, ``comm``, ``memcpy`` or ``other``)."""
        return getattr(self, f"{what}_us") / self.window_us if self.window_us > 0 else 0.0


BREAKDOWN_KEYS = ("compute", "comm", "memcpy", "other")


@dataclass(frozen=True)
class StreamRow:
    """Device time on one stream: busy (union of its activity) and idle, within the window."""

    device: int
    stream: int
    busy_us: float
    idle_us: float


@dataclass(frozen=True)
class MemoryRow:
    """An op's allocations in the window: bytes allocated (frees not subtracted), how many."""

    name: str
    bytes: int
    count: int


@dataclass
class RankSummary:
    """What one rank recorded in one window."""

    rank: int
    window: int
    steps: tuple[int, int]
    partial: bool
    device: str
    kernels: list[KernelRow]
    dropped_rows: int = 0
    dropped_us: float = 0.0
    step_us: list[tuple[int, float]] = field(default_factory=list)
    breakdown: Breakdown = field(default_factory=Breakdown)
    streams: list[StreamRow] = field(default_factory=list)
    peak_bytes: int | None = None
    """Peak allocated bytes in the window (with ``profile_memory``), else None."""
    memory: list[MemoryRow] = field(default_factory=list)
    unit: str = UNIT

    @property
    def total_us(self) -> float:
        """Self time of every row, the dropped ones included."""
        return sum(k.self_us for k in self.kernels) + self.dropped_us


def encode_summary(summary: RankSummary) -> bytes:
    """Serialise to msgpack; raises ValueError if the result would not decode."""
    payload = {
        "v": SUMMARY_VERSION,
        "rank": summary.rank,
        "window": summary.window,
        "steps": [summary.steps[0], summary.steps[1]],
        "partial": summary.partial,
        "device": summary.device,
        "unit": summary.unit,
        "kernels": [[k.name, float(k.self_us), k.count, k.flops] for k in summary.kernels],
        "dropped": [summary.dropped_rows, float(summary.dropped_us)],
        "step_us": [[s, float(us)] for s, us in summary.step_us],
        "breakdown": [float(getattr(summary.breakdown, f"{k}_us")) for k in _BREAKDOWN_FIELDS],
        "streams": [
            [r.device, r.stream, float(r.busy_us), float(r.idle_us)] for r in summary.streams
        ],
        "memory": None
        if summary.peak_bytes is None
        else [summary.peak_bytes, [[r.name, r.bytes, r.count] for r in summary.memory]],
    }
    try:
        data = bytes(msgpack.packb(payload, use_bin_type=True))
    except (TypeError, OverflowError, ValueError) as exc:
        raise ValueError(f"summary cannot be encoded: {exc}") from exc
    decode_summary(data)  # never send what the receiver would refuse
    return data


def decode_summary(data: Any) -> RankSummary:
    """Parse and check a payload from ``encode_summary``."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SummaryDecodeError(f"summary must be bytes, got {type(data).__name__}")
    if len(data) > MAX_PAYLOAD_BYTES:
        raise SummaryDecodeError(
            f"summary is {len(data)} bytes, over the {MAX_PAYLOAD_BYTES}-byte cap"
        )
    try:
        obj = msgpack.unpackb(
            bytes(data),
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=MAX_NAME_CHARS * 4,
            max_bin_len=0,
            max_array_len=max(MAX_KERNELS, MAX_STEPS),
            max_map_len=64,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises a zoo of types on garbage
        raise SummaryDecodeError(
            f"summary is not valid msgpack: {type(exc).__name__}: {exc}"
        ) from exc
    return _from_obj(obj)


def _from_obj(obj: Any) -> RankSummary:
    if not isinstance(obj, dict):
        raise SummaryDecodeError(f"summary must be a map, got {type(obj).__name__}")
    keys = set(obj)
    if keys != _TOP_KEYS:
        missing, extra = sorted(_TOP_KEYS - keys), sorted(map(str, keys - _TOP_KEYS))
        raise SummaryDecodeError(f"summary keys wrong: missing {missing}, unexpected {extra}")
    if type(obj["v"]) is not int or obj["v"] != SUMMARY_VERSION:
        raise SummaryDecodeError(
            f"summary version {obj['v']!r} is not supported (expected {SUMMARY_VERSION})"
        )
    rank = _int(obj["rank"], "rank")
    window = _int(obj["window"], "window")
    steps = _list(obj["steps"], "steps", 2, 2)
    first, last = _int(steps[0], "steps[0]"), _int(steps[1], "steps[1]")
    if first > last:
        raise SummaryDecodeError(f"summary steps {first}-{last}: first is after last")
    if not isinstance(obj["partial"], bool):
        raise SummaryDecodeError("summary 'partial' must be a bool")
    if obj["device"] not in DEVICES:
        raise SummaryDecodeError(f"summary device {obj['device']!r} not in {list(DEVICES)}")
    if obj["unit"] != UNIT:
        raise SummaryDecodeError(f"summary unit {obj['unit']!r} is not {UNIT!r}")
    kernels = []
    for i, row in enumerate(_list(obj["kernels"], "kernels", 0, MAX_KERNELS)):
        row = _list(row, f"kernels[{i}]", 4, 4)
        kernels.append(
            KernelRow(
                _name(row[0], f"kernels[{i}]"),
                _time(row[1], f"kernels[{i}] self_us"),
                _int(row[2], f"kernels[{i}] count"),
                _int(row[3], f"kernels[{i}] flops"),
            )
        )
    dropped = _list(obj["dropped"], "dropped", 2, 2)
    step_us = []
    for i, pair in enumerate(_list(obj["step_us"], "step_us", 0, MAX_STEPS)):
        pair = _list(pair, f"step_us[{i}]", 2, 2)
        step_us.append((_int(pair[0], f"step_us[{i}] step"), _time(pair[1], f"step_us[{i}] us")))
    brk = _list(obj["breakdown"], "breakdown", 5, 5)
    streams = []
    for i, row in enumerate(_list(obj["streams"], "streams", 0, MAX_STREAMS)):
        row = _list(row, f"streams[{i}]", 4, 4)
        streams.append(
            StreamRow(
                _signed(row[0], f"streams[{i}] device"),
                _signed(row[1], f"streams[{i}] stream"),
                _time(row[2], f"streams[{i}] busy_us"),
                _time(row[3], f"streams[{i}] idle_us"),
            )
        )
    peak, memory = None, []
    if obj["memory"] is not None:
        mem = _list(obj["memory"], "memory", 2, 2)
        peak = _int(mem[0], "memory peak bytes")
        for i, row in enumerate(_list(mem[1], "memory rows", 0, MAX_MEMORY_ROWS)):
            row = _list(row, f"memory[{i}]", 3, 3)
            memory.append(
                MemoryRow(
                    _name(row[0], f"memory[{i}]"),
                    _int(row[1], f"memory[{i}] bytes"),
                    _int(row[2], f"memory[{i}] count"),
                )
            )
    return RankSummary(
        rank=rank,
        window=window,
        steps=(first, last),
        partial=obj["partial"],
        device=obj["device"],
        kernels=kernels,
        dropped_rows=_int(dropped[0], "dropped rows"),
        dropped_us=_time(dropped[1], "dropped us"),
        step_us=step_us,
        breakdown=Breakdown(
            *(_time(v, f"breakdown {k}") for k, v in zip(_BREAKDOWN_FIELDS, brk, strict=True))
        ),
        streams=streams,
        peak_bytes=peak,
        memory=memory,
    )


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS:
        raise SummaryDecodeError(
            f"summary {what} name must be a non-empty string of at most {MAX_NAME_CHARS} characters"
        )
    return value


def _signed(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -_MAX_INT < value < _MAX_INT:
        raise SummaryDecodeError(f"summary {what} must be an int, got {value!r}")
    return value


def _list(value: Any, what: str, min_len: int, max_len: int) -> list[Any]:
    if not isinstance(value, list):
        raise SummaryDecodeError(f"summary {what} must be a list, got {type(value).__name__}")
    if not min_len <= len(value) <= max_len:
        raise SummaryDecodeError(
            f"summary {what} has {len(value)} items; expected {min_len}..{max_len}"
        )
    return value


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_INT:
        raise SummaryDecodeError(f"summary {what} must be a non-negative int, got {value!r}")
    return value


def _time(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SummaryDecodeError(f"summary {what} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise SummaryDecodeError(f"summary {what} must be finite and >= 0, got {value!r}")
    return float(value)
