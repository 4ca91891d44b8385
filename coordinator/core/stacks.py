"""Stacks read from many processes, made readable: parsed, grouped by identical stack, and the
group that is not waiting in a collective named. Pure: no Ray, no torch, no I/O.

Both readers' outputs parse to ``ThreadStack`` lists: ``py-spy dump --json`` and the text that
``faulthandler`` writes. Of a process's threads, the one doing the trainer's work is its stack
(``main_thread``); the others are kept for ``--rank R``.

>>> frames = [_f("all_reduce", "torch/distributed/distributed_c10d.py"), _f("train", "t.py")]
>>> stack_kind(frames), short_stack(frames)
('collective', 'all_reduce <- train')
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from coordinator.protocol.stack_replies import (
    StackEntry,
    StackFrame,
    StackGroup,
    StackKind,
    ThreadStack,
)

COLLECTIVES = frozenset(
    {
        "all_reduce",
        "allreduce",
        "all_reduce_coalesced",
        "all_gather",
        "allgather",
        "all_gather_into_tensor",
        "all_gather_object",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "broadcast",
        "broadcast_object_list",
        "barrier",
        "monitored_barrier",
        "all_to_all",
        "all_to_all_single",
        "reduce",
        "gather",
        "scatter",
        "send",
        "recv",
        "wait",
        "batch_isend_irecv",
    }
)
"""Function names that are collectives when they come from torch.distributed's own files."""
_NATIVE_WAIT = re.compile(r"(ProcessGroup(Gloo|NCCL|Nccl)|c10d::|gloo::|nccl)", re.IGNORECASE)
_DISTRIBUTED_FILE = re.compile(r"(^|/)(torch/distributed/|c10d)")
# A Ray worker waiting for its next task, or a pool thread waiting for work: nothing runs there.
_IDLE_FUNCTIONS = frozenset({"main_loop", "run_task_loop", "wait", "_worker", "select", "get"})
_RAY_FILE = re.compile(r"(^|/)ray/(_private|_raylet|util/tracing|actor\.py|remote_function)")
_WRAPPERS = frozenset({"wrapper", "inner", "_fn", "decorate_context", "_wrapped_call_impl"})
SHOWN_FRAMES = 6


def _f(function: str, file: str, line: int = 1) -> StackFrame:
    return {"function": function, "file": file, "line": line}


def short_name(function: str) -> str:
    """``Thread.run`` (py-spy, Python 3.11+) and ``run`` (faulthandler) name one function."""
    return function.rsplit(".", 1)[-1] if "(" not in function else function


# ------------------------------------------------------------ parsing


def parse_py_spy(text: str) -> list[ThreadStack]:
    """The threads of ``py-spy dump --json``; ValueError when ``text`` is not that."""
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError("py-spy --json output is not a list of threads")
    threads: list[ThreadStack] = []
    for t in data:
        frames: list[StackFrame] = [
            {
                "function": str(fr.get("name", "?")),
                "file": str(fr.get("filename") or fr.get("short_filename") or "?"),
                "line": int(fr.get("line") or 0),
            }
            for fr in t.get("frames") or []
        ]
        name = t.get("thread_name")
        threads.append(
            {
                "thread": f"0x{int(t.get('thread_id', 0)):016x}",
                "name": str(name) if name is not None else None,
                "main": name == "MainThread",
                "active": bool(t["active"]) if "active" in t else None,
                "frames": frames,
            }
        )
    return threads


_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):")
_FH_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_faulthandler(text: str, main_thread: int | None) -> list[ThreadStack]:
    """The threads of one ``faulthandler`` dump (the text after the dump began)."""
    threads: list[ThreadStack] = []
    for line in text.splitlines():
        head = _FH_THREAD.match(line)
        if head:
            ident = int(head.group(2), 16)
            threads.append(
                {
                    "thread": f"0x{ident:016x}",
                    "name": None,
                    "main": main_thread is not None and ident == main_thread,
                    "active": None,
                    "frames": [],
                }
            )
            continue
        frame = _FH_FRAME.match(line)
        if frame and threads:
            threads[-1]["frames"].append(_f(frame.group(3), frame.group(1), int(frame.group(2))))
    if not threads:
        raise ValueError("no thread in the faulthandler dump")
    return threads


# ------------------------------------------------------------ reading one stack


def is_idle(frames: Sequence[StackFrame]) -> bool:
    """Whether a thread only waits for work: its frames are Ray's task loop or a pool's wait."""
    if not frames:
        return True
    inner = short_name(frames[0]["function"])
    ours = [f for f in frames if not _RAY_FILE.search(f["file"]) and not _stdlib(f["file"])]
    return not ours and (
        inner in _IDLE_FUNCTIONS or _RAY_FILE.search(frames[0]["file"]) is not None
    )


def _stdlib(file: str) -> bool:
    return "/lib/python3" in file and "site-packages" not in file


def main_thread(threads: Sequence[ThreadStack]) -> ThreadStack | None:
    """The thread doing the process's work: the main thread, unless it only waits for tasks
    while another thread runs code of the trainer (an async actor's event loop thread)."""
    if not threads:
        return None
    main = next((t for t in threads if t["main"]), threads[0])
    if not is_idle(main["frames"]):
        return main
    busy = [t for t in threads if t is not main and not is_idle(t["frames"])]
    ours = [t for t in busy if any(not _stdlib(f["file"]) for f in t["frames"])]
    return (ours or [main])[0]


def stack_kind(frames: Sequence[StackFrame]) -> StackKind:
    """``collective`` when a frame is a torch.distributed collective or a gloo/NCCL wait,
    ``idle`` when the thread only waits for a task, else ``other``."""
    for fr in frames:
        name = short_name(fr["function"])
        if name in COLLECTIVES and _DISTRIBUTED_FILE.search(fr["file"]):
            return "collective"
        if fr["line"] == 0 and _NATIVE_WAIT.search(fr["function"]):
            return "collective"
    return "idle" if is_idle(frames) else "other"


def short_stack(frames: Sequence[StackFrame], shown: int = SHOWN_FRAMES) -> str:
    """Innermost first, without Ray's own frames and decorator wrappers: ``a <- b <- c``."""
    names = [
        short_name(f["function"])
        for f in frames
        if not _RAY_FILE.search(f["file"]) and short_name(f["function"]) not in _WRAPPERS
    ]
    if not names:
        names = [short_name(f["function"]) for f in frames[:shown]] or ["(no Python frame)"]
    more = len(names) - shown
    return " <- ".join(names[:shown]) + (f" <- ... ({more} more)" if more > 0 else "")


def stack_key(frames: Sequence[StackFrame]) -> tuple[tuple[str, str, int], ...]:
    """Stacks with this key are identical (the short function name, so both readers agree)."""
    return tuple((short_name(f["function"]), f["file"], f["line"]) for f in frames)


# ------------------------------------------------------------ grouping


@dataclass
class _Group:
    entries: list[StackEntry]
    frames: list[StackFrame]
    kind: StackKind


def group_stacks(entries: Iterable[StackEntry]) -> list[StackGroup]:
    """Entries with a stack, grouped by trainer, role and identical stack; the smallest groups
    first. In a trainer where some group waits in a collective, every group that does not is
    a ``culprit``."""
    groups: dict[tuple[str, str, str, tuple[tuple[str, str, int], ...]], _Group] = {}
    for e in entries:
        if e["kind"] is None:
            continue
        key = (e["trainer_id"], e["role"], e["who"], stack_key(e["frames"]))
        g = groups.get(key)
        if g is None:
            groups[key] = _Group([e], e["frames"], e["kind"])
        else:
            g.entries.append(e)
    waiting = {k[0] for k, g in groups.items() if g.kind == "collective" and k[2] == "rank"}
    out: list[StackGroup] = []
    for (tid, role, who, _), g in groups.items():
        ranks = sorted(e["rank"] for e in g.entries if e["rank"] is not None)
        out.append(
            {
                "trainer_id": tid,
                "role": role,
                "who": who,  # type: ignore[typeddict-item]
                "ranks": ranks,
                "label": _label(who, ranks, len(g.entries)),
                "count": len(g.entries),
                "kind": g.kind,
                "culprit": who == "rank" and tid in waiting and g.kind != "collective",
                "stack": short_stack(g.frames),
                "frames": g.frames,
            }
        )
    out.sort(key=lambda g: (g["who"] != "rank", g["count"], g["trainer_id"], g["ranks"]))
    return out


def _label(who: str, ranks: list[int], count: int) -> str:
    if who == "driver":
        return "driver" if count == 1 else f"drivers ({count})"
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranges(ranks)}"


def ranges(ranks: Sequence[int], shown: int = 24) -> str:
    """Sorted ranks as runs: ``0, 2-15``; past ``shown`` runs, how many more ranks.

    >>> ranges([0, 2, 3, 4, 9])
    '0, 2-4, 9'
    """
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:shown])
    rest = sum(b - a + 1 for a, b in runs[shown:])
    return text + (f", ... ({rest} more)" if rest else "")


def culprit_line(groups: Sequence[StackGroup]) -> str | None:
    """One line naming the likely culprit: the ranks not in a collective while their trainer's
    other ranks wait in one, each trainer with its own count of waiting ranks; None when there
    is no such group."""
    bad: dict[str, list[StackGroup]] = {}
    for g in groups:
        if g["culprit"]:
            bad.setdefault(g["trainer_id"], []).append(g)
    if not bad:
        return None
    parts = []
    for tid, culprits in bad.items():
        waiting = sum(
            g["count"]
            for g in groups
            if g["kind"] == "collective" and g["who"] == "rank" and g["trainer_id"] == tid
        )
        names = "; ".join(f"{g['label']} in {g['stack'].split(' <- ')[0]}" for g in culprits)
        parts.append(f"{names} (while {waiting} ranks of {tid} wait in a collective)")
    return "likely culprit: " + "; ".join(parts)


def render_groups(groups: Sequence[StackGroup], unreadable: Sequence[StackEntry]) -> list[str]:
    """The grouped view as text: one line per group, the culprit marked, then what could not
    be read and why."""
    lines: list[str] = []
    several = len({g["trainer_id"] for g in groups}) > 1
    for g in groups:
        mark = "  <- likely culprit" if g["culprit"] else ""
        whose = f"{g['trainer_id']} " if several or g["who"] == "driver" else ""
        lines.append(f"{whose}{g['label']} ({g['count']}): {g['stack']}{mark}")
    for e in unreadable:
        who = "driver" if e["who"] == "driver" else f"rank {e['rank']}"
        lines.append(f"{e['trainer_id']} {who}: no stack: {e['error']}")
    return lines
