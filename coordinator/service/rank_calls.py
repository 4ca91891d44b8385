"""The coordinator's calls to ranks: fan one RPC out, wait, fold every reply into the run.

No RPC goes to a rank that is not active (disabled, lost, unresponsive or not selected), nor to
an SPMD rank (it follows the plan by itself: ``spmd_ranks``), and a rank's fault never reaches
the caller: it changes that rank's state and nothing else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from coordinator.core.run import Run
from coordinator.core.spmd_plan import apply_misses
from coordinator.core.window_plan import Command, Start, Step, Stop
from coordinator.protocol.reasons import reason
from coordinator.raylink.failures import LOST, call_failure, no_answer
from coordinator.service.node_fanout import YIELD_EVERY, NodeFanOut

Key = tuple[str, int]
SUBMIT_EVERY = 16  # Ray calls submitted between two yields (each costs about 0.5 ms of CPU)


async def fan_out(
    run: Run,
    keys: Sequence[Key],
    method: str,
    args_for: Callable[[Key], tuple[Any, ...]],
    timeout: float | None = None,
) -> None:
    """Call ``method`` on every active rank in ``keys``; wait up to the worker timeout."""
    st = run.state
    tasks: dict[Key, asyncio.Future[Any]] = {}
    for n, key in enumerate(keys):
        if n % SUBMIT_EVERY == SUBMIT_EVERY - 1:
            await asyncio.sleep(0)  # a long fan-out never stalls the event loop
        if not st.ranks[key].active or st.trainers[key[0]].spmd:
            continue
        handle = st.trainers[key[0]].handles[key[1]]
        try:
            ref = getattr(handle, method).remote(*args_for(key))
        except Exception as exc:
            st.rank_failed(key, "disabled", reason("coordinator", exc))
            continue
        st.counters["worker_rpcs"] += 1
        st.counters[f"worker_rpcs_{method}"] += 1
        tasks[key] = asyncio.ensure_future(_await(ref))
    if not tasks:
        return
    timeout = timeout or run.config.worker_timeout_s
    _, late = await asyncio.wait(tasks.values(), timeout=timeout)
    for n, (key, task) in enumerate(tasks.items()):
        if n % YIELD_EVERY == YIELD_EVERY - 1:
            await asyncio.sleep(0)
        if task in late:
            task.cancel()
            st.rank_failed(key, "unresponsive", no_answer(method, timeout))
        elif (err := task.exception()) is not None:
            st.rank_failed(key, *call_failure(method, err))
        else:
            st.apply_reply(key, task.result())


async def send(
    run: Run, keys: Sequence[Key], method: str, args: tuple[Any, ...], nodes: NodeFanOut | None
) -> None:
    """``method(*args)`` to every active rank in ``keys``: through the node agents when the
    config says so (``fanout: node``), directly to the ranks they could not reach."""
    st = run.state
    keys = [k for k in keys if st.ranks[k].active and not st.trainers[k[0]].spmd]
    if nodes is not None and run.config.fanout == "node" and keys:
        keys = await nodes.fan_out(run, keys, method, args, run.config.worker_timeout_s)
    await fan_out(run, keys, method, same_args(*args))


async def run_commands(
    run: Run, commands: Sequence[Command], nodes: NodeFanOut | None = None
) -> None:
    """Send each window command to the ranks of the open window, in order."""
    st = run.state
    for cmd in commands:
        if isinstance(cmd, Start):
            keys = run.capture_ranks.pop(cmd.window.index, None)
            if keys is None:  # a scheduled window: the ranks the config selects
                keys = [
                    k
                    for k, r in st.ranks.items()
                    if r.active and run.config.selects(k[1], st.trainers[k[0]].role)
                ]
            keys = [k for k in keys if st.ranks[k].active]
            opened = st.open_window(cmd.window, keys, cmd.planned)
            opened.trigger = run.auto_triggers.pop(cmd.window.index, None)
            planned = run.spmd_captures.get(cmd.window.index)
            if planned is not None and planned.missed:  # SPMD ranks that never took it
                apply_misses(st, cmd.window.index, planned.missed)
            w = cmd.window.to_dict()
            await send(run, keys, "start_profile", (w, cmd.step), nodes)
            continue
        rec = st.current_window()
        if rec is None:
            continue
        keys = sorted(rec.participants)
        if isinstance(cmd, Step):
            await send(run, keys, "profile_step", (cmd.step,), nodes)
            if cmd.stops:
                close_late(run, keys)
                st.close_window(rec)
        elif isinstance(cmd, Stop):
            rec.stopped_at = run.plan.last_step
            await send(run, keys, "stop_profile", (), nodes)
            close_late(run, keys)
            st.close_window(rec)


def close_late(run: Run, keys: Sequence[Key]) -> None:
    """Ranks that stopped answering inside the window may still record when they come back:
    queue a ``stop_profile`` for them (never waited for), so no profiler is left running."""
    st = run.state
    for key in keys:
        if st.ranks[key].state != "unresponsive" or st.trainers[key[0]].spmd:
            continue
        try:
            st.trainers[key[0]].handles[key[1]].stop_profile.remote()
            st.counters["worker_rpcs"] += 1
            st.counters["worker_rpcs_stop_profile_unawaited"] += 1
        except Exception:
            continue  # best effort: the rank is already out of the run


def same_args(*args: Any) -> Callable[[Key], tuple[Any, ...]]:
    """The same arguments for every rank of a ``fan_out``."""
    return lambda _key: args


async def any_alive(handles: Sequence[Any], timeout: float = 3.0) -> bool:
    """Whether any of these actors is alive. A busy one (its calls queue behind a long step)
    counts as alive; only actors that Ray reports dead do not."""
    if not handles:
        return False
    tasks = [asyncio.ensure_future(_await(h.__ray_ready__.remote())) for h in handles]
    done, late = await asyncio.wait(tasks, timeout=timeout)
    for t in late:
        t.cancel()
    return bool(late) or any(not isinstance(t.exception(), LOST) for t in done)


async def _await(ref: Any) -> Any:
    return await ref
