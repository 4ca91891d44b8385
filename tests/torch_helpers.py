"""A small model and a driver loop for rank-profiler tests."""

from __future__ import annotations

import os

import torch

from coordinator.config import ProfilerConfig
from coordinator.schedule import Schedule
from coordinator.window_driver import Begin, End, Ignored, Step, WindowDriver
from worker_ext.rank_profiler import RankProfiler


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
    """Send driver commands to a rank profiler; returns the statuses."""
    if isinstance(commands, Ignored):
        return []
    out = []
    for c in commands:
        if isinstance(c, Begin):
            out.append(rp.begin_window(c.window, c.step))
        elif isinstance(c, Step):
            out.append(rp.step(c.step))
        elif isinstance(c, End):
            out.append(rp.end_window())
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
    drv = WindowDriver(Schedule(cfg))
    model = model or TinyMLP()
    statuses = apply(rp, drv.start(first_step))
    for k in range(first_step, first_step + steps):
        model.train_step()
        statuses += apply(rp, drv.step(k))
    if stop:
        statuses += apply(rp, drv.stop())
    statuses.append(rp.wait_for_summaries(30))
    return rp, statuses


def summaries(statuses: list[dict]) -> list[bytes]:
    return [s for st in statuses for s in st["summaries"]]


def window_dirs(cfg: ProfilerConfig) -> list[str]:
    run = os.path.join(cfg.save_path, cfg.run_name or "run")
    return sorted(os.listdir(run)) if os.path.isdir(run) else []
