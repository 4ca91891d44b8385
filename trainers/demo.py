"""The main job: a reference trainer on Ray policy workers, profiled by the coordinator.

    python -m trainers.demo                      # fully-async RL, 2 ranks, embedded Ray
    python -m trainers.demo --trainer sft --steps 20 --wait 5 --active 3
    python -m trainers.demo --config profiler.yaml --address HOST:PORT
    python -m trainers.demo --trainer ray-train  # SPMD: a Ray Train TorchTrainer, every rank
                                                 # stepping itself (RankSession)
    python -m trainers.demo --attach             # a job that imports nothing of ours, profiled
                                                 # through the runtime_env's setup hook alone

With ``--address`` it joins a running cluster and leaves the coordinator alive afterwards, so a
notebook can read it (``ray.get_actor("profiler", namespace="profiler")``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

import yaml

from coordinator.client.connect import address_problem
from coordinator.core.config import ProfilerConfig

TRAINERS = ("sft", "rl", "async", "fully-async", "ray-train")
NODES_WAIT_S = 60.0
SCHEDULE_FLAGS = ("skip_first", "wait", "warmup", "active", "repeat")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m trainers.demo", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--trainer", choices=TRAINERS, default="fully-async")
    ap.add_argument("--ranks", type=int, default=2, help="policy ranks (default 2)")
    ap.add_argument("--steps", type=int, default=16, help="global steps (default 16)")
    ap.add_argument("--first-step", type=int, default=0, help="resume at this step")
    ap.add_argument("--rollouts", type=int, default=2, help="generation workers (RL trainers)")
    ap.add_argument("--config", help="a YAML file of ProfilerConfig fields")
    ap.add_argument("--save-path", help="trace directory (default ./profiles)")
    ap.add_argument("--run-name")
    ap.add_argument("--ranks-to-profile", default=None, help="'all' or a comma list (default all)")
    for flag in SCHEDULE_FLAGS:
        ap.add_argument("--" + flag.replace("_", "-"), type=int, dest=flag)
    ap.add_argument("--export-type", choices=["chrome_trace", "chrome_trace_gz", "stacks", "none"])
    ap.add_argument("--top-k", type=int, default=10, help="rows in the printed kernel table")
    ap.add_argument("--no-profile", action="store_true", help="run with profiling disabled")
    ap.add_argument("--address", help="join this Ray cluster instead of starting one")
    ap.add_argument(
        "--attach", action="store_true",
        help="run a job that imports nothing of ours (trainers.reference.unchanged), profiled "
        "only through runtime_env's worker_process_setup_hook; steps are optimizer steps",
    )  # fmt: skip
    ap.add_argument("--namespace", default="profiler")
    ap.add_argument(
        "--spread", action="store_true", help="policy ranks dealt over the nodes in turn"
    )
    ap.add_argument(
        "--min-nodes",
        type=int,
        default=1,
        help=f"wait up to {NODES_WAIT_S:.0f} s for this many live Ray nodes (default 1)",
    )
    return ap.parse_args(argv)


def build_config(args: argparse.Namespace) -> ProfilerConfig:
    """Defaults for the demo, then the YAML file, then explicit flags."""
    values: dict[str, Any] = {
        "enable": True,
        "ranks": "all",
        "save_path": os.path.abspath("profiles"),
        "skip_first": 2,
        "wait": 2,
        "warmup": 1,
        "active": 2,
        "repeat": 2,
        "activities": ["cpu", "cuda"],
        "export_type": "chrome_trace_gz",
        "roles": {"rollout": {"ranks": [0]}},  # generation worker 0, on the same steps
    }
    if args.config:
        with open(args.config) as f:
            loaded = yaml.safe_load(f)
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{args.config}: expected a mapping of ProfilerConfig fields")
        values.update(loaded or {})
    for flag in SCHEDULE_FLAGS:
        if getattr(args, flag) is not None:
            values[flag] = getattr(args, flag)
    if args.save_path:
        values["save_path"] = os.path.abspath(args.save_path)
    if args.run_name:
        values["run_name"] = args.run_name
    if args.export_type:
        values["export_type"] = args.export_type
    if args.ranks_to_profile:
        r = args.ranks_to_profile
        values["ranks"] = "all" if r == "all" else [int(x) for x in r.split(",")]
    if args.no_profile:
        values["enable"] = False
    return ProfilerConfig.from_dict(values)


def connect_ray(
    address: str | None, namespace: str, hook_config: str | None = None, kineto: bool = False
) -> None:
    """Start or join Ray; ``hook_config``: the job's ``runtime_env`` names the setup hook with
    this config (the YAML text), as a user attaching to an unchanged job would. ``kineto``:
    every worker of the job starts in libkineto's daemon mode (``kineto_env()``; its setup hook
    is the job's), for workers the demo does not start itself (Ray Train's)."""
    import ray

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env: dict[str, Any] = {"env_vars": {"PYTHONPATH": root}}
    if hook_config is not None:
        env["worker_process_setup_hook"] = "worker_ext.attach.setup"
        env["env_vars"]["RAY_PROFILER_CONFIG"] = hook_config
    elif kineto:
        from worker_ext.agent.kineto_ipc import KINETO_SETUP_HOOK, kineto_env

        env["env_vars"].update(kineto_env(setup_hook=False))
        env["worker_process_setup_hook"] = KINETO_SETUP_HOOK
    if address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(
            address="local",  # its own cluster, even where a `ray start` one is running
            num_cpus=8,
            include_dashboard=False,
            log_to_driver=False,
            namespace=namespace,
            runtime_env=env,
        )
        return
    problem = address_problem(address)
    if problem:
        raise SystemExit(f"error: {problem}")
    ray.init(address=address, namespace=namespace, log_to_driver=False, runtime_env=env)


def uses_kineto(cfg: ProfilerConfig) -> bool:
    """The config profiles with ``engine: kineto``: the ranks need libkineto's daemon mode."""
    return cfg.enable and cfg.engine == "kineto"


def worker_env(cfg: ProfilerConfig) -> dict[str, Any] | None:
    """The policy and generation workers' own ``runtime_env``: for ``engine: kineto``,
    ``kineto_env()``'s variables (libkineto's daemon mode, set before torch is imported, and
    the daemon directory made on each rank's node); else None."""
    if not uses_kineto(cfg):
        return None
    from worker_ext import kineto_env

    return {"env_vars": kineto_env()}


def wait_for_nodes(n: int, timeout_s: float = NODES_WAIT_S) -> None:
    """Return once ``n`` Ray nodes are alive; SystemExit saying how many are, after
    ``timeout_s``."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        alive = sum(1 for node in ray.nodes() if node["Alive"])
        if alive >= n:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"error: {alive} live Ray node(s) after {timeout_s:.0f} s, not {n}")
        time.sleep(0.5)


def print_step(step: int, metric: str, value: float, seconds: float, phase: str) -> None:
    print(f"step {step:4d}  {metric} {value:8.4f}  {seconds * 1e3:8.1f} ms  profiler: {phase}")


def run(args: argparse.Namespace) -> int:
    import ray

    from trainers.hooks import ProfilingHooks
    from trainers.reference.loops import (
        RunConfig,
        run_fully_async_rl,
        run_one_step_async_rl,
        run_sft,
        run_sync_rl,
    )
    from trainers.reference.workers import make_policy_group, make_rollouts

    cfg = build_config(args)
    if args.attach:
        return run_attached(args, cfg)
    spmd = args.trainer == "ray-train"
    connect_ray(args.address, args.namespace, kineto=spmd and uses_kineto(cfg))
    wait_for_nodes(args.min_nodes)
    if spmd:
        return run_spmd(args, cfg)
    t_start = time.perf_counter()
    env = worker_env(cfg)
    policy = make_policy_group(args.ranks, spread=args.spread, runtime_env=env)
    rollouts = make_rollouts(args.rollouts, env) if args.trainer != "sft" else []
    hooks = ProfilingHooks.attach(cfg, policy, trainer_id=args.trainer, namespace=args.namespace)
    rc = RunConfig(steps=args.steps, first_step=args.first_step)
    print(
        f"{args.trainer} trainer, {args.ranks} policy ranks, {args.steps} steps; "
        f"profiling {'on' if hooks.enabled else 'off'}"
    )
    if args.trainer == "sft":
        result = run_sft(hooks, policy, rc, print_step)
    elif args.trainer == "rl":
        result = run_sync_rl(hooks, policy, rollouts[0], rc, print_step)
    elif args.trainer == "async":
        result = asyncio.run(run_one_step_async_rl(hooks, policy, rollouts[0], rc, print_step))
    else:
        result = asyncio.run(run_fully_async_rl(hooks, policy, rollouts, rc, print_step))
    n = len(result.values)
    half = max(1, n // 2)
    print(
        f"{result.metric}: first half {sum(result.values[:half]) / half:.4f}, "
        f"second half {sum(result.values[half:]) / max(1, n - half):.4f}; "
        f"wall {time.perf_counter() - t_start:.1f} s"
    )
    if hooks.coordinator is not None:
        report(hooks.coordinator, args.top_k)
        if args.address is None:
            ray.kill(hooks.coordinator)
        else:
            print(
                f"coordinator left running: ray.get_actor('profiler', namespace={args.namespace!r})"
            )
    elif hooks.disabled_reason and cfg.enable:
        print(f"profiling was switched off: {hooks.disabled_reason}")
    ray.shutdown()
    return 0


def run_spmd(args: argparse.Namespace, cfg: ProfilerConfig) -> int:
    """``--trainer ray-train``: the SPMD SFT loop under Ray Train's ``TorchTrainer`` (CPU,
    gloo), each worker profiled through its own ``RankSession``."""
    import ray

    from trainers.reference.spmd import SpmdRun, run_ray_train

    t_start = time.perf_counter()
    spmd = SpmdRun(
        steps=args.steps, first_step=args.first_step, trainer_id="ray-train",
        namespace=args.namespace,
    )  # fmt: skip
    print(
        f"ray-train trainer (TorchTrainer, SPMD), {args.ranks} workers, {args.steps} steps; "
        f"profiling {'on' if cfg.enable else 'off'}"
    )
    storage = os.path.join(cfg.save_path or os.path.abspath("profiles"), "ray-train-storage")
    losses = run_ray_train(cfg.to_dict(), spmd, args.ranks, storage)
    for k, loss in enumerate(losses, start=args.first_step):
        print(f"step {k:4d}  loss {loss:8.4f}")
    half = max(1, len(losses) // 2)
    print(
        f"loss: first half {sum(losses[:half]) / half:.4f}, second half "
        f"{sum(losses[half:]) / max(1, len(losses) - half):.4f}; "
        f"wall {time.perf_counter() - t_start:.1f} s"
    )
    if cfg.enable:
        coordinator = ray.get_actor("profiler", namespace=args.namespace)
        report(coordinator, args.top_k)
        if args.address is None:
            ray.kill(coordinator)
    ray.shutdown()
    return 0


def run_attached(args: argparse.Namespace, cfg: ProfilerConfig) -> int:
    """``--attach``: ``trainers.reference.unchanged`` (policy actors called by this driver, two
    optimizer steps per global step), which imports nothing of ours; only the job's
    ``runtime_env`` names the setup hook. Windows are counted in each rank's optimizer steps."""
    import ray

    from trainers.reference.unchanged import single_controller

    values = cfg.to_dict()
    values["attach"] = {**values["attach"], "namespace": args.namespace}
    values["roles"] = {}  # (one role: the policy actors)
    connect_ray(args.address, args.namespace, yaml.safe_dump(values))
    t_start = time.perf_counter()
    print(
        f"an unchanged job: {args.ranks} policy actors, {args.steps} global steps of 2 optimizer "
        f"steps each; profiled through the setup hook: {'on' if cfg.enable else 'off'}"
    )
    losses = single_controller(
        args.steps, ranks=args.ranks,
        on_step=lambda k, loss, s: print_step(k, "loss", loss, s, "(optimizer steps)"),
    )  # fmt: skip
    print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f}; "
          f"wall {time.perf_counter() - t_start:.1f} s")  # fmt: skip
    if cfg.enable:
        try:
            coordinator = ray.get_actor(cfg.attach.name, namespace=args.namespace)
        except ValueError:
            print("no coordinator: no process attached (see the workers' logs)")
            return 1
        wait_for_step(coordinator, len(losses))  # (rank 0's losses: one an optimizer step)
        if args.address is None:
            end_with_this_job(coordinator)
        report(coordinator, args.top_k)
        if args.address is None:
            ray.kill(coordinator)
    ray.shutdown()
    return 0


def wait_for_step(coordinator: Any, step: int, timeout_s: float = 30.0) -> None:
    """Until the run has reached ``step``: an attached job's last steps come from rank 0's node
    agent once its process is gone (within a second or so), or ``timeout_s`` runs out."""
    import ray

    deadline = time.monotonic() + timeout_s
    while (ray.get(coordinator.status.remote())["global_step"] or 0) < step:
        if time.monotonic() > deadline:
            print(f"the run has not reached optimizer step {step} after {timeout_s:.0f} s")
            return
        time.sleep(0.2)


def end_with_this_job(coordinator: Any) -> None:
    """The job is this driver, and its cluster ends with it: no coordinator is left to see the
    job's end (``rank_exits``), so the run ends here, before the record is flushed. (On a
    cluster that outlives the driver, ``--address``, the coordinator ends it with the job.)"""
    import ray

    trainer = ray.get(coordinator.status.remote())["run"]["stepping_trainer"]
    if trainer is not None:
        ray.get(coordinator.stop.remote(trainer))


def report(coordinator: Any, top_k: int) -> None:
    """Once the traces are finished: the status, the top kernels and the phase times."""
    import ray

    from coordinator.client.step_client import wait_for_traces
    from coordinator.ops.tables import render_phases

    late = wait_for_traces(coordinator, timeout_s=60)
    if late:
        print(f"windows {late}: traces still being finished by the node agent")
    status = ray.get(coordinator.status.remote())
    print_status(status)
    for t in status["trainers"]:  # each role's own table: its ops never mix into another's
        ks = ray.get(coordinator.kernel_summary.remote(top_k=top_k, trainer_id=t["trainer_id"]))
        if ks["ranks"]:
            print_kernels(ks)
    print(f"\ntraces: {status['run_dir']} (window_.../<role>/rank<r>...)")
    print("\n== phase times (hooks.region), every step ==")
    print(render_phases(ray.get(coordinator.phase_times.remote(last=1000))))
    record = ray.get(coordinator.flush_record.remote(30.0))  # before this cluster goes
    if record["dir"]:
        kept = "" if record["pending"] == 0 else f"; NOT all written: {record['error']}"
        print(f"\nrecord: {record['dir']} (after the cluster: ray-profiler status --from "
              f"{record['dir']}){kept}")  # fmt: skip


def print_status(status: dict[str, Any]) -> None:
    """The status summary: the step, every rank, every window with each role's part."""
    c, run = status["counters"], status["run"]
    ended = f" ({run['ended_reason']})" if run["ended_reason"] else ""
    print("\n== profiler status ==")
    print(
        f"global step {status['global_step']}, phase {status['phase']}, "
        f"windows closed {len(status['windows'])}, worker RPCs {c.get('worker_rpcs', 0)}, "
        f"run {run['lifecycle']}{ended}"
    )
    for r in status["ranks"]:
        why = f" ({r['reason']['message']})" if r.get("reason") else ""
        note = f" [{r['note']}]" if r.get("note") else ""
        print(
            f"  {r['trainer_id']} rank {r['rank']}: {r['state']}{why}, "
            f"windows {r['windows_captured']}{note}"
        )
    for w in status["windows"]:
        flag = " partial" if w["partial"] else ""
        print(f"  window {w['index']}: steps {w['steps']}{flag}")
        for part in w["roles"].values():
            busy = part["busy_ms_per_step"]
            opt = part.get("optimizer_steps")
            print(
                f"    {part['role']:<8} ranks {part['ranks']}"
                f"{f', optimizer steps {opt[0]}-{opt[1]}' if opt else ''}"
                f"{f', busy {busy:.1f} ms/step' if busy is not None else ''}"
                f" -> {part['trace_dir']}"
            )
            for r, t in sorted(part["traces"].items()):  # a rank's trace lost: why
                if t["error"]:
                    print(f"      rank {r}: no trace: {t['error']['message']}")


def print_kernels(kernels: dict[str, Any]) -> None:
    """One role's cross-rank top-kernel table of the last window."""
    opt = kernels.get("optimizer_steps")
    print(
        f"\n== top kernels, {kernels['role']}, window {kernels['window']} steps "
        f"{kernels['steps']}{f' (optimizer steps {opt[0]}-{opt[1]})' if opt else ''}, "
        f"ranks {kernels['ranks']}, self {kernels['device']} time "
        f"({kernels['unit']}) =="
    )
    print(
        f"{'total':>10} {'mean':>9} {'min':>9} {'max':>9} {'max@':>4} {'calls':>6} "
        f"{'share':>6}  name"
    )
    for k in kernels["kernels"]:
        print(
            f"{k['total_us']:>10.0f} {k['mean_us']:>9.0f} {k['min_us']:>9.0f} {k['max_us']:>9.0f} "
            f"{k['max_rank']:>4} {k['count']:>6} {k['share']:>6.1%}  {k['name'][:60]}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
