"""The fault matrix's parts: the SFT trainer it runs, the faults it injects, what it checks.

The trainer is the SFT reference trainer's rank (``trainers.workers.PolicyWorker``, its
``sft_step`` on the batches of ``trainers.model.sft_batch``) with each rank training on its own
(``world_size=1``: no all-reduce), so that a rank that is killed, or whose node goes, leaves the
others training; every rank's losses are a pure function of the seed. Faults are injected into a
rank's process with ``__ray_call__`` (the only mocking: fault injection) and undone afterwards.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

STEPS = 12
SEED = 0
BATCH = 8
# wait 1, warm-up 1, record 2 steps, twice: windows record steps 2-3 and 6-7.
SCHEDULE = {"wait": 1, "warmup": 1, "active": 2, "repeat": 2}


# ---------------------------------------------------------------- injected into a rank


def _inject(self: Any, fault: str, arg: Any = None) -> bool:
    """Runs inside a rank (``w.__ray_call__.remote(_inject, fault)``): make ``fault`` happen."""
    import torch

    from worker_ext.rank import rank_profiler

    prof = torch.profiler.profile
    saved = self.__dict__.setdefault("_saved", {})

    def patch(owner: Any, name: str, fn: Any) -> None:
        saved.setdefault((owner, name), getattr(owner, name))
        setattr(owner, name, fn)

    def raising(where: str) -> Any:
        def fn(*a: Any, **kw: Any) -> None:
            raise RuntimeError(f"injected: torch failed in {where}")

        return fn

    if fault == "begin":
        patch(prof, "start", raising("start"))
    elif fault == "step":
        patch(prof, "step", raising("step"))
    elif fault == "end":
        real_stop = prof.stop

        def stop(p: Any) -> None:
            real_stop(p)
            raise RuntimeError("injected: torch failed in stop")

        patch(prof, "stop", stop)
    elif fault == "export":
        patch(prof, "export_chrome_trace", raising("export_chrome_trace"))
    elif fault in ("summary", "disk_full"):
        real_export = prof.export_chrome_trace

        def cut_short(p: Any, path: str) -> None:
            real_export(p, path)
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 3)
            if fault == "disk_full":
                raise OSError(28, "No space left on device (injected)", path)

        patch(prof, "export_chrome_trace", cut_short)
    elif fault == "unwritable":
        rp = self._rank_profiler
        blocker = os.path.join(arg, f"not-a-directory-{rp.rank}")
        with open(blocker, "w") as f:
            f.write("a file where the run directory should be")
        rp.run_directory = os.path.join(blocker, "run")
    elif fault == "hang":
        real_step = rank_profiler.RankProfiler.step

        def hang_once(rp: Any, k: int) -> Any:
            if not getattr(rp, "_hung", False):
                rp._hung = True
                time.sleep(arg)
            return real_step(rp, k)

        patch(rank_profiler.RankProfiler, "step", hang_once)
    else:
        raise ValueError(fault)
    return True


def _undo(self: Any) -> bool:
    """Runs inside a rank: put back everything ``_inject`` changed."""
    for (owner, name), original in self.__dict__.pop("_saved", {}).items():
        setattr(owner, name, original)
    return True


def _profiler_running(self: Any) -> bool:
    import torch

    return bool(torch._C._autograd._profiler_enabled())


# ---------------------------------------------------------------- the trainer


@dataclass
class Outcome:
    """What one case's training did and what profiling reported."""

    losses: dict[int, list[float]] = field(default_factory=dict)  # rank -> loss per step run
    steps_run: int = 0
    status: dict[str, Any] = field(default_factory=dict)
    rank_status: dict[int, dict[str, Any]] = field(default_factory=dict)
    profiler_running: dict[int, bool] = field(default_factory=dict)
    hooks_enabled: bool = True


def train(
    ray: Any, workers: list[Any], hooks: Any, at_step: dict[int, Any] | None = None
) -> Outcome:
    """``STEPS`` SFT steps on every rank still alive; ``at_step[k]()`` runs after step k."""
    from trainers.reference.model import ModelConfig, sft_batch, sft_corpus

    corpus, seq = sft_corpus(), ModelConfig().seq_len
    alive = dict(enumerate(workers))
    out = Outcome(losses={r: [] for r in alive})
    ray.get([w.reset.remote(SEED) for w in workers])
    with hooks.session(first_step=0):
        for step in range(STEPS):
            rows = sft_batch(corpus, step, BATCH, seq, SEED)
            refs = {r: w.sft_step.remote(rows) for r, w in alive.items()}
            for r, ref in refs.items():
                try:
                    out.losses[r].append(ray.get(ref, timeout=120))
                except ray.exceptions.RayActorError:
                    del alive[r]  # a rank the fault took away: the others train on
            hooks.step(step)
            out.steps_run += 1
            if at_step and step in at_step:
                at_step[step]()
    out.hooks_enabled = hooks.enabled
    for r, w in alive.items():
        out.rank_status[r] = ray.get(w.dump_profiler_summary.remote(), timeout=60)
        out.profiler_running[r] = ray.get(w.__ray_call__.remote(_profiler_running), timeout=60)
    return out


def wait_for_windows(ray: Any, coord: Any, timeout: float = 60.0) -> dict[str, Any]:
    """The status once no window waits for a summary or a trace (or ``timeout`` ran out)."""
    deadline = time.monotonic() + timeout
    while True:
        st = ray.get(coord.status.remote(), timeout=60)
        busy = any(w["summaries_pending"] or w["traces_pending"] for w in st["windows"])
        if not busy or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


def traces_parse(window: dict[str, Any], ranks: list[int]) -> list[str]:
    """Problems with the traces of ``ranks`` in a closed window: missing, or not JSON."""
    problems = []
    for r in ranks:
        path = os.path.join(window["trace_dir"] or "", f"rank{r}.pt.trace.json")
        try:
            with open(path) as f:
                json.load(f)["traceEvents"]
        except (OSError, ValueError, KeyError) as exc:
            problems.append(f"window {window['index']} rank {r}: {type(exc).__name__}: {exc}")
    return problems


def alive_actors(ray: Any, starting_too: bool = False) -> set[str]:
    """Ids of the live actors of the cluster (``starting_too``: and of those being created),
    node agents left out (they are the cluster's daemons)."""
    from ray._private import state

    from coordinator.protocol.names import AGENT_NAMESPACE

    agents = {
        ray.get_actor(a["name"], namespace=AGENT_NAMESPACE)._actor_id.hex()
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == AGENT_NAMESPACE
    }
    return {
        actor_id
        for actor_id, a in state.actors().items()
        if (a["State"] == "ALIVE" or (starting_too and a["State"] != "DEAD"))
        and actor_id not in agents
    }
