"""Faults in an attached job: ``python -m tests.scripts.attach_faults MODE OUT NAME``.

``faults``: one actor steps two optimizers each step, steps the first from another thread once,
and forks a child that steps an optimizer; training goes on throughout. ``bad-config``: the
job's config does not parse; this driver made the coordinator (default name and namespace)
first, so the attached actor's error reaches ``status()``. Writes ``{OUT}/faults.json``: the
actor's losses, the child's exit status and ``status()``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import ray
import torch


@ray.remote
class TwoOptimizers:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.policy, self.critic = torch.nn.Linear(8, 1), torch.nn.Linear(8, 1)
        self.opt = torch.optim.Adam(self.policy.parameters(), lr=1e-3)
        self.critic_opt = torch.optim.SGD(self.critic.parameters(), lr=1e-2)

    def step(self, k: int) -> float:
        x = torch.randn(4, 8)
        loss = self.policy(x).pow(2).mean() + self.critic(x).pow(2).mean()
        self.opt.zero_grad()
        self.critic_opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.critic_opt.step()
        if k == 10:  # a stray step from another thread: never counted, never profiled
            t = threading.Thread(target=self.opt.step)
            t.start()
            t.join()
        return float(loss)

    def fork_and_step(self) -> int:
        pid = os.fork()
        if pid == 0:
            try:
                self.critic(torch.ones(1, 8)).sum().backward()
                self.critic_opt.step()
            finally:
                os._exit(0)
        return os.waitpid(pid, 0)[1]


def main() -> None:
    mode, out, name = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(out, exist_ok=True)
    env = {"PYTHONPATH": os.environ["PYTHONPATH"], "RAY_AUTH_MODE": "disabled",
           "RAY_PROFILER_CONFIG": os.environ["RAY_PROFILER_CONFIG"]}  # fmt: skip
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, runtime_env={
        "worker_process_setup_hook": "worker_ext.attach.setup", "env_vars": env})  # fmt: skip
    if mode == "bad-config":
        from coordinator.client.connect import get_or_create_coordinator

        get_or_create_coordinator({"enable": False}, name=name, namespace="profiler")
    actor = TwoOptimizers.remote()
    losses = [ray.get(actor.step.remote(k)) for k in range(16)]
    child = ray.get(actor.fork_and_step.remote()) if mode == "faults" else None
    losses.append(ray.get(actor.step.remote(16)))
    coord = ray.get_actor(name, namespace="profiler")
    time.sleep(1.0)  # (the problems are sent without waiting)
    if mode == "faults":
        st = ray.get(coord.status.remote())
        ray.get(coord.wait_window.remote(0, timeout_s=60))
    st = ray.get(coord.status.remote())
    with open(os.path.join(out, "faults.json"), "w") as f:
        json.dump({"losses": losses, "child": child, "status": st}, f, default=str)
    ray.kill(coord)
    print("FAULTS-DONE", flush=True)


if __name__ == "__main__":
    main()
