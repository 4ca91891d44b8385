"""A small model and a plan loop for rank-profiler tests."""

from __future__ import annotations

import os

import torch

from coordinator.core.config import ProfilerConfig
from coordinator.core.schedule import Schedule
from coordinator.core.window_plan import Ignored, Start, Step, Stop, WindowPlan
from worker_ext.rank.rank_profiler import RankProfiler


class TinyMLP(torch.nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 4)
        )
        self.opt = torch.optim.SGD(self.parameters(), lr=0.01)

    def train_step(self) -> float:
        x = torch.randn(16, self.net[0].in_features)
        loss = self.net(x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return float(loss.detach())


def apply(rp: RankProfiler, commands) -> list[dict]:
    """Send plan commands to a rank profiler; returns the statuses."""
    if isinstance(commands, Ignored):
        return []
    out = []
    for c in commands:
        if isinstance(c, Start):
            out.append(rp.start_window(c.window, c.step))
        elif isinstance(c, Step):
            out.append(rp.step(c.step))
        elif isinstance(c, Stop):
            out.append(rp.stop_window())
    return out


def run_profiled(
    cfg: ProfilerConfig,
    steps: int,
    rank: int = 0,
    first_step: int = 0,
    stop: bool = True,
    model: TinyMLP | None = None,
) -> tuple[RankProfiler, list[dict]]:
    """Train ``steps`` steps under the schedule, stop, and wait for summaries."""
    cfg.validate()
    rp = RankProfiler(rank, cfg, os.path.join(cfg.save_path, cfg.run_name or "run"))
    plan = WindowPlan(Schedule(cfg))
    model = model or TinyMLP()
    statuses = apply(rp, plan.start(first_step))
    for k in range(first_step, first_step + steps):
        model.train_step()
        statuses += apply(rp, plan.step(k))
    if stop:
        statuses += apply(rp, plan.stop())
    statuses.append(rp.wait_for_summaries(30))
    return rp, statuses


def summaries(statuses: list[dict]) -> list[bytes]:
    return [s for st in statuses for s in st["summaries"]]


def window_dirs(cfg: ProfilerConfig) -> list[str]:
    run = os.path.join(cfg.save_path, cfg.run_name or "run")
    return sorted(os.listdir(run)) if os.path.isdir(run) else []
