"""Stacks and stalls, declared once: what a node agent reads and what ``stacks()`` answers.

The coordinator asks every node's agent for the stacks of that node's processes (a
``StackRequest``); the agent answers one ``ProcessStack`` per process, read with py-spy or, when
py-spy cannot attach, from the process's ``faulthandler`` dump. ``coordinator.core.stacks``
groups them into a ``StacksReply``. Pure: no Ray, no torch. ``coordinator.protocol.replies``
re-exports the replies.
"""

from __future__ import annotations

from typing import Literal, TypedDict

StackMethod = Literal["py-spy", "faulthandler"]
"""How a process's stack was read: ``py-spy dump`` from outside, or the process's own
``faulthandler`` dump on a signal."""

StackKind = Literal["collective", "idle", "other"]
"""What a stack is doing: waiting in a collective (``all_reduce``, ``barrier``, gloo/NCCL waits),
``idle`` (its worker waits for a task; nothing of the trainer runs), or ``other``."""

METHODS = ("auto", "py-spy", "faulthandler")
"""``stacks(method=...)``: ``auto`` tries py-spy, then faulthandler."""


class StackDump(TypedDict):
    """Where a process's ``faulthandler`` dump goes, so its agent can ask for one: the signal
    that triggers it, the file it appends to, the main thread's id; and the pipe that asks a
    CUDA rank for its NCCL Flight Recorder dump (``flight_recorder``; None with why in
    ``flight_recorder_note``)."""

    signal: int | None
    path: str | None
    main_thread: int | None
    note: str | None  # why faulthandler is not registered, when it is not
    flight_recorder: str | None
    flight_recorder_note: str | None


class StackTarget(TypedDict):
    """One process whose stack the coordinator wants."""

    pid: int
    dump: StackDump | None


class StackRequest(TypedDict):
    """What the coordinator asks one node's agent: every listed process's stack, read at the
    wall-clock time ``at`` (so every node reads at the same moment), within ``timeout_s``.
    ``flight_recorder_dir``: also ask CUDA ranks for their NCCL Flight Recorder dump there."""

    targets: list[StackTarget]
    native: bool
    method: str  # one of METHODS
    at: float
    timeout_s: float
    flight_recorder_dir: str | None


class StackFrame(TypedDict):
    """One frame, innermost first in a list. ``line`` is 0 for a native frame."""

    function: str
    file: str
    line: int


class ThreadStack(TypedDict):
    thread: str  # the thread's id, as py-spy or faulthandler shows it
    name: str | None  # its Python name (py-spy only)
    main: bool
    active: bool | None  # whether it was running (py-spy only)
    frames: list[StackFrame]


class FlightRecorderEntry(TypedDict):
    """A rank's NCCL Flight Recorder dump: where it was written, or why not."""

    path: str | None
    reason: str | None


class ProcessStack(TypedDict):
    """What an agent read of one process."""

    pid: int
    method: StackMethod | None
    threads: list[ThreadStack]
    error: str | None  # why no stack: ``exited``, ``permission: ...``, ``py-spy not installed``
    tried: list[str]  # why each method tried before the one that worked failed
    taken_at: float  # wall clock when the read began
    read_ms: float  # how long the read took (py-spy pauses the process for part of it)
    flight_recorder: FlightRecorderEntry | None


class StackEntry(TypedDict):
    """One process in ``stacks()``: a rank (of a trainer, in a role) or a trainer's driver."""

    who: Literal["rank", "driver"]
    trainer_id: str
    role: str
    rank: int | None  # None for a driver
    node_id: str | None
    pid: int | None
    method: StackMethod | None
    error: str | None
    tried: list[str]
    read_ms: float | None  # the read on its node (py-spy pauses the process for part of it)
    kind: StackKind | None
    stack: str | None  # the short form: ``all_reduce <- _update <- sft_step``
    frames: list[StackFrame]  # the thread the stack is taken from, innermost first
    threads: list[ThreadStack] | None  # every thread, when asked for (``threads=True``)
    flight_recorder: FlightRecorderEntry | None


class StackGroup(TypedDict):
    """Processes of one trainer with the identical stack."""

    trainer_id: str
    role: str
    who: Literal["rank", "driver"]
    ranks: list[int]
    label: str  # ``ranks 0, 2-15`` / ``rank 1`` / ``driver``
    count: int
    kind: StackKind
    culprit: bool  # not in a collective while others of its trainer wait in one
    stack: str
    frames: list[StackFrame]


class StacksReply(TypedDict):
    """``stacks()``: every process's stack, read at one moment and grouped by identical stack,
    the smallest groups first; ``culprit`` says in one line which group is the likely cause."""

    taken_at: float
    elapsed_s: float
    native: bool
    method: str
    groups: list[StackGroup]
    unreadable: list[StackEntry]  # processes whose stack could not be read, with why
    entries: list[StackEntry]
    culprit: str | None
    lines: list[str]  # the grouped view as text, as the CLI prints it


class StallEntry(TypedDict):
    """One stall in ``status()["stalls"]``: when steps stopped, what the stacks said then."""

    index: int
    trainer_id: str
    detected_at: float
    last_step: int | None
    last_step_at: float
    threshold_s: float  # max(stall_factor x median step time, stall_min_s)
    median_step_s: float | None
    takes: int  # how often stacks were taken during it
    resumed_at: float | None
    resumed_step: int | None
    culprit: str | None
    lines: list[str]  # the last grouped stacks, as text
    flight_recorder: dict[str, FlightRecorderEntry]  # per "trainer/rank"
    path: str | None  # the stall's JSON file in the run's directory
    error: str | None  # why stacks or the file could not be had
