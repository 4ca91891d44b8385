"""``ProfilerCallback`` for Lightning: each rank attaches a ``RankSession`` when training starts
and reports every optimiser step as ``trainer.global_step``. An optional extra:
``pip install 'ray-profiler-coordinator[lightning]'``.

    trainer = lightning.Trainer(..., callbacks=[ProfilerCallback(profiler_config, "sft")])
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

from trainers.framework_steps import FrameworkSteps


class ProfilerCallback(Callback):
    """Profiles a Lightning ``Trainer`` run on every rank (see the module docstring).

    Args:
        config: the profiler config (``ProfilerConfig``, dict or OmegaConf node).
        trainer_id: the job's name for its ranks.
        role, name, namespace: as for ``RankSession.attach``.
    """

    def __init__(self, config: Any, trainer_id: str = "lightning", role: str = "policy",
                 name: str = "profiler", namespace: str = "profiler") -> None:  # fmt: skip
        self.steps = FrameworkSteps(config, trainer_id, role, name, namespace)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.steps.begin(int(trainer.global_step))

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        self.steps.step_begins()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.steps.step_ends(int(trainer.global_step))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.steps.end(finished=True)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.steps.end(finished=False)
