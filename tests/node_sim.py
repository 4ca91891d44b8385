"""Simulated topology for the node fan-out tests: many "nodes" on this one machine.

``PlainRank`` answers the rank RPCs without torch, claiming a node and that node's agent, and
records what it was told. ``SimNodeAgents`` is the real agent fan-out (``RankFanOut``: calls
the ranks' handles, forwards other agents' nodes, folds replies) for the simulated nodes it
hosts. Faults are injected by telling a rank to raise or hang at a step.
"""

from __future__ import annotations

import time
from typing import Any

from coordinator.protocol.replies import RankReply, rank_reply
from worker_ext.agent.rank_fanout import RankFanOut


class PlainRank:
    def __init__(self, node: str, agent: str) -> None:
        self.node, self.agent = node, agent
        self.calls: list[tuple[str, Any]] = []
        self.faults: dict[int, str] = {}
        self.window: dict[str, Any] | None = None

    def inject(self, step: int, kind: str) -> None:
        self.faults[step] = kind  # "raise" or "hang"

    def told(self) -> list[tuple[str, Any]]:
        return self.calls

    def reply(self, closed: dict[str, Any] | None = None) -> RankReply:
        return rank_reply(
            node_id=self.node,
            device="cpu",
            phase="idle" if self.window is None else "recording",
            window=self.window["index"] if self.window else None,
            closed=closed,
            agent={"kind": "node_agent", "pid": 0, "name": self.agent},
        )

    def configure_profiler(self, rank, config, run_dir, warm_up=True, report_to=None, role=""):
        self.calls.append(("configure_profiler", rank))
        return self.reply()

    def start_profile(self, window, step):
        self.calls.append(("start_profile", window["index"]))
        self.window = window
        return self.reply()

    def profile_step(self, step):
        self.calls.append(("profile_step", step))
        fault = self.faults.get(step)
        if fault == "raise":
            raise RuntimeError(f"injected at step {step}")
        if fault == "hang":
            time.sleep(8)  # past the 3 s worker timeout
        w, closed = self.window, None
        if w is not None and step >= w["last"]:  # (one actor can answer for many ranks)
            closed = {"window": w["index"], "steps": [w["first"], w["last"]], "partial": False}
        return self.reply(closed)

    def stop_profile(self):
        self.calls.append(("stop_profile", None))
        self.window = None
        return self.reply()

    def dump_profiler_summary(self, wait_s=0.0):
        return self.reply()


class SimNodeAgents(RankFanOut):
    """The agents of the simulated ``nodes``, in one actor."""

    def __init__(self, name: str, nodes: list[str]) -> None:
        hosted = set(nodes)
        super().__init__(name, nodes[0], hosts=hosted.__contains__)

    def ping(self) -> int:
        return 0

    def held(self) -> list[tuple[str, int]]:
        """The ranks whose handles this actor's agents keep."""
        return sorted((t, r) for _, t, r in self.handles)
