"""Fold rank summaries into a node partial, and node partials into a group partial
(``protocol.partial_codec``). Pure: no Ray, no I/O.

A node agent folds the summaries of its node's ranks for one window into one partial; the relay
of a group of nodes merges its group's partials into one; the coordinator merges what it gets
into its window aggregate (``WindowAggregate.add_partial``). Sums are integers, so every way of
grouping the same summaries gives the same table.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from coordinator.protocol.collective_replies import encode_block
from coordinator.protocol.partial_codec import (
    MAX_PARTIAL_TOP,
    NS,
    PARTIAL_VERSION,
    SQ_BASE,
    DetailBlock,
    NodePartial,
    OpKernelRow,
    RankPart,
    TableRow,
    split_square_sum,
)
from coordinator.protocol.summary_codec import MAX_KERNELS, MAX_MEMORY_ROWS, RankSummary

Rows = Iterable[tuple[str, float, int]]
MAX_ROWS = (MAX_KERNELS * 8, MAX_MEMORY_ROWS * 8)


class RowFold:
    """Running statistics of rows over ranks, integer sums: ``[total, sumsq, count, present,
    min, max, max_rank]`` by name."""

    def __init__(self, scale: int) -> None:
        self.scale = scale
        self.rows: dict[str, list[float | int]] = {}

    def add(self, rank: int, rows: Rows) -> None:
        """Fold one rank's ``(name, value, count)`` rows in (a name listed twice is one row)."""
        scale = self.scale
        for name, (v, count) in unique_rows(rows).items():
            q = round(v * scale)
            self._merge(name, q, q * q, count, 1, v, v, rank)

    def merge(self, rows: Iterable[TableRow]) -> None:
        """Fold in another fold's rows (``_merge`` inlined: a relay merges 2,000 rows per node
        partial)."""
        table = self.rows
        for r in rows:
            row = table.get(r.name)
            high, low = r.sumsq
            if row is None:
                sq = high * SQ_BASE + low
                table[r.name] = [r.total, sq, r.count, r.present, r.min, r.max, r.max_rank]
                continue
            row[0] += r.total
            row[1] += high * SQ_BASE + low
            row[2] += r.count
            row[3] += r.present
            if r.min < row[4]:
                row[4] = r.min
            if r.max > row[5] or (r.max == row[5] and r.max_rank < row[6]):
                row[5], row[6] = r.max, r.max_rank

    def _merge(
        self,
        name: str,
        total: int,
        sq: int,
        count: int,
        present: int,
        lo: float,
        hi: float,
        at: int,
    ) -> None:
        row = self.rows.get(name)
        if row is None:
            self.rows[name] = [total, sq, count, present, lo, hi, at]
            return
        row[0] += total
        row[1] += sq
        row[2] += count
        row[3] += present
        row[4] = min(row[4], lo)
        if hi > row[5] or (hi == row[5] and at < row[6]):  # ties: the lowest rank, in any order
            row[5], row[6] = hi, at

    def to_rows(self) -> list[TableRow]:
        return [
            TableRow(
                name,
                int(r[0]),
                split_square_sum(int(r[1])),
                int(r[2]),
                int(r[3]),
                r[4],
                r[5],
                int(r[6]),
            )
            for name, r in self.rows.items()
        ]


def unique_rows(rows: Rows) -> dict[str, tuple[float, int]]:
    """One rank's rows by name; a name listed twice is one row, its values and counts summed."""
    mine: dict[str, tuple[float, int]] = {}
    for name, v, count in rows:
        old = mine.get(name)
        mine[name] = (v, count) if old is None else (old[0] + v, old[1] + count)
    return mine


class OpFold:
    """The op tables of several ranks: device time and CPU self time by op, and each op's
    kernels' device time (integer ns sums, like ``RowFold``'s)."""

    def __init__(self) -> None:
        self.device, self.cpu = RowFold(NS), RowFold(NS)
        self.kernels: dict[tuple[str, str], int] = {}

    def add(self, s: RankSummary) -> None:
        self.device.add(s.rank, ((o.name, o.device_us, o.count) for o in s.ops))
        self.cpu.add(s.rank, ((o.name, o.cpu_us, o.count) for o in s.ops))
        for o in s.ops:
            for kernel, us in o.kernels:
                key = (o.name, kernel)
                self.kernels[key] = self.kernels.get(key, 0) + round(us * NS)

    def merge(self, p: NodePartial) -> None:
        self.device.merge(p.ops)
        self.cpu.merge(p.op_cpu)
        for r in p.op_kernels:
            key = (r.op, r.kernel)
            self.kernels[key] = self.kernels.get(key, 0) + r.total

    def kernel_rows(self) -> list[OpKernelRow]:
        return [OpKernelRow(op, kernel, ns) for (op, kernel), ns in self.kernels.items()]


def fold_summaries(node: str, summaries: Sequence[RankSummary]) -> NodePartial:
    """One node partial of ``summaries`` (one window, distinct ranks); ValueError if they are
    not, or if the fold would be over the partial's bounds (send them one by one then)."""
    if not summaries:
        raise ValueError("a node partial needs at least one summary")
    window = summaries[0].window
    if any(s.window != window for s in summaries):
        raise ValueError("a node partial holds one window")
    kernels, memory, ops = RowFold(NS), RowFold(1), OpFold()
    for s in summaries:
        kernels.add(s.rank, ((k.name, k.self_us, k.count) for k in s.kernels))
        if s.peak_bytes is not None:
            memory.add(s.rank, ((m.name, float(m.bytes), m.count) for m in s.memory))
        ops.add(s)
    _check_bounds(kernels, memory, ops)
    top = heapq.nsmallest(MAX_PARTIAL_TOP, kernels.rows, key=lambda n: (-kernels.rows[n][0], n))
    values = [v for s in summaries for v in _values(s, top)]
    return NodePartial(
        v=PARTIAL_VERSION,
        source=node[:128],
        window=window,
        ranks=[rank_part(s) for s in summaries],
        kernels=kernels.to_rows(),
        memory=memory.to_rows(),
        detail=[DetailBlock(top, [s.rank for s in summaries], values)],
        ops=ops.device.to_rows(),
        op_cpu=ops.cpu.to_rows(),
        op_kernels=ops.kernel_rows(),
    )


def merge_partials(source: str, partials: Sequence[NodePartial]) -> NodePartial:
    """One partial of ``partials`` (one window, no rank in two of them); ValueError if not, or
    if the merge would be over the partial's bounds (push them one by one then)."""
    if not partials:
        raise ValueError("a merge needs at least one partial")
    window = partials[0].window
    if any(p.window != window for p in partials):
        raise ValueError("a merged partial holds one window")
    ranks = [part for p in partials for part in p.ranks]
    if len({part.rank for part in ranks}) != len(ranks):
        raise ValueError("the partials share a rank")
    kernels, memory, ops = RowFold(NS), RowFold(1), OpFold()
    for p in partials:
        kernels.merge(p.kernels)
        memory.merge(p.memory)
        ops.merge(p)
    _check_bounds(kernels, memory, ops)
    return NodePartial(
        v=PARTIAL_VERSION,
        source=source[:128],
        window=window,
        ranks=ranks,
        kernels=kernels.to_rows(),
        memory=memory.to_rows(),
        detail=[block for p in partials for block in p.detail],
        ops=ops.device.to_rows(),
        op_cpu=ops.cpu.to_rows(),
        op_kernels=ops.kernel_rows(),
    )


def rank_part(s: RankSummary) -> RankPart:
    """What the cross-rank views need of ``s``: totals, breakdown, step times, streams."""
    b = s.breakdown
    return RankPart(
        rank=s.rank,
        steps=s.steps,
        partial=s.partial,
        device=s.device,  # type: ignore[arg-type]
        total_us=s.total_us,
        dropped=(s.dropped_rows, s.dropped_us),
        step_us=tuple(s.step_us),
        breakdown=(b.compute_us, b.comm_us, b.memcpy_us, b.other_us, b.window_us, b.overlap_us),
        streams=tuple(s.streams),
        peak_bytes=s.peak_bytes,
        unattributed_us=s.unattributed_us,
        step_device=tuple(s.step_device),
        launch=s.launch,
        launch_bound=tuple(s.launch_bound),
        memory_flow=s.memory_flow if s.peak_bytes is not None else None,
        collectives=encode_block(s.collectives) if s.collectives is not None else None,
        host=s.host,
        gpu=s.gpu,
    )


def _values(s: RankSummary, top: list[str]) -> list[float]:
    mine = unique_rows((k.name, k.self_us, k.count) for k in s.kernels)
    return [mine[name][0] if name in mine else 0.0 for name in top]


def _check_bounds(kernels: RowFold, memory: RowFold, ops: OpFold) -> None:
    if len(kernels.rows) > MAX_ROWS[0] or len(memory.rows) > MAX_ROWS[1]:
        raise ValueError("the ranks list too many distinct kernels for one partial")
    if len(ops.device.rows) > MAX_ROWS[0] or len(ops.kernels) > MAX_ROWS[0] * 5:
        raise ValueError("the ranks list too many distinct ops for one partial")
