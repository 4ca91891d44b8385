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

``summarise --collectives``: the window's collectives matched across the traces' ranks
(``collectives_reply``, docs/collectives.md), from the same summaries' ``collectives`` blocks,
each rank's node the trace's ``host_name`` where it has one.

``summarise --advise``: the window's findings (``advise_reply``, docs/advise.md), judged by the
coordinator's rules on the same table and collectives.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from msgspec.structs import replace

from coordinator.core.aggregate import WindowAggregate
from coordinator.core.collectives import SHOWN, window_collectives
from coordinator.core.findings_inputs import advise_parts
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
    from coordinator.protocol.collective_replies import CollectiveBlock, WindowCollectivesReply
    from coordinator.protocol.finding_replies import FindingsReply
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
    blocks: dict[int, CollectiveBlock | None] = field(default_factory=dict)  # rank -> its
    # summary's collectives (None: its trace has none)
    nodes: dict[int, str] = field(default_factory=dict)  # rank -> its trace's host_name
    steps: list[int] = field(default_factory=list)  # the window's steps, every rank's


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
    window, and each rank's collectives (``collectives_reply``); ``TraceInputError`` names the
    file that is not a trace or repeats a rank."""
    done = Offline(cast("KernelSummaryReply", {}), {})  # (its table set once all are read)
    summaries = [_summarise_one(path, steps, top_k, done) for path in trace_files(paths)]
    agg = WindowAggregate(0)
    agg.add_partial(decode_partial(encode_partial(fold_summaries("offline", summaries))))
    done.table = agg.to_dict(top_k, threshold, per_rank=True, by=by)
    done.table["run"], done.table["closed"] = "offline", True
    done.files = dict(sorted(done.files.items()))
    done.steps = sorted(set(done.steps))
    return done


def _summarise_one(
    path: str, steps: tuple[int, int] | None, top_k: int, done: Offline
) -> RankSummary:
    """One trace's summary, as an agent would send it; its file, notes, collectives, node and
    steps go into ``done``."""
    try:
        digest = read_trace(path)
    except TraceError as exc:
        said = str(exc)
        raise TraceInputError(said if path in said else f"{path}: {said}") from None
    rank = digest.rank if digest.rank is not None else 0
    if digest.rank is None:
        done.notes.append(f"{path} names no rank (no distributedInfo): read as rank 0")
    if rank in done.files:
        raise TraceInputError(f"{path} and {done.files[rank]} both claim rank {rank}")
    done.files[rank] = path
    window = _steps(digest, steps, path, done.notes)
    s, _ = summarise(
        digest,
        rank=rank,
        window=0,
        steps=window,
        partial=False,
        device="cuda" if digest.device else "cpu",
        top_k=max(top_k, RANK_ROWS),
    )
    s = decode_summary(encode_summary(s))  # the wire, as from an agent
    done.blocks[rank] = _in_steps(s.collectives, window) if steps else s.collectives
    done.steps += [step for step, _ in s.step_us]
    if digest.host is not None:
        done.nodes[rank] = digest.host
    return s


def _in_steps(block: CollectiveBlock | None, steps: tuple[int, int]) -> CollectiveBlock | None:
    """``block``'s collectives of steps ``steps`` (``--steps``: those outside every step too
    are left out)."""
    if block is None:
        return None
    calls = tuple(c for c in block.calls if c.step is not None and steps[0] <= c.step <= steps[1])
    return replace(block, calls=calls)


def collectives_reply(done: Offline, shown: int = SHOWN) -> WindowCollectivesReply:
    """The traces' window's collectives matched across their ranks: the ``collectives()``
    RPC's reply for run ``offline``, window 0 (``core.collectives.window_collectives``); each
    rank's node is its trace's ``host_name`` (None for all when a trace has none)."""
    nodes = done.nodes if len(done.nodes) == len(done.blocks) else None
    strag = done.table["stragglers"]
    steps = {int(r): v["step_ms"] for r, v in strag["ranks"].items() if v["step_ms"]}
    median = strag["median_step_ms"] or None
    reply = window_collectives(done.blocks, nodes, shown, median, steps)
    return {
        "run": "offline",
        "window": 0,
        "steps": done.steps or None,
        "trainer_id": None,
        "role": None,
        "ranks_recorded": len(done.blocks),
        "ranks_without": sorted(r for r, b in done.blocks.items() if b is None),
        **reply,
    }


def advise_reply(
    done: Offline, settings: dict[str, dict[str, float]] | None = None
) -> FindingsReply:
    """The traces' window's findings: the ``advise()`` RPC's reply for run ``offline``, window
    0 (``core.findings_inputs.advise_parts`` on the table and ``collectives_reply``)."""
    coll = collectives_reply(done, 0)  # (the window's keys are the collectives reply's)
    found, quiet, missing = advise_parts(done.table, coll, settings, None)
    head = {k: cast("dict[str, Any]", coll)[k] for k in ("run", "window", "steps", "trainer_id")}
    return cast(
        "FindingsReply",
        {
            **head,
            "role": None,
            "findings": found,
            "quiet": quiet,
            "not_judged": missing,
            "problems": [],
        },
    )


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
