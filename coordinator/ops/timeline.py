"""A window's ranks merged into one Chrome trace, for Perfetto: every rank a process, on one
clock (``coordinator/core/timeline.py`` says how, and what is left out).

``merge_window`` asks each node's agent to merge the ranks whose traces it holds into one piece
(``NodeAgent.merge_traces``: on the node, on its lowest-priority lane, all nodes at once), merges
the traces already uploaded to ``save_path``'s bucket itself, then pulls the pieces a chunk at a
time and joins them where it was asked (the CLI, the web view's server). Every merge reads one
rank's trace at a time, so memory is one trace (or one piece), whatever the window's size. The
coordinator never reads a trace. A run's record (``RecordedCoordinator``) is merged here from
the files in ``save_path``, with no cluster, into the same file the live merge makes (its ranks
named by the nodes the record kept).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable
from typing import IO, Any, TypedDict

from coordinator.core.storage import filesystem, is_remote
from coordinator.core.timeline import DEFAULT_MAX_EVENTS, step_spread
from coordinator.ops.collect import (
    TraceMissing,
    WindowSource,
    collect_window,
    located_traces,
    node_agent,
    open_inside,
    stored_trace,
    trace_source,
    wanted_ranks,
    window_entry,
)
from coordinator.protocol.timeline import PieceRank, RankCount, RankLabel, TimelinePiece
from coordinator.raylink.node_names import node_names
from worker_ext.agent.timeline_file import Opener, join_pieces, write_piece

TOTAL_EVENTS = 6_400_000
"""Without ``max_events``, a rank keeps at most this many over the window's ranks (and at most
``DEFAULT_MAX_EVENTS``): 64 ranks of 100,000 events, about 110 MB gzipped."""
MIN_PER_RANK = 1_000
PIECE_TIMEOUT_S = 600.0
CHUNK_BYTES = 4 << 20


class TooManyRanks(ValueError):
    """More ranks than the caller's ``max_ranks``; the message says both."""


class TimelineResult(TypedDict):
    """What ``merge_window`` (or ``write_timeline``) wrote."""

    run: str | None
    window: int | None
    out: str
    bytes: int
    events: int  # in the merged file, names of processes and tracks included
    ranks: list[RankCount]  # each rank's process: what was kept and left out
    missing: dict[str, str]  # "role rank" -> why its trace is not in the file
    step_start_spread_us: dict[int, float]  # each step's start spread over the ranks


def merge_window(
    coordinator: Any,
    window: int,
    out: str,
    *,
    run: str | None = None,
    roles: list[str] | None = None,
    ranks: list[int] | None = None,
    min_us: float = 0.0,
    max_events: int | None = None,
    wait_s: float = 60.0,
    storage_options: dict[str, Any] | None = None,
    keep: str | None = None,
    max_ranks: int | None = None,
) -> TimelineResult:
    """Merge every rank's trace of ``window`` (of ``roles``: every role by default; of
    ``ranks``: all by default) into one Chrome trace at ``out`` (``.gz``: gzipped; a local path
    or an fsspec URL).

    Args:
        min_us: leave out events shorter than this (steps always stay).
        max_events: keep at most this many events per rank, the longest; by default
            ``TOTAL_EVENTS`` over the ranks, at most ``DEFAULT_MAX_EVENTS``.
        keep: also collect the per-rank traces here (as ``collect_window``; per role).
        max_ranks: refuse (``TooManyRanks``) a merge of more ranks than this.

    Returns:
        A ``TimelineResult``: ``out``, ``bytes``, ``events``, each rank's process (``ranks``:
        what was kept and left out, its clock's offset taken off its times: ``_set_clocks``),
        ``missing`` ("role rank" -> why), each step's start spread (``step_start_spread_us``).

    Raises:
        ValueError: as ``collect_window`` (an unknown run or window, a run without traces, a
            role or rank the window does not have), or no trace to merge at all.

    Example::

        res = merge_window(connect(address="auto"), 3, "window3.json.gz", min_us=5)
        # then open window3.json.gz in Perfetto: one process per rank
    """
    src = window_entry(coordinator, window, run, wait_s)
    run_name, parts = src.run, _parts(src.entry, roles, ranks, max_ranks)
    options = dict(storage_options) if storage_options is not None else src.options
    if keep is not None:
        _keep(coordinator, window, run_name, parts, keep, ranks, wait_s, storage_options)
    plan, missing = _plan(parts, ranks, wait_s, src, options)
    _some(plan, window, run_name, missing)
    _set_clocks(coordinator, window, run_name, plan)
    per_rank, who = _per_rank(max_events, len(plan)), {r["pid"]: r["label"] for _, r in plan}
    with tempfile.TemporaryDirectory(prefix="ray-profiler-merge-") as work:
        pieces, failed = _pieces(plan, work, min_us, per_rank, options, _opener(src, options))
        missing.update({_name(who[pid]): why for pid, why in failed.items()})
        _some(pieces, window, run_name, missing)
        pieces.sort(key=lambda p: min(c["pid"] for c in p["ranks"]))
        size, events, spread = join_pieces(
            pieces, out, min_us=min_us, max_events=per_rank, storage_options=storage_options
        )
    counts = sorted((c for p in pieces for c in p["ranks"]), key=lambda c: c["pid"])
    return TimelineResult(run=run_name, window=window, out=out, bytes=size, events=events,
                          ranks=counts, missing=missing, step_start_spread_us=spread)  # fmt: skip


def write_timeline(
    sources: Iterable[tuple[RankLabel, str]],
    out: str,
    *,
    min_us: float = 0.0,
    max_events: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> TimelineResult:
    """Merge per-rank Chrome traces (each a local path or URL, ``.gz`` or not) into ``out``,
    reading one at a time; each rank's process numbered in the order given, from 1.

    Args:
        sources: (who, path) per rank, in the order their processes are numbered.
        min_us, max_events: as ``merge_window``.

    Returns:
        A ``TimelineResult`` (``run``, ``window`` None and ``missing`` empty: the caller's).

    Raises:
        ValueError: no source, a file that is not a Chrome trace, a negative ``min_us`` or a
            ``max_events`` under 1.

    Example::

        write_timeline([({"rank": 0, "role": "policy", "node": "n1"}, "w3/rank0.pt.trace.json"),
                        ({"rank": 1, "role": "policy", "node": "n2"}, "w3/rank1.pt.trace.json")],
                       "w3.json.gz")
    """
    sources = list(sources)
    if not sources:
        raise ValueError("no trace to merge")
    per_rank = _per_rank(max_events, len(sources))
    ranks = [PieceRank(label=label, pid=i, path=path) for i, (label, path) in
             enumerate(sources, start=1)]  # fmt: skip
    piece = write_piece(
        ranks, out, min_us=min_us, max_events=per_rank, storage_options=storage_options
    )
    return TimelineResult(run=None, window=None, out=out, bytes=piece["bytes"],
                          events=piece["events"], ranks=piece["ranks"], missing={},
                          step_start_spread_us=step_spread(piece["starts"]))  # fmt: skip


def _parts(
    entry: dict[str, Any], roles: list[str] | None, ranks: list[int] | None, most: int | None
) -> list[dict[str, Any]]:
    """The window's parts (roles) to merge; ValueError for a role or rank it does not have,
    ``TooManyRanks`` for more than ``most`` ranks."""
    window = entry["index"]
    parts = list(entry.get("roles", {}).values()) or [dict(entry, role="")]
    have = [p["role"] for p in parts]
    if roles:
        unknown = sorted(set(roles) - set(have))
        if unknown:
            raise ValueError(f"window {window} has no role {unknown[0]!r}: its roles are {have}")
        parts = [p for p in parts if p["role"] in roles]
    if ranks is not None:
        for p in parts:
            wanted_ranks(p, ranks, window)
    count = sum(len(ranks if ranks is not None else p["ranks"]) for p in parts)
    if most is not None and count > most:
        raise TooManyRanks(
            f"window {window} has {count} ranks to merge; at most {most} here: "
            f"ask for some (ranks=), or run ray-profiler collect --merge"
        )
    return parts


def _plan(
    parts: list[dict[str, Any]],
    ranks: list[int] | None,
    wait_s: float,
    src: WindowSource,
    options: dict[str, Any],
) -> tuple[list[tuple[str, PieceRank]], dict[str, str]]:
    """Where each rank's trace is: ("" to read it here: an upload, or a record's file, else
    the node that holds it, PieceRank), processes numbered in role then rank order; and
    "role rank" -> why for those without one."""
    nodes = src.nodes if src.recorded else node_names()
    plan: list[tuple[str, PieceRank]] = []
    missing: dict[str, str] = {}
    for part in parts:
        role, lost = part["role"], dict[int, str]()
        traces = located_traces(part, set(part["ranks"] if ranks is None else ranks), wait_s, lost)
        missing.update({_name(RankLabel(rank=r, role=role, node="")): w for r, w in lost.items()})
        for rank, t in sorted(traces.items()):
            node = t["node"] or ""
            label = RankLabel(rank=rank, role=role, node=nodes.get(node, node[:8] or "?"))
            path, uploaded = trace_source(t)
            if src.recorded:
                try:
                    path, uploaded = stored_trace(t, options, src), True
                except TraceMissing as exc:
                    missing[_name(label)] = str(exc)
                    continue
            if not path:
                missing[_name(label)] = "no trace: " + str((t["error"] or {}).get("message", ""))
                continue
            plan.append(("" if uploaded else node, PieceRank(label=label, pid=0, path=path)))
    for pid, (_, r) in enumerate(plan, start=1):
        r["pid"] = pid
    return plan, missing


def clock_shifts(reply: dict[str, Any]) -> dict[int, float]:
    """The offsets a ``collectives()`` reply set ranks' times by (rank -> microseconds)."""
    return {
        r["rank"]: float(r["clock_offset_us"])
        for r in reply.get("ranks", [])
        if r.get("clock_corrected")
    }


def _set_clocks(coordinator: Any, window: int, run: str, plan: list[tuple[str, PieceRank]]) -> None:
    """Each planned rank's clock offset, as its role's ``collectives()`` of the window set it
    (ranks of other nodes, or clocks far off): taken off its times in the merge. A
    coordinator that cannot say (an older one, a failed call) leaves the clocks as they are."""
    from coordinator.ops.recorded import RecordedCoordinator, call

    for role in sorted({r["label"]["role"] for _, r in plan}):
        args = {"window": window, "run": run, "role": role or None, "shown": 0}
        if isinstance(coordinator, RecordedCoordinator):
            try:
                reply = call(coordinator, "collectives", **args)
            except ValueError:  # (a record whose trainers are not kept: no role to ask for)
                reply = {}
        else:
            import ray

            rpc = getattr(coordinator, "collectives", None)  # (None: an older coordinator)
            try:
                reply = ray.get(rpc.remote(**args), timeout=60) if rpc is not None else {}
            except (ray.exceptions.RayError, ValueError):
                reply = {}
        shifts = clock_shifts(reply)
        for _, r in plan:
            if r["label"]["role"] == role and r["label"]["rank"] in shifts:
                r["clock_offset_us"] = shifts[r["label"]["rank"]]


def _pieces(
    plan: list[tuple[str, PieceRank]],
    work: str,
    min_us: float,
    per_rank: int,
    options: dict[str, Any],
    opener: Opener | None = None,
) -> tuple[list[TimelinePiece], dict[int, str]]:
    """Each node's piece from its agent (all at once), and the uploaded traces' piece made
    here (each trace opened by ``opener``, when given); pulled into ``work``. The pieces,
    and pid -> why for the ranks none of them has."""
    import ray

    by_node: dict[str, list[PieceRank]] = {}
    for node, r in plan:
        by_node.setdefault(node, []).append(r)
    failed: dict[int, str] = {}
    asked = {}
    for node, ranks in by_node.items():
        if node:
            agent, gone = node_agent(ray, node)
            if agent is None:
                failed.update({r["pid"]: gone for r in ranks})
            else:
                asked[node] = (agent, agent.merge_traces.remote(ranks, min_us, per_rank))
    pieces = []
    if "" in by_node:  # uploaded: read from the bucket here
        local = os.path.join(work, "uploaded.json.gz")
        pieces.append(write_piece(by_node[""], local, min_us=min_us, max_events=per_rank,
                                  storage_options=options, strict=False,
                                  opener=opener))  # fmt: skip
    for node, (agent, ref) in asked.items():
        try:
            piece = ray.get(ref, timeout=PIECE_TIMEOUT_S)
            piece["path"] = _pull(ray, agent, piece["piece"], os.path.join(work, f"{node}.json.gz"))
        except Exception as exc:
            why = f"node {node[:12]} could not merge its ranks: {type(exc).__name__}: {exc}"
            failed.update({r["pid"]: why[:300] for r in by_node[node]})
            continue
        pieces.append(piece)
    for p in pieces:
        failed.update(p["failed"])
    return [p for p in pieces if p["ranks"]], failed


def _opener(src: WindowSource, options: dict[str, Any]) -> Opener | None:
    """How a record's traces are opened for the merge (None for a live run's: fsspec): a
    local one as ``collect`` copies it (``open_inside``: checked after the open, so a link
    swapped in after ``stored_trace`` looked is never followed out of the run's directory),
    a URL through fsspec."""
    if not src.recorded:
        return None
    run_dir = src.run_dir

    def open_trace(path: str) -> IO[bytes]:
        if is_remote(path):
            fs, p = filesystem(path, options)
            return fs.open(p, "rb")  # type: ignore[no-any-return]
        try:
            return open_inside(path, run_dir)
        except TraceMissing as exc:
            raise ValueError(str(exc)) from None

    return open_trace


def _pull(ray: Any, agent: Any, name: str, dest: str) -> str:
    """Copy an agent's piece to ``dest`` a chunk at a time, then let the agent drop it."""
    try:
        with open(dest, "wb") as f:
            offset = 0
            while chunk := ray.get(agent.read_piece_chunk.remote(name, offset, CHUNK_BYTES),
                                   timeout=PIECE_TIMEOUT_S):  # fmt: skip
                f.write(chunk)
                offset += len(chunk)
    finally:
        with contextlib.suppress(Exception):
            agent.drop_piece.remote(name)
    return dest


def _keep(
    coordinator: Any,
    window: int,
    run: str,
    parts: list[dict[str, Any]],
    keep: str,
    ranks: list[int] | None,
    wait_s: float,
    options: dict[str, Any] | None,
) -> None:
    """``--to`` with ``--merge``: the per-rank traces collected too."""
    for part in parts:
        dest = os.path.join(keep, part["role"]) if len(parts) > 1 else keep
        collect_window(coordinator, window, dest, run=run, role=part["role"] or None,
                       ranks=ranks, wait_s=wait_s, storage_options=options)  # fmt: skip


def _some(found: list[Any], window: int, run: str, missing: dict[str, str]) -> None:
    """ValueError, saying why, when nothing was ``found`` to merge."""
    if not found:
        why = "; ".join(f"{r}: {w}" for r, w in sorted(missing.items()))
        raise ValueError(f"window {window} of run {run}: no trace to merge ({why})")


def _name(label: RankLabel) -> str:
    return f"{label['role']} {label['rank']}".strip()


def _per_rank(max_events: int | None, ranks: int) -> int:
    """Events kept per rank: as asked, else ``TOTAL_EVENTS`` shared over the ranks."""
    if max_events is not None:
        return max_events
    return min(DEFAULT_MAX_EVENTS, max(MIN_PER_RANK, TOTAL_EVENTS // max(ranks, 1)))
