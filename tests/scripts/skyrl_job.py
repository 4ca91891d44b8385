"""SkyRL's own profiler path, driven as SkyRL drives it, nothing of SkyRL edited:
``python -m tests.scripts.skyrl_job OUT [--hook NAME]``.

Two policy actors (a gloo process group of 2) each build their profiler with SkyRL's
``build_profiler_from_policy_cfg`` from SkyRL's ``TorchProfilerConfig``, and answer SkyRL's
``Worker`` profiler methods (taken from its class, run on the actor as ``self``). The loop runs
``RayPPOTrainer``'s ``_profiler_start`` / ``_profiler_step`` / ``_profiler_stop`` through
``WorkerDispatch``'s methods, on stand-ins for ``self`` as SkyRL's own tests call them; each
global step runs two optimizer steps on each actor. Then ``WorkerDispatch.dump_profiler_summary``.
With ``--hook NAME``, the job's ``runtime_env`` names the setup hook with
``attach: {skyrl: true, name: NAME}``. Writes ``{OUT}/skyrl.json``: rank 0's losses, the dumped
summaries, and (with the hook) the coordinator's status and its last window's table.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace
from typing import Any

import ray

STEPS = 8
SKYRL = {"enable": True, "ranks": [0, 1], "skip_first": 2, "wait": 0, "warmup": 1, "active": 2,
         "repeat": 1, "activities": ["cpu"], "record_shapes": False, "with_stack": False,
         "export_type": "chrome_trace"}  # fmt: skip


def skyrl_importable() -> None:
    """skyrl 0.3.0 on Python 3.11: pydantic refuses ``typing.TypedDict`` in
    ``skyrl/tinker/types.py``; the test environment aliases it (never the project's code)."""
    import typing

    import typing_extensions

    typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]


@ray.remote
class PolicyStandIn:
    """A SkyRL policy worker's profiler part: SkyRL's own calls on this actor as ``self``."""

    def __init__(self, rank: int, store: str, save_path: str) -> None:
        skyrl_importable()
        import torch
        import torch.distributed as dist
        from skyrl.backends.skyrl_train.utils.profiler import build_profiler_from_policy_cfg
        from skyrl.train.config.config import TorchProfilerConfig

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        cfg = TorchProfilerConfig(**SKYRL, save_path=save_path)
        self.profiler = build_profiler_from_policy_cfg(
            SimpleNamespace(policy=SimpleNamespace(torch_profiler_config=cfg))
        )
        torch.manual_seed(rank)
        self.model = torch.nn.Linear(16, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def pass_through(self, method: str) -> Any:
        from skyrl.backends.skyrl_train.workers.worker import Worker

        return getattr(Worker, method)(self)

    def profiler_class(self) -> str:
        return type(self.profiler).__module__ + "." + type(self.profiler).__name__

    def train(self) -> list[float]:
        import torch

        losses = []
        for _ in range(2):
            loss = self.model(torch.ones(8, 16)).pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            losses.append(float(loss.detach()))
        return losses


class ActorGroup:
    """``PPORayActorGroup``'s ``async_run_ray_method("pass_through", ...)``: every actor."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors

    def async_run_ray_method(self, how: str, method: str, *args: Any, **kw: Any) -> list[Any]:
        assert how == "pass_through"
        return [a.pass_through.remote(method) for a in self.actors]


def main() -> None:
    out, hook = sys.argv[1], sys.argv[2:4] if "--hook" in sys.argv else None
    os.makedirs(out, exist_ok=True)
    env = {"PYTHONPATH": os.environ["PYTHONPATH"], "RAY_AUTH_MODE": "disabled"}
    runtime_env: dict[str, Any] = {"env_vars": env}
    if hook:
        runtime_env["worker_process_setup_hook"] = "worker_ext.attach.setup"
        env["RAY_PROFILER_CONFIG"] = f"{{enable: true, attach: {{skyrl: true, name: {hook[1]}}}}}"
    ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env, log_to_driver=False)
    skyrl_importable()
    from skyrl.backends.skyrl_train.workers.worker_dispatch import WorkerDispatch
    from skyrl.train.trainer import RayPPOTrainer

    actors = [PolicyStandIn.remote(r, os.path.join(out, "store"), os.path.join(out, "traces"))
              for r in range(2)]  # fmt: skip
    dispatch = SimpleNamespace(_actor_groups={"policy": ActorGroup(actors)})
    cfg = SimpleNamespace(trainer=SimpleNamespace(policy=SimpleNamespace(
        torch_profiler_config=SimpleNamespace(enable=True))))  # fmt: skip
    calls = ("start_profile", "profile_step", "stop_profile", "dump_profiler_summary")
    bound = {m: getattr(WorkerDispatch, m).__get__(dispatch) for m in calls}
    trainer = SimpleNamespace(cfg=cfg, dispatch=SimpleNamespace(**bound))
    trainer._torch_profiler_enabled = RayPPOTrainer._torch_profiler_enabled.fget(trainer)
    losses: list[float] = []
    RayPPOTrainer._profiler_start(trainer)
    for _ in range(STEPS):
        losses += ray.get([a.train.remote() for a in actors])[0]
        RayPPOTrainer._profiler_step(trainer)
    RayPPOTrainer._profiler_stop(trainer)
    summaries = WorkerDispatch.dump_profiler_summary(dispatch, "policy")
    report: dict[str, Any] = {"losses": losses, "summaries": summaries,
                              "profiler": ray.get(actors[0].profiler_class.remote())}  # fmt: skip
    if hook:
        coord = ray.get_actor(hook[1], namespace="profiler")
        report["status"] = ray.get(coord.status.remote())
        report["table"] = ray.get(coord.kernel_summary.remote(top_k=5))
        ray.kill(coord)
    with open(os.path.join(out, "skyrl.json"), "w") as f:
        json.dump(report, f, default=str)
    print("SKYRL-DONE", flush=True)


if __name__ == "__main__":
    main()
