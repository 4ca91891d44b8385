"""What a window's CUDA ranks add to its cross-rank tables: the op table (device time by the CPU
op that launched it), launches, unattributed device time and each step's device time. Pure.

Sums are integer nanoseconds, as in the kernel table, so the tables do not depend on how the
ranks' summaries were grouped into node partials.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from coordinator.core.row_table import RowTable
from coordinator.core.saved import DeviceFile
from coordinator.protocol.partial_codec import NS, NodePartial, RankPart
from coordinator.protocol.summary_codec import GpuRow, LaunchRow, OpRow

if TYPE_CHECKING:
    from coordinator.protocol.replies import GpuEntry, KernelSummaryReply, LaunchEntry, OpDetail

OP_DETAIL_KERNELS = 3
"""An op's largest kernels listed in its row of the op table."""


class DeviceFigures:
    """The CUDA figures of one window's ranks (see the module docstring)."""

    def __init__(self) -> None:
        self.unattributed: dict[int, float] = {}
        self.step_device: dict[int, tuple[tuple[int, float, float], ...]] = {}
        self.launch: dict[int, LaunchRow] = {}
        self.launch_bound: dict[int, tuple[int, ...]] = {}
        self.ops = RowTable(NS)  # device time by op (count: calls)
        self.op_cpu = RowTable(NS)  # the same ops' self CPU time
        self.op_kernels: dict[str, dict[str, int]] = {}  # op -> kernel -> device ns
        self.rows: dict[int, GpuRow] = {}  # the findings' syncs, pageable copies, fp32 GEMMs

    def saved(self) -> DeviceFile:
        """The figures as saved."""
        return DeviceFile(
            unattributed=dict(self.unattributed), step_device=dict(self.step_device),
            launch=dict(self.launch), launch_bound=dict(self.launch_bound),
            ops=self.ops.saved(), op_cpu=self.op_cpu.saved(),
            op_kernels={op: dict(k) for op, k in self.op_kernels.items()}, rows=dict(self.rows),
        )  # fmt: skip

    @classmethod
    def from_saved(cls, f: DeviceFile) -> DeviceFigures:
        """The figures ``saved`` made."""
        out = cls()
        out.unattributed, out.step_device = dict(f.unattributed), dict(f.step_device)
        out.launch, out.launch_bound = dict(f.launch), dict(f.launch_bound)
        out.ops, out.op_cpu = RowTable.from_saved(f.ops), RowTable.from_saved(f.op_cpu)
        out.op_kernels = {op: dict(k) for op, k in f.op_kernels.items()}
        out.rows = dict(f.rows)
        return out

    def copy(self) -> DeviceFigures:
        out = DeviceFigures()
        for name in ("unattributed", "step_device", "launch", "launch_bound", "rows"):
            setattr(out, name, dict(getattr(self, name)))
        out.ops, out.op_cpu = self.ops.copy(), self.op_cpu.copy()
        out.op_kernels = copy.deepcopy(self.op_kernels)
        return out

    def add_rank(self, part: RankPart) -> None:
        """A rank's own figures (from its summary or its node partial)."""
        if part.device != "cuda":
            return
        self.unattributed[part.rank] = part.unattributed_us
        if part.step_device:
            self.step_device[part.rank] = part.step_device
        if part.launch is not None:
            self.launch[part.rank] = part.launch
        if part.launch_bound:
            self.launch_bound[part.rank] = part.launch_bound
        if part.gpu is not None:
            self.rows[part.rank] = part.gpu

    def with_rows(self, table: KernelSummaryReply) -> KernelSummaryReply:
        """``table`` with each rank's GPU figures as its ``gpu`` entry (``replies.GpuEntry``),
        where a rank has them (a record from before them, a CPU window: no key)."""
        if self.rows:
            table["gpu"] = {r: gpu_entry(row) for r, row in sorted(self.rows.items())}
        return table

    def add_ops(self, rank: int, ops: list[OpRow]) -> None:
        """A rank's op table, from its summary."""
        if not ops:
            return
        self.ops.add_rank(rank, ((o.name, o.device_us, o.count) for o in ops))
        self.op_cpu.add_rank(rank, ((o.name, o.cpu_us, o.count) for o in ops))
        for o in ops:
            mine = self.op_kernels.setdefault(o.name, {})
            for kernel, us in o.kernels:
                mine[kernel] = mine.get(kernel, 0) + round(us * NS)

    def merge_ops(self, p: NodePartial) -> None:
        """A node partial's op tables."""
        self.ops.merge(p.ops)
        self.op_cpu.merge(p.op_cpu)
        for r in p.op_kernels:
            mine = self.op_kernels.setdefault(r.op, {})
            mine[r.kernel] = mine.get(r.kernel, 0) + r.total

    def step_times(self, part: RankPart) -> tuple[tuple[int, float], ...]:
        """The step times the straggler views judge a rank by: on a CUDA rank each step's
        device span (what the device took for the step's work), else its CPU step."""
        if part.device == "cuda" and part.step_device:
            return tuple((s, span) for s, _, span in part.step_device)
        return part.step_us

    def op_table(
        self, k: int, n: int, grand_us: float
    ) -> tuple[list[dict[str, Any]], dict[str, OpDetail]]:
        """The ``k`` ops with the most device time over the ``n`` ranks, and each one's CPU
        time and largest kernels; ``share`` of ``grand_us``, the ranks' whole device time
        (every device event of the window has exactly one op: the rows' shares of it are
        right whatever number of ops each rank sent)."""
        rows = self.ops.top(k, n, grand_us, "us")
        detail: dict[str, OpDetail] = {}
        for row in rows:
            name = row["name"]
            i = self.op_cpu.ids.get(name)
            kernels = sorted(self.op_kernels.get(name, {}).items(), key=lambda kv: (-kv[1], kv[0]))
            detail[name] = {
                "cpu_us": self.op_cpu.total[i] / NS if i is not None else 0.0,
                "kernels": [[kn, ns / NS] for kn, ns in kernels[:OP_DETAIL_KERNELS]],
            }
        return rows, detail

    def launches(self) -> dict[int, LaunchEntry]:
        return {
            r: {
                "kernels": la.kernels,
                "delay_p50_us": la.delay_p50_us,
                "delay_p95_us": la.delay_p95_us,
                "short_share": la.short_share,
                "launch_bound": list(self.launch_bound.get(r, ())),
            }
            for r, la in sorted(self.launch.items())
        }

    def device_steps(self) -> dict[int, list[list[float]]]:
        return {
            r: [[float(s), busy, span] for s, busy, span in steps]
            for r, steps in sorted(self.step_device.items())
        }


def gpu_entry(row: GpuRow) -> GpuEntry:
    """A ``GpuRow`` as the table's ``gpu`` entry (``GpuEntry``)."""
    return {
        "sync_wait_us": row.wait_us,
        "syncs": row.syncs,
        "sync_causes": [[c.name, c.wait_us, c.syncs] for c in row.causes],
        "pageable_us": row.pageable_us,
        "pageable_copies": row.pageable_copies,
        "fp32_gemm_us": row.fp32_gemm_us,
        "tf32_gemm_us": row.tf32_gemm_us,
        "misaligned_mm_us": row.misaligned_mm_us,
        "misaligned_mm_ops": row.misaligned_mm_ops,
        "misaligned_mm_shapes": list(row.misaligned_mm_shapes),
        "fp32_conv_us": row.fp32_conv_us,
        "tf32_conv_us": row.tf32_conv_us,
        "mm_ops_shaped": row.mm_ops_shaped,
    }
