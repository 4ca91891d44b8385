"""What every capture shares, whichever way it reaches the ranks (``captures``: the trainer's
waited report; ``spmd_captures``: the node agents' plan boards): why it is refused now, the
ranks it profiles, its counters, and the reply."""

from __future__ import annotations

from coordinator.core.run import Run
from coordinator.core.schedule import Window
from coordinator.core.validate import span
from coordinator.protocol.replies import CaptureReply, MissedRank
from coordinator.service.shell import CaptureRequest, CoordinatorShell, Key


def refusal(shell: CoordinatorShell, req: CaptureRequest) -> str | None:
    """Why ``req`` cannot be planned now, or None."""
    run, st = shell.run, shell.run.state
    tid = st.stepping_trainer
    if tid is None:
        return "no trainer is registered with the coordinator"
    if not run.config.enable:
        return "profiling is disabled in this coordinator's config"
    if run.lifecycle == "stopped":
        return f"no trainer is running: {run.ended_reason}"
    if run.lifecycle != "running":
        return f"no trainer is running: trainer {tid!r} has not started"
    world = st.trainers[tid].ranks
    if req.ranks is not None:
        unknown = sorted(set(req.ranks) - set(world))
        if unknown:
            return f"unknown ranks {unknown}: trainer {tid!r} has ranks {span(world)}"
    keys = capture_keys(shell, req)
    down = [r for (t, r) in keys if st.ranks[(t, r)].selected and not st.ranks[(t, r)].active]
    if req.kind == "auto" and not keys:
        return "no rank the config selects can profile"
    if down and req.kind != "auto":  # an auto capture profiles the ranks that can
        return f"ranks {down} cannot profile: " + "; ".join(
            f"rank {r} is {st.ranks[(tid, r)].state}" for r in down
        )
    idle = [r for t, r in keys if st.trainers[t].spmd and not st.ranks[(t, r)].selected]
    if idle:  # (no call reaches an SPMD rank to configure it for one window)
        return (
            f"ranks {span(idle)} are SPMD ranks the config does not select: they have no "
            "profiler to record with; select them in the config's roles"
        )
    return None


def capture_keys(shell: CoordinatorShell, req: CaptureRequest) -> list[Key]:
    """The ranks ``req`` profiles."""
    st = shell.run.state
    tid = st.stepping_trainer
    assert tid is not None
    if req.ranks is None:  # every role's selected ranks, so they share the window
        cfg = shell.run.config
        keys = [
            (t.trainer_id, r)
            for t in st.trainers.values()
            for r in t.ranks
            if cfg.selects(r, t.role)
        ]
    else:  # ranks named by the operator: the stepping trainer's
        keys = [(tid, r) for r in sorted(set(req.ranks))]
    if req.kind == "auto":
        keys = [k for k in keys if st.ranks[k].active]
    return keys


def count_capture(shell: CoordinatorShell, req: CaptureRequest, planned: Window) -> None:
    """A capture was planned: its counter, and an auto capture's trigger."""
    run = shell.run
    if req.trigger is not None and run.detector is not None:
        run.auto_triggers[planned.index] = req.trigger
        run.detector.accepted(req.trigger)
        run.state.counters["auto_captures"] += 1
    else:
        run.state.counters["captures_requested"] += 1


def accepted(run: Run, planned: Window, keys: list[Key], missed: list[MissedRank]) -> CaptureReply:
    """The reply to a planned capture."""
    return {
        "accepted": True,
        "reason": None,
        "run": run.name,
        "window": planned.index,
        "steps": [planned.first, planned.last],
        "warmup_start": planned.warmup_start,
        "ranks": [r for _, r in keys],
        "missed": missed,
    }


def auto_refused(shell: CoordinatorShell, req: CaptureRequest, why: str) -> CaptureReply:
    """An auto capture that cannot be planned now (another window is in the way): the detector
    tries again a little later; nobody waits for this answer."""
    run = shell.run
    if req.trigger is not None and run.detector is not None:
        run.detector.refused(req.trigger["step"])
    run.state.counters["auto_captures_deferred"] += 1
    return {
        "accepted": False,
        "reason": why,
        "run": run.name,
        "window": None,
        "steps": None,
        "warmup_start": None,
        "ranks": None,
        "missed": [],
    }
