"""Training jobs as their users wrote them: nothing of this project is imported or called here.
The attach tests run each one twice under Ray Train (or as a single controller), with and
without the setup hook in the job's ``runtime_env``, and compare the losses.

Each ``train_*`` is a Ray Train ``train_loop_per_worker``: tiny models built from a config, a
tokenizer trained on a few words (no hub), CPU, gloo. Rank 0 writes its losses, one per
optimizer step, to ``{out}/losses.json``. ``pace_s`` slows each step down, so an operator's
capture can land while the job runs.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

STEPS = 40
WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "and",
    "ran",
    "to",
    "the",
    "red",
    "hat",
    "while",
    "a",
    "dog",
    "ate",
    "one",
    "big",
    "bun",
]


def _write_losses(cfg: dict[str, Any], losses: list[float]) -> None:
    import ray.train

    if ray.train.get_context().get_world_rank() == 0:
        with open(os.path.join(cfg["out"], "losses.json"), "w") as f:
            json.dump(losses, f)


def train_hf(cfg: dict[str, Any]) -> None:
    """A Hugging Face ``Trainer`` SFT of a tiny GPT-2 on random token rows."""
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    class Pace(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            time.sleep(cfg["pace_s"])

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1,
                                       n_head=2))  # fmt: skip
    rows = torch.randint(0, 64, (256, 16))
    data = [{"input_ids": r, "labels": r} for r in rows]
    args = TrainingArguments(
        output_dir=cfg["out"], max_steps=STEPS, per_device_train_batch_size=2, report_to="none",
        use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True,
        gradient_accumulation_steps=2,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Pace()])
    trainer.train()
    _write_losses(cfg, [h["loss"] for h in trainer.state.log_history if "loss" in h])


def train_lightning(cfg: dict[str, Any]) -> None:
    """A Lightning ``Trainer`` with Ray Train's DDP strategy."""
    import lightning.pytorch as pl
    import torch
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer

    losses: list[float] = []

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
            )

        def training_step(self, batch: Any, idx: int) -> Any:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            losses.append(float(loss.detach()))
            time.sleep(cfg["pace_s"])
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    pl.seed_everything(0)
    data = torch.utils.data.TensorDataset(torch.randn(512, 16), torch.randn(512, 1))
    trainer = pl.Trainer(
        max_steps=STEPS, accelerator="cpu", devices="auto", strategy=RayDDPStrategy(),
        plugins=[RayLightningEnvironment()], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    prepare_trainer(trainer).fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    _write_losses(cfg, losses)


def tiny_tokenizer() -> Any:
    """A word-level tokenizer trained here on ``WORDS`` (no hub, no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainers.WordLevelTrainer(
        special_tokens=["[UNK]", "[PAD]", "[EOS]"]))  # fmt: skip
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                  eos_token="[EOS]", padding_side="left")  # fmt: skip
    return out


def train_trl(cfg: dict[str, Any]) -> None:
    """TRL's ``GRPOTrainer`` (an RL trainer, generation in the trainer: ``use_vllm=False``) on a
    tiny random Qwen2; the reward is the number of distinct words in a completion."""
    import torch
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class Pace(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            time.sleep(cfg["pace_s"])

    def distinct_words(completions: list[str], **kw: Any) -> list[float]:
        return [float(len(set(c.split()))) for c in completions]

    torch.manual_seed(0)
    tok = tiny_tokenizer()
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    ))  # fmt: skip
    prompts = [" ".join(WORDS[i : i + 3]) for i in range(12)]
    args = GRPOConfig(  # built here: it reads the world size when it is made
        output_dir=cfg["out"], max_steps=STEPS, per_device_train_batch_size=2,
        num_generations=2, max_completion_length=6, use_vllm=False, report_to="none",
        use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
        num_iterations=2,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=distinct_words, args=args,
                          train_dataset=Dataset.from_dict({"prompt": prompts}),
                          processing_class=tok, callbacks=[Pace()])  # fmt: skip
    trainer.train()
    _write_losses(cfg, [h["loss"] for h in trainer.state.log_history if "loss" in h])


def train_resume(cfg: dict[str, Any]) -> None:
    """A plain DDP loop with AdamW that saves a Ray Train checkpoint (model, optimizer, step)
    every 5 steps and resumes from the last one; on its first attempt rank 1 dies after step
    ``cfg["fail_at"]`` (the file ``cfg["marker"]`` says it did), so Ray Train restarts the
    group (``FailureConfig(max_failures=1)``)."""
    import tempfile

    import ray.train
    import torch
    from ray.train.torch import prepare_model

    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start, losses = 0, []
    found = ray.train.get_checkpoint()
    if found is not None:
        with found.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"))
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start, losses = state["step"], state["losses"]
    data = torch.Generator().manual_seed(rank)
    for step in range(start + 1, STEPS + 1):  # (step: the optimizer steps done, this one too)
        loss = model(torch.randn(8, 16, generator=data)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
        time.sleep(cfg["pace_s"])
        if step == cfg["fail_at"] and rank == 1 and not os.path.exists(cfg["marker"]):
            open(cfg["marker"], "w").close()
            os._exit(1)  # a worker lost: Ray Train restarts the group from its checkpoint
        if step % 5 == 0:
            with tempfile.TemporaryDirectory() as d:
                checkpoint = None
                if rank == 0:
                    state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                             "step": step, "losses": losses}  # fmt: skip
                    torch.save(state, os.path.join(d, "state.pt"))
                    checkpoint = ray.train.Checkpoint.from_directory(d)
                ray.train.report({"step": step}, checkpoint=checkpoint)
    _write_losses(cfg, losses)


TRAIN = {"hf": train_hf, "lightning": train_lightning, "trl": train_trl, "resume": train_resume}
