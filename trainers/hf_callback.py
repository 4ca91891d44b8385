"""``ProfilerCallback`` for Hugging Face ``transformers.Trainer``: each rank (under Ray Train, or
any launcher) attaches a ``RankSession`` when training begins and reports every optimiser step
as ``state.global_step``. An optional extra: ``pip install 'ray-profiler-coordinator[hf]'``.

    trainer = Trainer(model, args, train_dataset=data,
                      callbacks=[ProfilerCallback(profiler_config, trainer_id="sft")])
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from trainers.framework_steps import FrameworkSteps


class ProfilerCallback(TrainerCallback):
    """Profiles a ``transformers.Trainer`` run on every rank (see the module docstring).

    Args:
        config: the profiler config (``ProfilerConfig``, dict or OmegaConf node).
        trainer_id: the job's name for its ranks.
        role, name, namespace: as for ``RankSession.attach``.
    """

    def __init__(self, config: Any, trainer_id: str = "hf", role: str = "policy",
                 name: str = "profiler", namespace: str = "profiler") -> None:  # fmt: skip
        self.steps = FrameworkSteps(config, trainer_id, role, name, namespace)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.begin(int(state.global_step))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.step_begins()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.step_ends(int(state.global_step))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.end(finished=True)
