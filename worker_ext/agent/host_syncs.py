"""The host's waits for its device inside a window, from the nested CPU events of a CUDA rank's
trace (issue 57: the findings' ``host_sync``; ``core.findings_device``). Pure numpy.

A wait is a call that blocks the host until the device is done (nsys's ``cuda_api_sync`` and
``cuda_memcpy_sync``; the driver's twins) or the op under ``.item()`` and friends (it copies a
scalar back and waits for it), the outermost only, none inside a collective (its wait is the
collective's: ``collective_wait`` and ``exposed_comm`` count it). The copies a counted wait
launched (``.item()``'s own copy back) are its: ``device_summary.gpu_kernel_ns`` leaves them
out of the pageable copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from worker_ext.agent.trace_reader import ANNOTATION, OP, RUNTIME, STEP_NAME

SYNC_CALLS = frozenset(
    {
        *("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize"),
        *("cudaMemcpy", "cudaMemcpy2D", "cudaMemcpyFromSymbol", "cudaMemcpyToSymbol"),
        *("cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize"),
    }
)
SCALAR_OP = "aten::_local_scalar_dense"


@dataclass(frozen=True)
class CpuEvents:
    """A window's CPU events as ``trace_summary._nest`` sorts and nests them: each one's name
    (an id into ``names``), kind, start and end (ns), and parent (an index into the same
    arrays, -1 at the top)."""

    names: list[str]
    name: np.ndarray
    kind: np.ndarray
    start: np.ndarray
    end: np.ndarray
    parent: np.ndarray

    def inside(self, idx: np.ndarray, span: tuple[int, int]) -> np.ndarray:
        """The time of each event of ``idx`` inside ``span`` (0: wholly outside)."""
        ns = np.minimum(self.end[idx], span[1]) - np.maximum(self.start[idx], span[0])
        out: np.ndarray = np.maximum(ns, 0)
        return out


@dataclass
class HostSyncs:
    """The host's waits for the device inside a window (times in ns): the outermost sync calls
    and ``SCALAR_OP`` spans, clipped to the window, and by what caused each (the innermost op
    around it but ``SCALAR_OP``, else its innermost annotation but a step's, such as
    ``DistributedDataParallel.forward``; -1: none): ``[ns, syncs]``; ``counted``: the events
    counted (indices)."""

    wait_ns: int = 0
    syncs: int = 0
    causes: dict[int, list[int]] = field(default_factory=dict)
    counted: list[int] = field(default_factory=list)


def host_syncs(ev: CpuEvents, span: tuple[int, int], skip: np.ndarray | None = None) -> HostSyncs:
    """``HostSyncs`` of ``ev`` inside ``span``, none of the events ``skip`` marks (those inside
    a collective); a trace without such names costs one scan of its names."""
    is_call = np.array([n in SYNC_CALLS for n in ev.names] or [False])
    scalar = np.array([n == SCALAR_OP for n in ev.names] or [False])
    out = HostSyncs()
    if not len(ev.name) or not (is_call.any() or scalar.any()):
        return out
    name, kind, parent = ev.name, ev.kind, ev.parent
    flag = ((kind == RUNTIME) & is_call[name]) | ((kind == OP) & scalar[name])
    if skip is not None:
        flag &= ~skip
    clipped = ev.inside(np.arange(len(name)), span)
    for i in np.flatnonzero(flag & (clipped > 0)).tolist():
        p, op, note, nested = int(parent[i]), -1, -1, False
        while p >= 0 and not nested:
            nested, k, n = bool(flag[p]), int(kind[p]), int(name[p])
            if op < 0 and k == OP and not scalar[n]:
                op = n
            elif note < 0 and k == ANNOTATION and not STEP_NAME.match(ev.names[n]):
                note = n
            p = int(parent[p])
        if not nested:
            out.wait_ns += int(clipped[i])
            out.syncs += 1
            out.counted.append(i)
            row = out.causes.setdefault(op if op >= 0 else note, [0, 0])
            row[0] += int(clipped[i])
            row[1] += 1
    return out
