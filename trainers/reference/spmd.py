"""The reference SPMD trainer: every rank runs the same SFT loop and steps itself through
``RankSession``, as under Ray Train's ``TorchTrainer`` or torchrun-style code in plain actors.

Each rank builds the same model from the seed, takes its shard of each batch and averages the
gradients over ``torch.distributed`` (gloo) when there is more than one rank, so the losses are
the same whether profiling is on or off.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainers.reference.model import CausalLM, ModelConfig, sft_batch, sft_corpus
from trainers.reference.workers import free_address, update
from worker_ext.rank.rank_session import RankSession


@dataclass(frozen=True)
class SpmdRun:
    """One SPMD run's loop settings (the same on every rank)."""

    steps: int = 12
    first_step: int = 0
    batch: int = 8
    seed: int = 0
    lr: float = 1e-2
    trainer_id: str = "sft"
    lag_s: float = 0.0  # extra seconds per step on every rank but 0: ranks run steps apart
    sync: bool = True  # average gradients over the ranks (False: each rank trains alone)
    pace_s: float = 0.0  # seconds each step sleeps on every rank (a slower loop, for tests)
    slow_from: int | None = None  # from this step on, every rank sleeps ``slow_s`` more a step
    slow_s: float = 0.0
    checkpoint_every: int = 0  # Ray Train: a checkpoint after every this many steps (0: at the end)
    fail_at: int | None = None  # Ray Train: rank 1 exits after this step, once (``fail_marker``)
    fail_marker: str | None = None  # a file that says the failure happened
    name: str = "profiler"  # the coordinator's
    namespace: str = "profiler"


@dataclass
class LoopState:
    """Where a loop resumes: the last step done, the model's and the optimiser's state, and
    the losses so far (from a checkpoint)."""

    step: int
    model: dict[str, Any]
    opt: dict[str, Any]
    losses: list[float]


def sft_loop(
    profiler: dict[str, Any] | None,
    run: SpmdRun,
    rank: int | None = None,
    world: int | None = None,
    resume: LoopState | None = None,
    after_step: Callable[[LoopState], None] | None = None,
) -> list[float]:
    """This rank's loop, from ``resume`` if given; returns the (all-reduced) loss of every step
    (the resumed ones included). ``after_step`` sees each step's state (checkpoints)."""
    torch.set_num_threads(1)
    prof = RankSession.attach(
        profiler,
        trainer_id=run.trainer_id,
        rank=rank,
        world_size=world,
        name=run.name,
        namespace=run.namespace,
    )
    me, size = _rank_and_world(rank, world)
    torch.manual_seed(run.seed)
    cfg = ModelConfig()
    model = CausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr)
    first, losses = run.first_step, []
    if resume is not None:
        model.load_state_dict(resume.model)
        opt.load_state_dict(resume.opt)
        first, losses = resume.step + 1, list(resume.losses)
    corpus = sft_corpus()
    with prof.session(first_step=first):  # the absolute step: windows land where they would
        for step in range(first, run.first_step + run.steps):
            with prof.region("train"):
                rows = sft_batch(corpus, step, run.batch, cfg.seq_len, run.seed)
                losses.append(_train_step(model, opt, rows, me, size if run.sync else 1))
            if run.lag_s and me:
                time.sleep(run.lag_s)
            if run.pace_s:
                time.sleep(run.pace_s)
            if run.slow_from is not None and step >= run.slow_from:
                time.sleep(run.slow_s)
            prof.step(step)
            if after_step is not None:
                after_step(LoopState(step, model.state_dict(), opt.state_dict(), losses))
    return losses


def _rank_and_world(rank: int | None, world: int | None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return rank or 0, world or 1


def _train_step(
    model: CausalLM, opt: torch.optim.Optimizer, rows: torch.Tensor, rank: int, world: int
) -> float:
    shard = rows[rank::world]
    logits = model(shard[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shard[:, 1:].reshape(-1))
    value = loss.detach().reshape(1).clone()
    if world > 1:  # (every rank reports the mean loss)
        dist.all_reduce(value)
        value /= world
    update(model, opt, loss, world)
    return float(value)


@ray.remote
class SpmdWorker:
    """A plain actor running the SPMD loop itself, torchrun-style (no mixin: nobody calls it)."""

    def address(self) -> tuple[str, int]:
        return free_address()

    def run(
        self,
        profiler: dict[str, Any] | None,
        run: SpmdRun,
        rank: int,
        world: int,
        host: str,
        port: int,
    ) -> list[float]:
        if world > 1 and not dist.is_initialized():
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://{host}:{port}",
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=120),
            )
        return sft_loop(profiler, run, rank, world)


def run_in_actors(
    profiler: dict[str, Any] | None, run: SpmdRun, world: int, workers: list[Any] | None = None
) -> list[list[float]]:
    """The loop on ``world`` plain actors (``workers``: reuse these); each rank's losses."""
    workers = workers or [SpmdWorker.remote() for _ in range(world)]
    host, port = ray.get(workers[0].address.remote())
    refs = [w.run.remote(profiler, run, r, world, host, port) for r, w in enumerate(workers)]
    return ray.get(refs)


def ray_train_loop(config: dict[str, Any]) -> None:
    """``train_loop_per_worker`` for Ray Train's ``TorchTrainer``: resumes from Ray Train's
    checkpoint, reports one every ``checkpoint_every`` steps and at the end (rank 0's holds the
    state; ``result.metrics["losses"]``), and fails once where ``fail_at`` says."""
    from ray import train

    run = SpmdRun(**config["run"])
    found = train.get_checkpoint()
    resume = None
    if found is not None:
        with found.as_directory() as d:
            resume = torch.load(os.path.join(d, "state.pt"), weights_only=False)
    last = run.first_step + run.steps - 1

    def after_step(state: LoopState) -> None:
        rank = train.get_context().get_world_rank()
        marker = run.fail_marker
        if state.step == run.fail_at and rank == 1 and marker and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)  # a worker lost mid-run: Ray Train restarts the group
        every = run.checkpoint_every
        if state.step == last or (every and (state.step + 1 - run.first_step) % every == 0):
            with tempfile.TemporaryDirectory() as d:
                checkpoint = None
                if rank == 0:
                    torch.save(state, os.path.join(d, "state.pt"))
                    checkpoint = train.Checkpoint.from_directory(d)
                train.report({"losses": state.losses, "step": state.step}, checkpoint=checkpoint)

    sft_loop(config.get("profiler"), run, resume=resume, after_step=after_step)


def run_ray_train(
    profiler: dict[str, Any] | None, run: SpmdRun, workers: int, storage_path: str
) -> list[float]:
    """The loop under Ray Train (``TorchTrainer``, CPU, gloo); rank 0's losses."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        ray_train_loop,
        train_loop_config={"profiler": profiler, "run": asdict(run)},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
        run_config=RunConfig(
            storage_path=storage_path,
            name=f"{run.trainer_id}-train",
            failure_config=FailureConfig(max_failures=1 if run.fail_at is not None else 0),
        ),
    )
    result = trainer.fit()
    return list(result.metrics["losses"])
