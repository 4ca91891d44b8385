"""SkyRL's policy profiler, driven by the coordinator (``attach: {skyrl: true}``).

SkyRL's policy workers build their profiler with ``build_profiler_from_policy_cfg(cfg)``, which
makes ``skyrl.backends.skyrl_train.utils.profiler.Profiler(cfg.policy.torch_profiler_config)``;
its trainers call ``start_profile`` / ``profile_step`` / ``stop_profile`` /
``dump_profiler_summary`` on the workers through ``WorkerDispatch``. The attach hook
(``worker_ext.attach``) swaps that module's ``Profiler`` for ``SkyRLProfiler`` when the module
loads; nothing of SkyRL is edited or imported here.

- ``start()``: the worker attaches as a rank (``torch.distributed``'s rank and world, trainer id
  ``attach.trainer_id`` or ``skyrl``, plus its actor class) and its session starts at step 0;
- ``step()``: global step ``k`` (the ``k``-th ``profile_step`` call, from 0, as
  ``torch.profiler``'s own ``step()`` counts) has finished; the process's optimizer steps are
  counted too, and each closed window says its optimizer steps beside its global steps
  (``optimizer_steps`` in ``status()`` windows' roles and in ``kernel_summary()``);
- ``stop()``: the open window closes; rank 0 ends the run;
- ``get_kernel_summary()``: SkyRL's shape, ``{"window_count": int, "pairs": [(name, self_us),
  ...]}``, this rank's figures of the trainer's last closed window, from the coordinator's
  table (self device time on a GPU rank, self CPU time on a CPU rank).

The schedule, ranks, activities, ``save_path``, ``export_type`` and the capture flags are
SkyRL's config's; the rest (coordinator name, trainer id, run name, storage) the attach config's.
A fault switches this rank's profiling off, as SkyRL's own profiler does; training goes on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from coordinator.core.attach import CONFIG_ENV, Attach, identify, read_source
from coordinator.core.config import ProfilerConfig
from worker_ext.rank.process_place import actor_rank, dist_rank, process_where
from worker_ext.rank.rank_session import RankSession

log = logging.getLogger(__name__)
SKYRL_FIELDS = ("enable", "ranks", "save_path", "skip_first", "wait", "warmup", "active",
                "repeat", "activities", "record_shapes", "profile_memory", "with_stack",
                "with_flops", "with_modules", "export_type")  # fmt: skip
DUMP_TIMEOUT_S = 60.0
ALL_ROWS = 100_000
KEPT_STEPS = 100_000  # global steps whose optimizer step count is kept (a window's span)
optimizer_steps_to: Callable[[Callable[[Any], None]], None] | None = None
"""The attach hook's ``driven_elsewhere``, handed over when it swaps SkyRL's ``Profiler`` for
``SkyRLProfiler`` (never imported: the hook sits below trainers): a profiler built then has the
process's optimizer steps counted here, not attached."""


class SkyRLProfiler:
    """What ``build_profiler_from_policy_cfg`` returns under the attach hook's SkyRL switch."""

    def __init__(self, config: Any) -> None:
        self.enable = bool(getattr(config, "enable", False))
        self.prof = None  # (SkyRL's own attribute: no torch.profiler object here)
        self.session: RankSession | None = None
        self._config: ProfilerConfig | None = None
        self._done = 0  # profile_step calls so far
        self.optimizer_steps = 0  # this process's, counted by the attach hook
        self._after: dict[int, int] = {}  # global step -> optimizer steps done by its end
        if not self.enable:
            return
        if optimizer_steps_to is not None:  # (they attach nothing: counted)
            optimizer_steps_to(self._optimizer_step)
        try:
            self._config = merged_config(config, read_source(os.environ.get(CONFIG_ENV)))
        except ValueError as exc:
            self._off(f"config: {exc}")

    def check(self) -> bool:
        return self.enable and self.session is not None and self.session.enabled

    def start(self) -> None:
        """Before the training loop: attach this rank; its session starts at step 0."""
        cfg = self._config
        if not self.enable or cfg is None or self.session is not None:
            return
        base = cfg.attach.trainer_id or "skyrl"
        who = identify(Attach(trainer_id=base), dist_rank(), None, actor_rank())
        if isinstance(who, str):
            self._off(who)
            return
        a = cfg.attach
        info = {**process_where(), "source": who.source, "optimizer": "SkyRL global steps"}
        self.session = RankSession.attach(
            cfg, who.trainer_id, a.role, who.rank, who.world_size, a.name, a.namespace, info
        )
        self.session.closed_extra = self._closed_extra
        self.session.start(first_step=0)
        if self.session.disabled_reason is not None:
            self.enable = False

    def step(self) -> None:
        """One global step has finished (``profile_step``)."""
        if self.session is not None:
            self._after[self._done] = self.optimizer_steps
            if len(self._after) > KEPT_STEPS:
                del self._after[next(iter(self._after))]
            self.session.step(self._done)
            self._done += 1

    def _optimizer_step(self, optimizer: Any) -> None:
        self.optimizer_steps += 1

    def _closed_extra(self, closed: dict[str, Any]) -> dict[str, Any]:
        """The closed window's optimizer steps ``[first, last]`` (from 1), beside its global
        steps: what the windows and tables show of both."""
        steps = closed.get("steps")
        if not steps:
            return {}
        before = self._after.get(steps[0] - 1, 0 if steps[0] == 0 else None)
        end = self._after.get(steps[1])
        if before is None or end is None or end <= before:
            return {}
        return {"optimizer_steps": [before + 1, end]}

    def stop(self) -> None:
        """After the loop: the open window closes (partial); rank 0 ends the run."""
        if self.session is not None:
            self.session.stop()

    def get_kernel_summary(self) -> dict[str, Any] | None:
        """This rank's figures of the trainer's last closed window, in SkyRL's shape (waits,
        at most ``DUMP_TIMEOUT_S``, for its summary); None when not profiled."""
        s = self.session
        if not self.enable or s is None or s.coordinator is None or s.rank is None:
            return None
        import ray

        try:
            return rank_pairs(ray, s.coordinator, s.trainer_id, s.rank)
        except Exception as exc:  # never the training's problem
            log.warning("profiler: SkyRL summary of rank %s not read: %s", s.rank, exc)
            return None

    def _off(self, why: str) -> None:
        self.enable = False
        log.error("profiler: SkyRL's profiler is off on this rank (%s); training goes on", why)


def merged_config(skyrl_cfg: Any, attach_mapping: Any) -> ProfilerConfig:
    """The coordinator's config: the attach config's fields, SkyRL's over them."""
    values = dict(attach_mapping)
    for name in SKYRL_FIELDS:
        if hasattr(skyrl_cfg, name):
            value = getattr(skyrl_cfg, name)
            values[name] = list(value) if isinstance(value, (list, tuple)) else value
    return ProfilerConfig.from_dict(values)


def rank_pairs(ray: Any, coordinator: Any, trainer_id: str, rank: int) -> dict[str, Any]:
    """``{"window_count", "pairs"}`` of ``rank`` from the coordinator's last closed window of
    ``trainer_id``; waits for that rank's summary first."""
    status = ray.get(coordinator.status.remote(ranks="all"), timeout=DUMP_TIMEOUT_S)
    count = next(
        (r["windows_captured"] for r in status["ranks"]
         if r["trainer_id"] == trainer_id and r["rank"] == rank),
        0,
    )  # fmt: skip
    last = last_window_of(status["windows"], trainer_id)
    if last is None:
        return {"window_count": count, "pairs": []}
    ray.get(coordinator.wait_window.remote(last, timeout_s=DUMP_TIMEOUT_S),
            timeout=DUMP_TIMEOUT_S + 10)  # fmt: skip
    table = ray.get(coordinator.kernel_summary.remote(
        window=last, top_k=ALL_ROWS, trainer_id=trainer_id, per_rank=True))  # fmt: skip
    per_rank = table.get("per_rank") or {}
    pairs = [(name, float(by[rank])) for name, by in per_rank.items() if rank in by]
    return {"window_count": count, "pairs": pairs}


def last_window_of(windows: list[dict[str, Any]], trainer_id: str) -> int | None:
    """The index of the last of ``windows`` (``status()["windows"]``) that ``trainer_id`` took
    part in (another trainer's later window is not its own), or None."""
    own = [w["index"] for w in windows if trainer_id in (w.get("roles") or {})]
    return own[-1] if own else None
