"""``ray-profiler memory``: every rank's memory as a table, the leaks named first. Pure.

Its texts (culprits, reasons, snapshots' paths and errors, node ids) may come from a record
anyone who can write ``save_path`` made: each is printed through ``printable``."""

from __future__ import annotations

import time
from typing import Any

from coordinator.core.memory_view import how_long
from coordinator.core.printable import printable
from coordinator.protocol.memory_replies import MemoryReply, SnapshotReply

MiB = 1 << 20


def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / MiB:,.0f} MiB"


def render_memory(m: MemoryReply) -> str:
    """The reply of ``memory()`` as lines: the culprits, then one row a rank."""
    if not m["sample_s"]:
        return "memory sampling is off (memory.sample_s: 0 in the config)"
    fast = m.get("leak_fast_span_s")
    steep = (
        f", or over {fast:g} s at {m.get('leak_fast_min_bytes_per_min', 0) / MiB:g} MiB/min"
        if fast
        else ""
    )
    lines = [
        f"memory of {len(m['ranks'])} ranks (run {m['run']}, a sample every "
        f"{m['sample_s']:g} s; a leak: steady growth over {m['leak_span_s']:g} s at "
        f"{m['leak_min_bytes_per_min'] / MiB:g} MiB/min or more{steep})"
    ]
    lines += [f"  leak: {printable(c)}" for c in m["culprits"]]
    marked = [r for r in m["ranks"] if r["growth"] and not r["culprit"]]
    if marked:
        lines.append(f"  {len(marked)} more ranks grow with the others of their role")
    lines.append(
        f"  {'role':<10} {'rank':>5} {'rss':>12} {'peak rss':>12} {'uss':>12} {'gpu':>12}  growth"
    )
    for r in m["ranks"]:
        g = r["growth"]
        growth = (
            f"+{g['bytes_per_min'] / MiB:,.1f} MiB/min since "
            f"{time.strftime('%H:%M:%S', time.localtime(g['since']))}"
            + (f", node memory gone in {how_long(left)}" if (left := g.get("time_left_s")) else "")
            + ("  <- culprit" if r["culprit"] else "")
            if g
            else (r["state"] if r["state"] != "sampled" else "flat")
        )
        if r["reason"] and r["state"] != "sampled":
            growth += f" ({printable(r['reason'][:80])})"
        lines.append(
            f"  {r['role'][:10]:<10} {r['rank']:>5} {_mib(r['rss_bytes']):>12} "
            f"{_mib(r['peak_rss_bytes']):>12} {_mib(r['uss_bytes']):>12} "
            f"{_mib(r['gpu_bytes']):>12}  {growth}"
        )
    for node, why in sorted(m["gpu"].items()):
        lines.append(f"  node {printable(node[:12])}: GPU memory not sampled: {printable(why)}")
    for s in m["snapshots"][-10:]:
        lines.append(
            f"  snapshot ({s['on']}) rank {s['rank']}: "
            + printable(s["path"] or "-")
            + (f"  FAILED: {printable(s['error'])}" if s["error"] else "")
        )
    return "\n".join(lines)


def render_snapshot(asked: SnapshotReply, written: list[Any]) -> str:
    """``memory --snapshot``: each rank asked, and the files written (or why not)."""
    lines = [f"snapshot request {asked['request']}:"]
    done = {(s["trainer_id"], s["rank"]): s for s in written}
    for a in asked["ranks"]:
        s = done.get((a["trainer_id"], a["rank"]))
        if not a["asked"]:
            lines.append(f"  rank {a['rank']}: not asked: {printable(str(a['reason']))}")
        elif s is None:
            lines.append(f"  rank {a['rank']}: asked, no file yet ({printable(a['path'])})")
        else:
            lines.append(
                f"  rank {a['rank']}: "
                + printable(f"FAILED: {s['error']}" if s["error"] else str(s["path"]))
            )
    return "\n".join(lines)
