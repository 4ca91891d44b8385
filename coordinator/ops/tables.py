"""The CLI's tables for people: pure text from ``status()`` and ``kernel_summary()`` replies."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from coordinator.core.validate import span

if TYPE_CHECKING:  # (the reply types are for checking: their module takes 6 ms to load)
    from coordinator.protocol.replies import (
        AutoCaptureEntry,
        AutoTrigger,
        KernelDiffReply,
        KernelSummaryReply,
        PhaseTimesReply,
        RankEntry,
        RanksPage,
        RegressionEntry,
        StacksReply,
        StallEntry,
        StatusReply,
        WindowEntry,
        WindowSteps,
    )


def render_status(st: StatusReply) -> str:
    c = st["counters"]
    cur, nxt = st["current_window"], st["next_window"]
    run = st["run"]
    lines = [
        f"coordinator {st['namespace']}/{st['name']}: run {run['name']} ({run['lifecycle']}), "
        f"phase {st['phase']}, global step {st['global_step']}",
        f"current window: {_window(cur)}; next window: {_window(nxt)}",
        f"trace dir: {st['run_dir']}",
        f"worker RPCs {c.get('worker_rpcs', 0)}, ignored steps {c.get('ignored_steps', 0)}, "
        f"refused steps {c.get('refused_step', 0)}, windows closed {c.get('windows_closed', 0)}",
        render_auto(st["auto_capture"]),
        _nodes_line(st),
        *_stall_lines(st["stalls"]),
        "",
    ]
    if not st["ranks_complete"]:
        counts = ", ".join(f"{n} {state}" for state, n in sorted(st["rank_counts"].items()))
        lines.append(
            f"ranks: {counts}; listed: the {len(st['ranks'])} not ok "
            "(ray-profiler ranks --state STATE, or status --all)"
        )
    lines.extend(_rank_rows(st["ranks"]))
    if st["windows"]:
        lines += ["", render_windows(st["windows"], last=10)]
    if st["previous_runs"]:
        lines += ["", "earlier runs (ray-profiler top --run NAME):"]
        for p in st["previous_runs"]:
            prev = p["run"]
            lines.append(
                f"  {prev['name']}: {prev['lifecycle']} ({prev['ended_reason']}), "
                f"{len(p['windows'])} windows, {prev['run_dir']}"
            )
    return "\n".join(lines)


def render_windows(windows: list[WindowEntry], last: int | None) -> str:
    """The closed windows (the ``last`` ones; None: every one), a line each, with why an auto
    capture was taken and the regression marks beneath."""
    lines = [f"{'window':>6} {'kind':<9} {'steps':<12} {'ranks':<16} stragglers / dir"]
    for w in windows[-last:] if last else windows:
        steps = "-".join(map(str, w["steps"])) if w["steps"] else "(none)"
        flag = " partial" if w["partial"] else ""
        strag = f"stragglers {w['stragglers']} " if w.get("stragglers") else ""
        broken = f"NOT AS PLANNED: {w['reason']} " if not w["kept"] else ""
        ranks = span(w["ranks"]) if w["complete"] else f"{w['rank_count']} ranks"
        lines.append(
            f"{w['index']:>6} {w.get('kind', ''):<9} {steps + flag:<12} "
            f"{ranks:<16} {broken}{strag}{w['trace_dir'] or ''}"
        )
        if (t := w["trigger"]) is not None:
            lines.append(f"{'':>6} {'':<9} why: {trigger_text(t)}")
        lines += [f"{'':>6} {'':<9} {text}" for text in marks_lines(w)]
    return "\n".join(lines)


def render_ranks(page: RanksPage) -> str:
    """A page of ``ranks()``."""
    end = page["offset"] + len(page["ranks"])
    head = f"ranks {page['offset']}-{end} of {page['total']}" if page["ranks"] else "no ranks"
    return "\n".join([head, *_rank_rows(page["ranks"])])


def _rank_rows(ranks: list[RankEntry]) -> list[str]:
    rows = [f"{'trainer':<12} {'rank':>4} {'state':<13} {'windows':>7}  reason / note"]
    for r in ranks:
        reason = r["reason"]["message"] if r.get("reason") else (r.get("note") or "")
        rows.append(
            f"{r['trainer_id']:<12} {r['rank']:>4} {r['state']:<13} "
            f"{r['windows_captured']:>7}  {reason[:70]}"
        )
    return rows


def _nodes_line(st: StatusReply) -> str:
    by = st["nodes"]["by_path"]
    if not by:
        return "nodes: none known yet (window commands go to each rank)"
    direct = [n for n in st["nodes"]["listed"] if n["path"] == "direct"]
    why = ""
    if direct:
        first = direct[0]
        message = first["reason"]["message"] if first["reason"] is not None else ""
        why = f"; direct: {first['node'][:12]} ({message[:60]})"
    return f"nodes: {by.get('agent', 0)} through their agents, {by.get('direct', 0)} direct{why}"


def trigger_text(t: AutoTrigger) -> str:
    """Why an auto capture was taken, in one line."""
    first, last = t["slow_steps"]
    where = f" ({t['region']})" if t.get("region") else ""
    return (
        f"steps {first}-{last} ran {t['ratio']:.2f}x the baseline{where}: "
        f"{t['recent_ms']:.1f} ms against {t['baseline_ms']:.1f} ms"
    )


def render_auto(a: AutoCaptureEntry) -> str:
    """Auto capture's state in one line."""
    state = "on" if a["enabled"] else "off"
    base = f"{a['baseline_ms']:.1f} ms" if a["baseline_ms"] is not None else "not yet"
    return (
        f"auto capture: {state} ({a['source']}), {a['captures']} of at most "
        f"{a['max_per_run']} taken, baseline step {base}"
    )


def _window(w: WindowSteps | None) -> str:
    if not w:
        return "none"
    return (
        f"{w['index']} ({w.get('kind', 'scheduled')}, warm-up {w['warmup_start']}, "
        f"record {w['first']}-{w['last']})"
    )


def render_top(ks: KernelSummaryReply) -> str:
    if ks["window"] is None:
        return "no closed window yet"
    ops = ks.get("ops") if ks.get("by") == "op" and ks["device"] != "cpu" else None
    what = (
        "device time by the op that launched it"
        if ops
        else "device time per kernel"
        if ks["device"] == "cuda"
        else f"self {ks['device']} time"
    )
    opt = ks.get("optimizer_steps")
    head = (
        f"window {ks['window']} steps {ks['steps']}"
        f"{f' (optimizer steps {opt[0]}-{opt[1]})' if opt else ''}"
        f"{' partial' if ks['partial'] else ''}, "
        f"{ks.get('role') or 'policy'} ranks {ks['ranks']}, {what} in {ks['unit']}"
    )
    if ks.get("summaries_pending"):
        head += f" (summaries pending from ranks {ks['summaries_pending']})"
    extra = f" {'cpu self':>11}" if ops else ""
    columns = (
        f"{'total':>11} {'mean':>10} {'min':>10} {'max':>10} {'max@':>5} {'std':>9} "
        f"{'calls':>7} {'share':>6}{extra}  "
    )
    lines = [head, columns + ("op, then its largest kernels" if ops else "name")]
    for k in ks["kernels"]:
        cpu = (
            f" {ops[k['name']]['cpu_us']:>11.1f}"
            if ops and k["name"] in ops
            else extra and " " * 12
        )
        lines.append(
            f"{k['total_us']:>11.1f} {k['mean_us']:>10.1f} {k['min_us']:>10.1f} "
            f"{k['max_us']:>10.1f} {k['max_rank']:>5} {k['std_us']:>9.1f} {k['count']:>7} "
            f"{k['share']:>6.1%}{cpu}  {k['name'][:70]}"
        )
        for kernel, us in (ops or {}).get(k["name"], {"kernels": []})["kernels"]:
            lines.append(f"{'':>{len(columns)}}  {us:>10.1f} us  {kernel[:56]}")
    lines += render_breakdown(ks)
    lines += render_launches(ks)
    mem = ks.get("memory")
    if mem:
        lines += [
            "",
            f"memory: peak {_mb(mem['max_peak_bytes'])} on rank {mem['max_peak_rank']} "
            f"(per rank: {', '.join(f'{r}: {_mb(b)}' for r, b in mem['peak_bytes'].items())})",
            *_peak_flow(mem),
            f"{'allocated':>11} {'max':>10} {'max@':>5} {'allocs':>7}  op",
        ]
        for op in mem["ops"][:10]:
            lines.append(
                f"{_mb(op['total_bytes']):>11} {_mb(op['max_bytes']):>10} {op['max_rank']:>5} "
                f"{op['count']:>7}  {op['name'][:70]}"
            )
    return "\n".join(lines)


def render_breakdown(ks: KernelSummaryReply) -> list[str]:
    """Where each rank's window went: compute, communication, copies, other."""
    ranks = ks["breakdown"]["ranks"]
    if not ranks:
        return []
    cuda = ks["device"] in ("cuda", "mixed")
    over = f" {'overlap':>8}" if cuda else ""
    lines = [
        "",
        f"{'rank':>4} {'window ms':>10} {'compute':>8} {'comm':>8} {'memcpy':>8} "
        f"{'idle' if cuda else 'other':>8}{over}",
    ]
    for r, b in ranks.items():
        ov = f" {b.get('comm_overlap', 0.0):>8.1%}" if cuda else ""
        lines.append(
            f"{r:>4} {b['window_us'] / 1e3:>10.1f} {b['compute_share']:>8.1%} "
            f"{b['comm_share']:>8.1%} {b['memcpy_share']:>8.1%} {b['other_share']:>8.1%}{ov}"
        )
    if cuda:
        lines.append(
            "(CUDA: shares of the device span; compute, comm and memcpy are unions; overlap is "
            "the share of comm time with compute beside it)"
        )
    return lines


def render_launches(ks: KernelSummaryReply) -> list[str]:
    """CUDA ranks' launches: delay, kernels shorter than their launch, launch-bound steps."""
    launch = ks.get("launch") or {}
    if not launch:
        return []
    lines = [
        "",
        f"{'rank':>4} {'launches':>9} {'delay p50':>10} {'p95 us':>9} {'short':>6} "
        f"{'unattributed us':>16}  launch-bound steps",
    ]
    for r, la in launch.items():
        lines.append(
            f"{r:>4} {la['kernels']:>9} {la['delay_p50_us']:>10.1f} {la['delay_p95_us']:>9.1f} "
            f"{la['short_share']:>6.0%} {ks['unattributed_us'].get(r, 0.0):>16.1f}  "
            f"{', '.join(map(str, la['launch_bound'])) or '-'}"
        )
    return lines


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MB"


def _peak_flow(mem: Any) -> list[str]:
    """Where the highest peak fell, and what the window allocated and freed on that rank."""
    r = mem["max_peak_rank"]
    step = (mem.get("peak_step") or {}).get(r)
    alloc, freed = (mem.get("allocated_bytes") or {}).get(r), (mem.get("freed_bytes") or {}).get(r)
    if alloc is None:
        return []
    where = f"in step {step}" if step is not None else "outside the recorded steps"
    freed_mb = _mb(freed or 0)
    return [
        f"rank {r} peaked {where}; the window allocated {_mb(alloc)} and freed {freed_mb} there"
    ]


def memory_straggler_line(ks: Any) -> str | None:
    """Says when the slowest flagged rank is also the one with the highest memory peak."""
    mem, flagged = ks.get("memory"), ks["stragglers"]["flagged"]
    if not mem or not flagged:
        return None
    r = mem["max_peak_rank"]
    if r not in flagged:
        return None
    return (
        f"rank {r}, a straggler, is also the rank with the highest memory peak "
        f"({_mb(mem['max_peak_bytes'])}): its allocations may be what slows it"
    )


def render_stragglers(ks: KernelSummaryReply) -> str:
    if ks["window"] is None:
        return "no closed window yet"
    s = ks["stragglers"]
    lines = [
        f"window {ks['window']} steps {ks['steps']}: threshold {s['threshold']}x the median; "
        f"flagged {s['flagged'] or 'none'}",
        "a slow rank has high compute time; the ranks waiting for it in collectives have high "
        "comm time",
        f"{'rank':>4} {'step ms':>9} {'x median':>9} {'compute ms':>11} {'x median':>9} "
        f"{'comm ms':>9} {'comm %':>7}  flag",
    ]
    for r, v in s["ranks"].items():
        share = "-" if v.get("comm_share") is None else f"{v['comm_share']:.1%}"
        lines.append(
            f"{r:>4} {_num(v['step_ms']):>9} {_num(v['step_ratio'], 2):>9} "
            f"{_num(v['compute_ms']):>11} {_num(v['compute_ratio'], 2):>9} "
            f"{_num(v.get('comm_ms')):>9} {share:>7}  "
            f"{'STRAGGLER' if v['flagged'] else ''}"
            + (
                f" launch-bound (steps {', '.join(map(str, lb))})"
                if (lb := v.get("launch_bound"))
                else ""
            )
        )
    last = s.get("last_arriver")
    if last:
        lines.append(f"collectives: rank {last['rank']} {last['reason']}")
        if last["note"]:
            lines.append(f"  (not a compute straggler: {last['note']})")
    note = memory_straggler_line(ks)
    return "\n".join([*lines, note] if note else lines)


def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _clock(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t is not None else "?"


def _stall_lines(stalls: list[StallEntry]) -> list[str]:
    """The last stall, in a line or two (``status()["stalls"]`` keeps the recent ones)."""
    if not stalls:
        return []
    s = stalls[-1]
    end = (
        f"resumed at step {s['resumed_step']} ({_clock(s['resumed_at'])})"
        if s["resumed_at"] is not None
        else "NOT RESUMED"
    )
    head = (
        f"stalls: {len(stalls)}; last: no step after {s['last_step']} from "
        f"{s['trainer_id']} since {_clock(s['last_step_at'])} (threshold "
        f"{s['threshold_s']:.0f} s), {end}; {s['path'] or s['error'] or ''}"
    )
    return [head] + [f"  {line}" for line in s["lines"][:6]]


def render_stalls(stalls: list[StallEntry]) -> str:
    """A recorded run's stalls (``--from``), each with the grouped stacks taken during it."""
    if not stalls:
        return "no stall recorded"
    out = []
    for s in stalls:
        end = (
            f"resumed at step {s['resumed_step']}"
            if s["resumed_at"] is not None
            else "never resumed"
        )
        out += [
            f"stall {s['index']}: no step after {s['last_step']} from {s['trainer_id']} since "
            f"{_clock(s['last_step_at'])} (threshold {s['threshold_s']:.0f} s), {end}; stacks "
            f"taken {s['takes']}x",
            *([s["culprit"]] if s["culprit"] else []),
            *(f"  {line}" for line in s["lines"]),
            *([f"  error: {s['error']}"] if s["error"] else []),
            "",
        ]
    return "\n".join(out).rstrip()


def render_stacks(st: StacksReply) -> str:
    """The grouped stacks: one line per group (smallest first), the culprit, the unreadable;
    with every thread of each process when the reply carries them (``--rank R``)."""
    readable = len(st["entries"]) - len(st["unreadable"])
    lines = [
        f"stacks of {readable}/{len(st['entries'])} processes at {_clock(st['taken_at'])}, "
        f"read in {st['elapsed_s']:.2f} s ({st['method']}{', native' if st['native'] else ''})"
    ]
    if st["culprit"]:
        lines.append(st["culprit"])
    lines += ["", *st["lines"]]
    for e in st["entries"]:
        if e["threads"] is None:
            continue
        who = "driver" if e["rank"] is None else f"rank {e['rank']}"
        lines += ["", f"{e['trainer_id']} {who} (pid {e['pid']}, {e['method']}):"]
        for t in e["threads"]:
            name = f' "{t["name"]}"' if t["name"] else ""
            lines.append(f"  thread {t['thread']}{name}{' (main)' if t['main'] else ''}:")
            lines += [f"    {f['function']} ({f['file']}:{f['line']})" for f in t["frames"]]
    return "\n".join(lines)


def render_phases(pt: PhaseTimesReply) -> str:
    """Each region's mean, share and max over the listed steps, then the slowest steps."""
    steps = pt["steps"]
    if not steps:
        return f"run {pt['run']}: no phase times yet (hooks.region marks a step's regions)"
    wall = sum(s["wall_ms"] for s in steps) / len(steps)
    lines = [
        f"run {pt['run']}, trainer {pt['trainer_id']}: the last {len(steps)} steps "
        f"({steps[0]['step']}-{steps[-1]['step']}), {wall:.1f} ms a step; "
        f"{pt['steps_seen']} steps seen",
        "",
        f"{'region':<24} {'mean ms':>9} {'share':>7} {'max ms':>9}",
    ]
    for r in pt["regions"]:
        lines.append(
            f"{r['region'][:24]:<24} {r['mean_ms']:>9.1f} {r['share']:>7.1%} {r['max_ms']:>9.1f}"
        )
    other = sum(s["other_ms"] for s in steps) / len(steps)
    lines.append(f"{'(in no region)':<24} {other:>9.1f} {other / wall if wall else 0:>7.1%}")
    lines += ["", "slowest steps:"]
    for s in pt["slowest"]:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(s["regions"].items()))
        lines.append(f"  step {s['step']}: {s['wall_ms']:.1f} ms ({parts})")
    return "\n".join(lines)


def render_diff(d: KernelDiffReply) -> str:
    """Window b against window a: step time, breakdown shift, then the kernels that changed
    most (per step and per rank), new and vanished ones marked."""
    a, b = d["a"], d["b"]
    sa, sb = d["step_ms"]
    ratio = f" (x{d['step_ratio']:.2f})" if d["step_ratio"] else ""
    lines = [
        f"window {b['window']} (run {b['run']}, steps {_span(b['steps'])}, {b['ranks']} ranks) "
        f"against window {a['window']} (run {a['run']}, steps {_span(a['steps'])}, "
        f"{a['ranks']} ranks), self {d['device']} time per step and rank",
        f"step time: {_num(sa)} -> {_num(sb)} ms{ratio}; every kernel: "
        f"{d['total_us'][0] / 1e3:.2f} -> {d['total_us'][1] / 1e3:.2f} ms",
    ]
    if d["breakdown"]:
        lines.append(
            "breakdown: "
            + ", ".join(
                f"{s['category']} {s['a_share']:.0%} -> {s['b_share']:.0%}" for s in d["breakdown"]
            )
        )
    lines += ["", f"{'a us':>10} {'b us':>10} {'change':>10} {'ratio':>7}  name"]
    for k in d["kernels"]:
        r = f"x{k['ratio']:.2f}" if k["ratio"] is not None else k["status"]
        nums = f"{k['a_us']:>10.1f} {k['b_us']:>10.1f} {k['change_us']:>+10.1f}"
        lines.append(f"{nums} {r:>7}  {k['name'][:70]}")
    if d["new"] or d["vanished"]:
        lines.append(f"\n{len(d['new'])} new kernels, {len(d['vanished'])} vanished")
    return "\n".join(lines)


def _span(steps: list[int]) -> str:
    return "-".join(map(str, steps)) if steps else "?"


def marks_lines(w: Any) -> list[str]:
    """Each role's marks of a window, a line each (the role named when there are several)."""
    parts = [p for p in (w.get("roles") or {}).values() if p.get("regression")]
    if not parts:  # (a reply from before marks were per role)
        r = w.get("regression")
        return [t] if r and (t := regression_text(r)) else []
    named = len(w["roles"]) > 1
    texts = [(p["role"], regression_text(p["regression"])) for p in parts]
    return [f"{role}: {t}" if named else t for role, t in texts if t]


def regression_text(r: RegressionEntry) -> str:
    """A window's (one role's) regression marks in one line ("" when nothing is marked)."""
    parts = []
    if r["step_regressed"] and r["step_ratio"] is not None:
        parts.append(f"step x{r['step_ratio']:.2f}")
    parts += [f"{k['name'][:40]} x{k['ratio']:.2f}" for k in r["kernels"][:3]]
    if not parts:
        return ""
    more = len(r["kernels"]) - 3
    tail = f" (+{more} kernels)" if more > 0 else ""
    ref: list[Any] = r.get("reference") or [r["baseline"]]  # (an older checkpoint's entry)
    return f"SLOWER than windows {ref[0]}-{ref[-1]} ({len(ref)}): " + ", ".join(parts) + tail
