"""A window's record pickled in pieces, for the checkpoint.

At 10,000 ranks a window holds sets and dicts of 10,000 entries (its participants, the ranks it
still waits for, each rank's totals, breakdown and step time): 10 ms to pickle at once in
process, 40-80 ms of the coordinator's event loop in the 10,000-rank simulation, every time a
window command or a summary saved the run. So the record is copied in the turn of the save
(``snapshot``: C-speed copies of its containers, consistent with the run's state saved in that
turn) and pickled from the copy in steps (``pickle_steps``): each container of more than
``PIECE`` entries in pieces of ``PIECE``, one per step, the event loop let go between two.

``restore`` puts a stored record back together; a record stored whole (before) comes back as
it was.
"""

from __future__ import annotations

import copy
import itertools
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from coordinator.core.aggregate import WindowAggregate
from coordinator.core.records import WindowRecord
from coordinator.core.steps import Steps

PIECE = 1024
"""Entries of one set or dict pickled in one step (about 0.25 ms in process)."""


@dataclass
class _Pieces:
    """A set or dict pickled ``PIECE`` entries at a time: each blob a set or dict of them."""

    is_dict: bool
    blobs: list[bytes]

    def restore(self) -> Any:
        out: Any = {} if self.is_dict else set()
        for blob in self.blobs:
            out.update(pickle.loads(blob))
        return out


@dataclass
class _Parted:
    """An object's pickled state whose large containers are ``_Pieces``."""

    state: dict[str, Any]

    def restored_state(self) -> dict[str, Any]:
        return {k: v.restore() if isinstance(v, _Pieces) else v for k, v in self.state.items()}


def snapshot(rec: WindowRecord) -> WindowRecord:
    """A copy of ``rec`` that later changes to it do not reach, for ``pickle_steps`` and for
    ``status()``'s parts of a large window: its sets and dicts copied, its aggregates snapshot
    (the values they hold are replaced, never changed in place)."""
    snap = copy.copy(rec)
    for name, value in vars(snap).items():
        if isinstance(value, (set, dict)):
            setattr(snap, name, value.copy())
    snap.aggregates = {tid: agg.snapshot() for tid, agg in rec.aggregates.items()}
    return snap


def pickle_steps(snap: WindowRecord, dumps: Callable[[Any], bytes]) -> Steps[_Parted]:
    """``snap`` (a ``snapshot``) made ready to pickle in steps: what it returns pickles
    quickly (its large containers are already bytes) and ``restore`` makes it a record."""
    aggregates = {}
    for tid, agg in snap.aggregates.items():
        aggregates[tid] = yield from _parted(agg.__getstate__(), dumps)
    state = snap.__getstate__()
    state["aggregates"] = {}
    parted = yield from _parted(state, dumps)
    parted.state["aggregates"] = aggregates
    return parted


def _parted(state: dict[str, Any], dumps: Callable[[Any], bytes]) -> Steps[_Parted]:
    state = dict(state)
    for name, value in state.items():
        if isinstance(value, (set, dict)) and len(value) > PIECE:
            # (a snapshot's: nothing changes it between two steps. Each piece a dict or set,
            # not a list of items: no tuple made per entry for the collector to walk.)
            is_dict, blobs = isinstance(value, dict), []
            entries = iter(value.items()) if isinstance(value, dict) else iter(value)
            for _ in range(0, len(value), PIECE):
                piece = itertools.islice(entries, PIECE)
                blobs.append(dumps(dict(piece) if is_dict else set(piece)))
                yield
            state[name] = _Pieces(is_dict, blobs)
    return _Parted(state)


def restore(stored: Any) -> WindowRecord:
    """A record from what ``pickle_steps`` made (or a record stored whole, as it is)."""
    if not isinstance(stored, _Parted):
        return stored  # type: ignore[no-any-return]
    state = stored.restored_state()
    aggregates = {}
    for tid, parted in state["aggregates"].items():
        agg = WindowAggregate.__new__(WindowAggregate)
        agg.__setstate__(parted.restored_state())
        aggregates[tid] = agg
    rec = WindowRecord.__new__(WindowRecord)
    rec.__dict__.update(state, aggregates=aggregates)
    return rec
