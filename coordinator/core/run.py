"""Runs: what a trainer starts and stops. Pure: no Ray, no I/O.

A coordinator lives longer than one run: the same named actor serves one run after another,
never mixing them. Each ``Run`` has its own config, run directory, window plan (numbered from 0)
and bookkeeping; a run that ended is kept, bounded, for reading (``previous_runs``).
``attach_decision`` says what a trainer that attaches gets.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from coordinator.core.config import ProfilerConfig
from coordinator.core.schedule import Schedule
from coordinator.core.slowdown import SlowdownDetector
from coordinator.core.spmd_plan import PlannedCapture
from coordinator.core.state import CoordinatorState
from coordinator.core.trace_layout import child, default_run_name
from coordinator.core.window_plan import WindowPlan
from coordinator.protocol.replies import AutoTrigger, RunEntry, RunLifecycle

Decision = Literal["join", "resume", "fresh", "conflict"]


@dataclass
class Run:
    """One run's config, directory, window plan and bookkeeping."""

    name: str
    config: ProfilerConfig
    run_dir: str | None
    plan: WindowPlan
    state: CoordinatorState
    lifecycle: RunLifecycle = "configured"
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    ended_at: float | None = None
    ended_reason: str | None = None
    # ranks each requested capture profiles, until it opens
    capture_ranks: dict[int, list[tuple[str, int]]] = field(default_factory=dict)
    # captures planned for SPMD ranks (their boards): pending ones, and the latest opened
    spmd_captures: dict[int, PlannedCapture] = field(default_factory=dict)
    # why each planned auto capture was taken, until it opens
    auto_triggers: dict[int, AutoTrigger] = field(default_factory=dict)
    detector: SlowdownDetector | None = None
    auto_override: bool | None = None  # an operator's switch (``set_auto_capture``), else None
    baseline: int | None = None  # the window pinned for regression marks (``pin_baseline``)

    @property
    def auto_enabled(self) -> bool:
        """Whether slow steps are profiled by themselves now: the operator's switch, else the
        config's (and never while profiling is disabled)."""
        wanted = (
            self.config.auto_capture.enable if self.auto_override is None else self.auto_override
        )
        return self.config.enable and wanted

    @property
    def active(self) -> bool:
        """Started (or with trainers registered) and not stopped."""
        configured_with_trainers = self.lifecycle == "configured" and bool(self.state.trainers)
        return self.lifecycle == "running" or configured_with_trainers

    def info(self) -> RunEntry:
        """The run as ``status()`` shows it."""
        return {
            "name": self.name,
            "lifecycle": self.lifecycle,
            "run_dir": self.run_dir,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "ended_reason": self.ended_reason,
            "global_step": self.state.global_step,
            "stepping_trainer": self.state.stepping_trainer,
        }


def new_run(config: ProfilerConfig, taken: set[str], now: float | None = None) -> Run:
    """A fresh run for ``config``: its own directory (never one an earlier run used) and plan."""
    name = unique_run_name(config.run_name or default_run_name(now), taken)
    run_dir = child(config.save_path, name) if config.save_path else None
    return Run(
        name=name,
        config=config,
        run_dir=run_dir,
        plan=WindowPlan(Schedule(config)),
        detector=SlowdownDetector(config.auto_capture),
        state=CoordinatorState(
            config.max_windows, config.detail_windows, config.straggler_threshold
        ),
    )


def unique_run_name(wanted: str, taken: set[str]) -> str:
    """``wanted``, or ``wanted.2``, ``wanted.3`` ... when an earlier run already used it."""
    if wanted not in taken:
        return wanted
    n = 2
    while f"{wanted}.{n}" in taken:
        n += 1
    return f"{wanted}.{n}"


def config_diff(running: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """The config fields whose values differ (a ``run_name`` left to default matches any)."""
    out = []
    for key in sorted(set(running) | set(wanted)):
        if key == "run_name" and wanted.get(key) is None:
            continue
        if running.get(key) != wanted.get(key):
            out.append(key)
    return out


def attach_decision(
    run: Run, wanted: dict[str, Any], trainer_id: str | None, stepping_alive: bool
) -> tuple[Decision, list[str]]:
    """What a trainer attaching with config ``wanted`` gets, and the fields that differ.

    - the run never had a trainer: ``join`` it with the same config, else ``fresh``;
    - the run stopped: ``fresh`` (a new run with ``wanted``);
    - the stepping trainer re-attaches (a restarted driver): ``resume`` the run as it is;
    - the run is active and its stepping trainer alive: ``join`` it with the same config,
      ``conflict`` with another one;
    - the run is active but its stepping trainer is gone without a stop: ``fresh``.
    """
    diff = config_diff(run.config.to_dict(), wanted)
    if run.lifecycle == "configured" and not run.state.trainers:
        return ("join" if not diff else "fresh"), diff  # nothing to keep: take it, or replace it
    if not run.active:
        return "fresh", diff
    if trainer_id is not None and trainer_id == run.state.stepping_trainer:
        return "resume", diff
    if not stepping_alive:
        return "fresh", diff
    return ("join" if not diff else "conflict"), diff
