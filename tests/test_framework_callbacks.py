"""The Hugging Face and Lightning callbacks, each inside Ray Train (2 CPU workers, gloo) with a
tiny model built from a config: every rank profiled on the same global steps, one table."""

from __future__ import annotations

import uuid

import pytest

from tests.configs import profiler_config

pytestmark = pytest.mark.ray

STEPS = 10
# Steps are the frameworks' optimiser steps, from 1; cycle of 5: warm-up 2, record 3-4 | 8-9.
WINDOWS = [[3, 4], [8, 9]]


def _hf_loop(cfg: dict) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from trainers.hf_callback import ProfilerCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    )
    rows = torch.randint(0, 64, (64, 16))
    data = [{"input_ids": r, "labels": r} for r in rows]
    args = TrainingArguments(
        output_dir=cfg["out"], max_steps=STEPS, per_device_train_batch_size=2, report_to="none",
        use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    callback = ProfilerCallback(cfg["profiler"], trainer_id="hf", name=cfg["name"],
                                namespace="profiler-tests")  # fmt: skip
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()


def _lightning_loop(cfg: dict) -> None:
    import lightning.pytorch as pl
    import torch
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer

    from trainers.lightning_callback import ProfilerCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
            )

        def training_step(self, batch, idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
    callback = ProfilerCallback(cfg["profiler"], trainer_id="lightning", name=cfg["name"],
                                namespace="profiler-tests")  # fmt: skip
    trainer = pl.Trainer(
        max_steps=STEPS, accelerator="cpu", devices="auto", strategy=RayDDPStrategy(),
        plugins=[RayLightningEnvironment()], callbacks=[callback], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    prepare_trainer(trainer).fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))


@pytest.mark.parametrize("loop", ["hf", "lightning"])
def test_a_framework_callback_profiles_every_ray_train_worker(
    ray_session, ray_actors, tmp_path, loop
):
    pytest.importorskip("transformers" if loop == "hf" else "lightning")
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray = ray_session
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    profiler = profiler_config(tmp_path, wait=2, warmup=1, active=2, repeat=2).to_dict()
    cfg = {"profiler": profiler, "name": name, "out": str(tmp_path / "out")}
    trainer = TorchTrainer(
        _hf_loop if loop == "hf" else _lightning_loop,
        train_loop_config=cfg,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=str(tmp_path / "train"), name=loop),
    )
    try:
        trainer.fit()
    finally:
        ray_actors.append(ray.get_actor(name, namespace="profiler-tests"))
    coord = ray.get_actor(name, namespace="profiler-tests")
    for i in range(2):
        assert ray.get(coord.wait_window.remote(i, timeout_s=60))["done"]
    st = ray.get(coord.status.remote())
    assert st["global_step"] == STEPS and st["trainers"][0]["trainer_id"] == loop
    assert [w["steps"] for w in st["windows"]] == WINDOWS
    assert [w["ranks"] for w in st["windows"]] == [[0, 1], [0, 1]]
    table = ray.get(coord.kernel_summary.remote(window=1))
    assert table["ranks"] == [0, 1] and table["kernels"]
    phases = ray.get(coord.phase_times.remote(last=100))
    assert [s["step"] for s in phases["steps"]] == list(range(1, STEPS + 1))
    assert {r["region"] for r in phases["regions"]} == {"step"}
