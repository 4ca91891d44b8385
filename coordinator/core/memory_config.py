"""``memory:`` and ``memory_snapshot:`` in the profiler config. Pure: no torch, no Ray.

>>> Memory.from_value({"sample_s": 0.5, "leak_span_s": 120}).validate().leak_span_s
120
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
    """Seconds between two samples of a rank process (0 turns sampling off)."""
    leak_span_s: float = 600.0
    """A rank is marked as leaking when its memory grew steadily over the last this many
    seconds (a one-off rise is not steady)."""
    leak_min_mib_per_min: float = 4.0
    """...at this rate at least (MiB a minute)."""

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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class MemorySnapshot:
    """CUDA memory snapshots (``ProfilerConfig.memory_snapshot``); CUDA ranks only."""

    on: list[str] = field(default_factory=list)
    """When: ``window`` (beside each trace, ``rank<R>.memory.pickle``), ``oom`` (before an
    out-of-memory error goes on), ``demand`` (``ray-profiler memory --snapshot``)."""
    max_entries: int = 100_000
    """The allocator's history kept for a snapshot (torch's ``max_entries``), at most 10**7."""
    stacks: str = "python"
    """Stacks recorded with each allocation: ``python``, ``all`` (C++ too) or ``none``."""

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
