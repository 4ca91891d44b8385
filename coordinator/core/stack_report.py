"""From what the agents read to ``stacks()``'s reply: one entry per process, grouped. Pure.

The coordinator knows whose stacks it wants (``Whom``: every registered rank of every role and
each trainer's driver, with the pid and node Ray reports for it); the agents answer a
``ProcessStack`` per pid, or the coordinator knows why none came (an exited actor, a node that
is gone, an agent that did not answer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from coordinator.core.stacks import (
    culprit_line,
    group_stacks,
    main_thread,
    render_groups,
    short_stack,
    stack_kind,
)
from coordinator.protocol.stack_replies import (
    ProcessStack,
    StackDump,
    StackEntry,
    StacksReply,
)


@dataclass
class Whom:
    """A process whose stack is wanted, and what is known of it before anyone reads it."""

    who: Literal["rank", "driver"]
    trainer_id: str
    role: str
    rank: int | None
    node_id: str | None = None
    pid: int | None = None
    dump: StackDump | None = None
    error: str | None = None  # known already: the actor exited, its node is gone

    @property
    def order(self) -> tuple[str, int, int]:
        return (self.trainer_id, self.who == "driver", self.rank if self.rank is not None else -1)


def stack_entry(
    whom: Whom, got: ProcessStack | None, error: str | None, threads: bool
) -> StackEntry:
    """The entry of one process: its stack (the thread doing its work), or why there is none."""
    entry: StackEntry = {
        "who": whom.who,
        "trainer_id": whom.trainer_id,
        "role": whom.role,
        "rank": whom.rank,
        "node_id": whom.node_id,
        "pid": whom.pid,
        "method": None,
        "error": whom.error or error,
        "tried": [],
        "read_ms": None,
        "kind": None,
        "stack": None,
        "frames": [],
        "threads": None,
        "flight_recorder": None,
    }
    if got is None or entry["error"] is not None:
        return entry
    entry["method"], entry["tried"] = got["method"], list(got["tried"])
    entry["read_ms"] = got["read_ms"]
    entry["flight_recorder"] = got.get("flight_recorder")
    entry["error"] = got["error"]
    thread = main_thread(got["threads"])
    if thread is not None and got["error"] is None:
        entry["frames"] = thread["frames"]
        entry["kind"] = stack_kind(thread["frames"])
        entry["stack"] = short_stack(thread["frames"])
    if threads:
        entry["threads"] = got["threads"]
    return entry


def stacks_reply(
    entries: list[StackEntry], taken_at: float, elapsed_s: float, native: bool, method: str
) -> StacksReply:
    """The reply: entries in (trainer, rank) order, groups smallest first, the culprit line."""
    groups = group_stacks(entries)
    unreadable = [e for e in entries if e["kind"] is None]
    return {
        "taken_at": taken_at,
        "elapsed_s": elapsed_s,
        "native": native,
        "method": method,
        "groups": groups,
        "unreadable": unreadable,
        "entries": entries,
        "culprit": culprit_line(groups),
        "lines": render_groups(groups, unreadable),
    }
