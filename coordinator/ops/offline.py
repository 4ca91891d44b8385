"""``ray-profiler summarise``: the cross-rank tables of traces read from disk, with no Ray cluster
and no coordinator: a run that has ended, or traces this project did not record (SkyRL's,
torchtitan's, any ``torch.profiler`` chrome trace).

Each trace goes the way a window's traces go online: the node agent's reader and summary
(``worker_ext.agent.trace_summary``), the summary's wire format, a node partial of every rank
(``core.partial.fold_summaries``) and the coordinator's window aggregate
(``core.aggregate.WindowAggregate``). The rank of a trace is the one it names
(``distributedInfo``, else a top-level ``rank``: a trace naming none is rank 0, as HTA reads it);
the window's steps are its ``ProfilerStep`` markers, or ``--steps``; a trace with no marker is
read whole as one window.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from coordinator.core.aggregate import WindowAggregate
from coordinator.core.partial import fold_summaries
from coordinator.protocol.partial_codec import decode_partial, encode_partial
from coordinator.protocol.summary_codec import (
    DEFAULT_TOP_K,
    RankSummary,
    decode_summary,
    encode_summary,
)
from worker_ext.agent.trace_reader import TraceDigest, TraceError, read_trace
from worker_ext.agent.trace_summary import summarise

if TYPE_CHECKING:
    from coordinator.protocol.replies import KernelSummaryReply

TRACE_SUFFIXES = (".json", ".json.gz")
RANK_ROWS = DEFAULT_TOP_K
"""Rows each rank's summary keeps (at least ``top_k``): what the agents keep by default, so the
table equals the one the coordinator would give for the same traces."""


class TraceInputError(ValueError):
    """A path that is not a readable trace, or traces that cannot make one window; the message
    names the file."""


@dataclass
class Offline:
    """What ``summarise_traces`` read: the table, and what the reader should know."""

    table: KernelSummaryReply
    files: dict[int, str]  # rank -> its trace
    notes: list[str] = field(default_factory=list)


def trace_files(paths: list[str]) -> list[str]:
    """The traces ``paths`` name: files as given, and the ``.json``/``.json.gz`` files of each
    directory (not its sub-directories), sorted."""
    out: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(
                os.path.join(path, f)
                for f in os.listdir(path)
                if f.endswith(TRACE_SUFFIXES) and os.path.isfile(os.path.join(path, f))
            )
            if not found:
                raise TraceInputError(f"{path}: no .json or .json.gz trace in this directory")
            out += found
        elif os.path.isfile(path):
            out.append(path)
        else:
            raise TraceInputError(f"{path}: no such file or directory")
    return out


def summarise_traces(
    paths: list[str],
    steps: tuple[int, int] | None = None,
    top_k: int = 20,
    by: str = "kernel",
    threshold: float = 1.25,
) -> Offline:
    """The ``KernelSummaryReply`` (``per_rank=True``) of the traces ``paths`` name, as one
    window; ``TraceInputError`` names the file that is not a trace or repeats a rank."""
    files: dict[int, str] = {}
    notes: list[str] = []
    summaries: list[RankSummary] = []
    for path in trace_files(paths):
        try:
            digest = read_trace(path)
        except TraceError as exc:
            said = str(exc)
            raise TraceInputError(said if path in said else f"{path}: {said}") from None
        rank = digest.rank if digest.rank is not None else 0
        if digest.rank is None:
            notes.append(f"{path} names no rank (no distributedInfo): read as rank 0")
        if rank in files:
            raise TraceInputError(f"{path} and {files[rank]} both claim rank {rank}")
        files[rank] = path
        window = _steps(digest, steps, path, notes)
        device = "cuda" if digest.device else "cpu"
        s, _ = summarise(
            digest,
            rank=rank,
            window=0,
            steps=window,
            partial=False,
            device=device,
            top_k=max(top_k, RANK_ROWS),
        )
        summaries.append(decode_summary(encode_summary(s)))  # the wire, as from an agent
        del digest  # (before the next file is read)
    agg = WindowAggregate(0)
    agg.add_partial(decode_partial(encode_partial(fold_summaries("offline", summaries))))
    table = agg.to_dict(top_k, threshold, per_rank=True, by=by)
    table["run"], table["closed"] = "offline", True
    return Offline(table, dict(sorted(files.items())), notes)


def _steps(
    d: TraceDigest, steps: tuple[int, int] | None, path: str, notes: list[str]
) -> tuple[int, int]:
    """The window's steps in trace ``d``: ``steps``, else its markers', else the whole trace
    (said in ``notes``)."""
    marked = sorted(s for s, _, _ in d.steps)
    if steps is not None:
        if marked and not any(steps[0] <= s <= steps[1] for s in marked):
            raise TraceInputError(
                f"{path}: no ProfilerStep in steps {steps[0]}-{steps[1]} (it has {marked[0]}-"
                f"{marked[-1]})"
            )
        return steps
    if not marked:
        notes.append(f"{path} has no ProfilerStep marker: read whole as one window")
        return (0, 0)
    return (marked[0], marked[-1])


def parse_steps(text: str) -> tuple[int, int]:
    """``A-B`` (or ``A``) as a step range; ValueError says why not."""
    first, _, last = text.partition("-")
    try:
        a, b = int(first), int(last or first)
    except ValueError:
        raise ValueError(f"--steps must be A-B or A (whole steps), got {text!r:.40}") from None
    if a < 0 or b < a:
        raise ValueError(f"--steps {text!r:.40}: the first step must be >= 0 and <= the last")
    return a, b
