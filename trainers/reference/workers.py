"""Ray actors of the reference trainers: data-parallel policy ranks and rollout generators."""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from trainers.reference.model import CausalLM, ModelConfig, sft_corpus, vowel_reward
from worker_ext import ProfilerWorkerMixin

PROMPT_LEN = 8


class PolicyWorker(ProfilerWorkerMixin):
    """One data-parallel rank: its shard of each batch, gradients averaged over a gloo group."""

    def __init__(self, rank: int, world_size: int, seed: int = 0, lr: float = 1e-2) -> None:
        torch.set_num_threads(1)
        self.rank, self.world_size = rank, world_size
        self.cfg = ModelConfig()
        self.reset(seed, lr)

    def reset(self, seed: int, lr: float = 1e-2) -> None:
        """Fresh weights and optimiser from ``seed`` (identical on every rank)."""
        torch.manual_seed(seed)
        self.model = CausalLM(self.cfg)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port, for rank 0 to host the process group."""
        return free_address()

    def init_group(self, host: str, port: int) -> int:
        """Join the gloo group (every rank must call this at once)."""
        if not dist.is_initialized():
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://{host}:{port}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=120),
            )
        return dist.get_rank()

    def sft_step(self, rows: torch.Tensor) -> float:
        """Next-byte loss on this rank's shard; returns the shard's mean loss."""
        shard = rows[self.rank :: self.world_size]
        logits = self.model(shard[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shard[:, 1:].reshape(-1))
        self._update(loss)
        return float(loss.detach())

    def rl_step(self, rows: torch.Tensor, advantages: torch.Tensor) -> float:
        """Policy-gradient step on sampled completions (GRPO-style advantages)."""
        shard = rows[self.rank :: self.world_size]
        adv = advantages[self.rank :: self.world_size]
        logits = self.model(shard[:, :-1])
        logp = torch.log_softmax(logits, dim=-1)
        taken = logp.gather(-1, shard[:, 1:].unsqueeze(-1)).squeeze(-1)
        completion_logp = taken[:, PROMPT_LEN - 1 :].sum(dim=1)
        loss = -(adv * completion_logp).mean()
        self._update(loss)
        return float(loss.detach())

    def get_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def _update(self, loss: torch.Tensor) -> None:
        update(self.model, self.opt, loss, self.world_size)


def free_address() -> tuple[str, int]:
    """This node's IP and a free port, for rank 0 to host a gloo process group."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def update(
    model: torch.nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor, world: int
) -> None:
    """One optimiser step on ``loss``, the gradients averaged over the ``world`` ranks of the
    process group (one all-reduce of them all, flattened)."""
    opt.zero_grad(set_to_none=False)
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    if world > 1:
        dist.all_reduce(flat)
        flat /= world
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n
    opt.step()


class Sampler:
    """Samples completions from a snapshot of the policy and scores them."""

    def __init__(self, worker_id: int) -> None:
        torch.set_num_threads(1)
        self.worker_id = worker_id
        self.model = CausalLM(ModelConfig())
        self.version = -1
        self.corpus = sft_corpus()

    def set_weights(self, weights: dict[str, Any], version: int) -> int:
        self.model.load_state_dict(weights)
        self.version = version
        return version

    def generate(
        self, request_id: int, prompts: int, group: int, new_tokens: int, seed: int
    ) -> dict[str, Any]:
        """``prompts`` prompts x ``group`` samples each; a pure function of weights and seed."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + request_id * 7919 + self.worker_id)
        starts = torch.randint(0, len(self.corpus) - PROMPT_LEN, (prompts,), generator=gen)
        rows = torch.tensor(
            [list(self.corpus[s : s + PROMPT_LEN]) for s in starts.tolist()], dtype=torch.long
        ).repeat_interleave(group, dim=0)
        out = self.model.sample(rows, new_tokens, gen)
        rewards = vowel_reward(out[:, PROMPT_LEN:])
        return {
            "rows": out,
            "rewards": rewards,
            "group": group,
            "version": self.version,
            "request_id": request_id,
            "worker_id": self.worker_id,
        }


class RolloutWorker(Sampler, ProfilerWorkerMixin):
    """A generation worker that is a profilable rank of role ``rollout``: its profiler calls run
    between generation requests, on its own thread (a plain, one-thread Ray actor)."""


def grpo_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """Reward minus its group's mean, over the group's standard deviation."""
    r = rewards.view(-1, group)
    return ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-6)).view(-1)


def make_policy_group(
    n_ranks: int,
    seed: int = 0,
    spread: bool = False,
    worker_cls: type = PolicyWorker,
    runtime_env: dict[str, Any] | None = None,
) -> list[Any]:
    """``n_ranks`` PolicyWorker actors (or of a subclass, ``worker_cls``) forming one gloo
    group; with ``spread``, dealt over the cluster's live nodes in turn, the driver's first
    (rank r on node r mod nodes). Ray's own ``SPREAD`` does not spread actors that ask for no
    resources, as these do. ``runtime_env``: the actors' own (``engine: kineto``:
    ``{"env_vars": worker_ext.kineto_env()}``)."""
    cls = ray.remote(**_actor_options(runtime_env))(worker_cls)
    nodes = _nodes_in_turn() if spread else []
    workers = [
        cls.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[r % len(nodes)], soft=False)
        ).remote(r, n_ranks, seed)
        if nodes
        else cls.remote(r, n_ranks, seed)
        for r in range(n_ranks)
    ]
    host, port = ray.get(workers[0].address.remote())
    ray.get([w.init_group.remote(host, port) for w in workers])
    return workers


def _nodes_in_turn() -> list[str]:
    here = ray.get_runtime_context().get_node_id()
    alive = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)
    return [here, *alive]


def make_rollouts(n: int, runtime_env: dict[str, Any] | None = None) -> list[Any]:
    """``n`` generation workers; ``runtime_env`` as ``make_policy_group``'s."""
    cls = ray.remote(**_actor_options(runtime_env))(RolloutWorker)
    return [cls.remote(i) for i in range(n)]


def _actor_options(runtime_env: dict[str, Any] | None) -> dict[str, Any]:
    """No CPU asked for (the ranks share the node's); the ``runtime_env`` where one is given."""
    return {"num_cpus": 0} if runtime_env is None else {"num_cpus": 0, "runtime_env": runtime_env}
