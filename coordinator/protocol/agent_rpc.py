"""What the coordinator asks of node agents, declared once: window commands fanned out per node.

The coordinator sends one ``NodeCommand`` per group of nodes to one agent of the group (the
relay); the relay calls the ranks of its own node and forwards each other node's part to that
node's agent, and answers with one ``NodeCommandReply`` that folds every rank's reply. A rank
whose reply is what its agent last forwarded for it is only listed (``answered``), so a quiet
step costs the coordinator a list of ints per node, not a dict per rank.
"""

from __future__ import annotations

from typing import Any, TypedDict

from coordinator.protocol.memory_replies import AgentMemoryReply, MemoryWatch
from coordinator.protocol.replies import RankReply, RankState, Reason
from coordinator.protocol.stack_replies import ProcessStack, StackRequest

NODE_COMMANDS = ("start_profile", "profile_step", "stop_profile", "dump_profiler_summary")
"""The rank RPCs that may travel through node agents (``configure_profiler`` goes direct)."""
ADOPT = "adopt"
"""A node command that calls no rank: the agents keep the handles it carries (a trainer
registered), so that the first window's command need not carry them."""

CONTROL_LANE = "control"
"""The agent's concurrency group (its own thread and event loop) for window commands, pings and
stack reads: a relay busy taking its group's summaries does not hold the next window's start
behind its event loop's queue (``bench/ray_queueing.py``: the worst ping behind 1,250 calls that
each wait for their fold, 4.6-6.0 s in the default lane, 1.2-2.6 s here; Ray still hands calls
to Python in arrival order, whatever their group)."""
CONTROL_CALLS = 64


class NodeOrder(TypedDict):
    """One node's part of a command: its agent, its ranks, and their handles when the agent may
    not hold them yet (aligned with ``ranks``)."""

    agent: str
    ranks: list[tuple[str, int]]
    handles: list[Any] | None


class NodeCommand(TypedDict):
    """A rank RPC for the ranks of some nodes. ``owner`` names the coordinator (its namespace,
    name and incarnation: ``namespace/name#restarts``): an agent keeps handles and last replies per
    owner. ``idle_exit_s``: the owner's ``agent_idle_exit_s``."""

    owner: str
    run: str
    relay: str  # the agent the coordinator sent it to: the group's node partials go there
    method: str
    args: list[Any]
    timeout_s: float
    nodes: dict[str, NodeOrder]
    idle_exit_s: float | None


class RankFailure(TypedDict):
    """A rank that did not answer: lost (its process died), disabled (the call raised) or
    unresponsive (no answer within the timeout)."""

    trainer_id: str
    rank: int
    state: RankState
    reason: Reason


class NodeAnswer(TypedDict):
    """One node's answer. ``error`` set: the node's agent could not be reached (nothing else is
    set, and no rank of the node was called through it)."""

    node: str
    agent: str
    answered: list[tuple[str, int]]
    replies: list[tuple[str, int, RankReply]]
    failed: list[RankFailure]
    unknown: list[tuple[str, int]]  # ranks whose handle the agent does not hold: not called
    error: Reason | None


class NodeCommandReply(TypedDict):
    """``command``: every node's answer."""

    relay: str
    nodes: list[NodeAnswer]


class PlanPost(TypedDict):
    """``post_plan``: a trainer's plan board (``coordinator.protocol.plan_board``) for the SPMD
    ranks of one node. ``board`` names the file, ``blob`` is the encoded ``Board``; the agent
    waits up to ``timeout_s`` for each of ``ranks`` (``[rank, pid]``) to acknowledge capture
    ``window`` (no wait when ``window`` is None)."""

    board: str
    blob: bytes
    version: int
    window: int | None
    ranks: list[tuple[int, int | None]]
    timeout_s: float


class PlanAnswer(TypedDict):
    """A node's answer to ``post_plan``: each rank as ``[rank, step]`` (the step it was
    finishing when it read the board). ``held``: it follows the capture; ``late``: it read the
    board after the capture's warm-up began; ``off``: it can no longer follow the plan (with
    why); ``lost``: its process is gone; ``silent``: no acknowledgement within the time."""

    node: str
    held: list[tuple[int, int | None]]
    late: list[tuple[int, int | None]]
    off: list[tuple[int, str]]
    lost: list[int]
    silent: list[int]


class SnapshotRequest(TypedDict):
    """``request_snapshots``: each target's pid and the path its snapshot goes to."""

    targets: list[tuple[int, str]]


class SnapshotAsked(TypedDict):
    """Whether a process was asked for its snapshot (it notes the result when written)."""

    pid: int
    asked: bool
    reason: str | None


class AgentRPC:
    """The signatures of the node agent's RPCs that the coordinator calls."""

    async def ping(self) -> int:
        """The agent's pid."""
        raise NotImplementedError

    async def command(self, cmd: NodeCommand) -> NodeCommandReply:
        """Run ``cmd`` on the ranks of the nodes it names (see the module docstring)."""
        raise NotImplementedError

    async def post_plan(self, post: PlanPost) -> PlanAnswer:
        """Write a plan board on this node and wait for its ranks' acknowledgements."""
        raise NotImplementedError

    async def read_stacks(self, req: StackRequest) -> list[ProcessStack]:
        """The stack of every process ``req`` lists on this node, read at ``req["at"]``."""
        raise NotImplementedError

    async def watch_memory(self, watch: MemoryWatch) -> AgentMemoryReply:
        """Sample the memory of ``watch``'s processes from now on; what was sampled since the
        last watch (``worker_ext.agent.memory_sampler``)."""
        raise NotImplementedError

    async def request_snapshots(self, req: SnapshotRequest) -> list[SnapshotAsked]:
        """Ask each process of ``req`` on this node for a CUDA memory snapshot to its path."""
        raise NotImplementedError
