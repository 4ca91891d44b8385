"""``memory:`` and ``memory_snapshot:`` in the profiler config. Pure: no torch, no Ray.

>>> Memory.from_value({"sample_s": 0.5, "leak_span_s": 120}).validate().leak_span_s
120
>>> Memory().leak_fast()  # 90 s at 100 MiB/min, in bytes a second
(90.0, 1747626.6666666667)
>>> Memory.from_value({"leak_span_s": 60}).leak_fast() is None  # the long span is as short
True
>>> MemorySnapshot.from_value({"on": "oom"}).validate().on
['oom']
>>> MemorySnapshot.from_value({"on": ["window"], "max_entries": None}).validate()
Traceback (most recent call last):
...
ValueError: profiler config: 'memory_snapshot.max_entries' must be an int in 1..10000000, ...
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from coordinator.core.validate import section_of

MiB = 1 << 20
SNAPSHOT_ON = ("window", "oom", "demand")
SNAPSHOT_STACKS = ("python", "all", "none")
MAX_SNAPSHOT_ENTRIES = 10_000_000


@dataclass
class Memory:
    """Every rank's memory over the run, sampled by its node agent (``ProfilerConfig.memory``)."""

    sample_s: float = 1.0
    """Seconds between two samples of a rank process (resident and unique memory, GPU memory
    where NVML answers); 0 turns sampling off."""
    leak_span_s: float = 600.0
    """A rank is marked as leaking when its resident memory grew steadily (in each quarter of
    the span, at the slope's pace) over the last this many seconds, over 8 samples at least (a
    one-off rise is not steady)."""
    leak_min_mib_per_min: float = 4.0
    """...at this rate at least (MiB a minute)."""
    leak_fast_span_s: float = 90.0
    """A steep leak is marked sooner: steady growth over the last this many seconds, at
    ``leak_fast_min_mib_per_min`` at least (0: off); used when shorter than ``leak_span_s``
    and covering 8 samples. 90: a leak passes the span's four quarters about 70 s after it
    starts (a mark is made at every pull, 5 s), so a steep one is named within 2 minutes;
    a rise over less than about 20 s is one step to it, never marked (with 60, one over 30 s
    was marked while it lasted; a rise that goes on for about half the span, 45 s, is)."""
    leak_fast_min_mib_per_min: float = 100.0
    """...at this rate at least (MiB a minute; the larger of this and ``leak_min_mib_per_min``
    applies). 100: about 1 GiB more while the long span (600 s) would wait to name it; a
    slower rise (a cache or buffer filled over a few minutes) is left to the long span, which
    sees whether it goes on."""

    @classmethod
    def from_value(cls, value: Any) -> Memory:
        """From a mapping (unknown keys rejected by name), or a ``Memory``."""
        return section_of(cls, value, "memory")

    def validate(self) -> Memory:
        """Raise ValueError naming the field and the value; returns self."""
        _number("memory.sample_s", self.sample_s, 0.0, 3600.0)
        if 0 < self.sample_s < 0.05:
            raise ValueError(_bad("memory.sample_s", "0 (off) or at least 0.05", self.sample_s))
        _number("memory.leak_span_s", self.leak_span_s, 1.0, 7 * 86400.0)
        _number("memory.leak_min_mib_per_min", self.leak_min_mib_per_min, 0.001, 1e9)
        _number("memory.leak_fast_span_s", self.leak_fast_span_s, 0.0, 7 * 86400.0)
        _number("memory.leak_fast_min_mib_per_min", self.leak_fast_min_mib_per_min, 0.001, 1e9)
        if self.sample_s and self.leak_span_s < 8 * self.sample_s:
            raise ValueError(
                f"profiler config: 'memory.leak_span_s' ({self.leak_span_s:g}) must cover at "
                f"least 8 samples ({8 * self.sample_s:g} s at sample_s {self.sample_s:g})"
            )
        return self

    @property
    def leak_min_bytes_per_s(self) -> float:
        """``leak_min_mib_per_min`` in bytes a second."""
        return self.leak_min_mib_per_min * MiB / 60.0

    def leak_fast(self) -> tuple[float, float] | None:
        """The short span and its floor in bytes a second, when it is on: shorter than
        ``leak_span_s``, covering 8 samples; None otherwise."""
        span = self.leak_fast_span_s
        if not span or span >= self.leak_span_s or span < 8 * self.sample_s:
            return None
        floor = max(self.leak_fast_min_mib_per_min, self.leak_min_mib_per_min)
        return float(span), floor * MiB / 60.0

    def leak_every_s(self) -> float:
        """The shortest span a leak is looked for in, over 20: how often the marks are made
        (at most once a pull)."""
        fast = self.leak_fast()
        return (fast[0] if fast is not None else self.leak_span_s) / 20

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class MemorySnapshot:
    """CUDA memory snapshots (``ProfilerConfig.memory_snapshot``); CUDA ranks only."""

    on: list[str] = field(default_factory=list)
    """When: ``window`` (beside each trace, ``rank<R>.memory.pickle``), ``oom`` (before an
    out-of-memory error goes on, ``<run dir>/memory/<role>/rank<R>.oom-<time>.memory.pickle``),
    ``demand`` (``ray-profiler memory --snapshot``); one of them or a list."""
    max_entries: int = 100_000
    """The allocator's history kept for a snapshot (torch's ``max_entries``), at most 10**7."""
    stacks: str = "python"
    """Stacks recorded with each allocation: ``python``, ``all`` (C++ too, slower) or ``none``."""

    @classmethod
    def from_value(cls, value: Any) -> MemorySnapshot:
        """From a mapping (unknown keys rejected by name), or a ``MemorySnapshot``."""
        return section_of(cls, value, "memory_snapshot")

    def validate(self) -> MemorySnapshot:
        """Raise ValueError naming the field and the value; returns self."""
        on: Any = self.on
        if isinstance(on, str):
            on = [on]
        if not isinstance(on, (list, tuple)) or any(w not in SNAPSHOT_ON for w in on):
            raise ValueError(
                _bad("memory_snapshot.on", f"a list drawn from {list(SNAPSHOT_ON)}", on)
            )
        self.on = list(dict.fromkeys(on))
        n = self.max_entries
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SNAPSHOT_ENTRIES:
            raise ValueError(
                _bad("memory_snapshot.max_entries", f"an int in 1..{MAX_SNAPSHOT_ENTRIES}", n)
            )
        if self.stacks not in SNAPSHOT_STACKS:
            raise ValueError(
                _bad("memory_snapshot.stacks", f"one of {SNAPSHOT_STACKS}", self.stacks)
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return {"on": list(self.on), "max_entries": self.max_entries, "stacks": self.stacks}


def _number(name: str, value: Any, low: float, high: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        raise ValueError(_bad(name, f"a number in {low:g}..{high:g}", value))


def _bad(name: str, what: str, value: Any) -> str:
    return f"profiler config: {name!r} must be {what}, got {type(value).__name__}: {value!r:.80}"
