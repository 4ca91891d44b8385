"""How long a call to a busy async Ray actor waits behind a burst of other calls.

An async actor (max_concurrency 20,000) folds items one at a time, 7 ms of CPU each, letting its
event loop go between two (``--mode wait``: each call waits for its fold; ``ack``: each call
returns at once; ``sync``: each call folds before it returns). Four other actors send it 1,250
calls at once, as 1,250 node agents would. Meanwhile the driver pings it every 50 ms and times
the answer. The ping needs no CPU of the actor, yet one ping waits seconds (measured with
``wait`` and ``sync``: 9.8 and 8.4 s on this 2-core machine): Ray
hands each call to the actor's event loop from another thread, which needs the GIL, which the
loop holds through each fold. It is why the coordinator takes node partials merged by relays
(35 calls at 10,000 ranks, not 1,250).

``--lane control`` sends the pings to a concurrency group of their own (``control``: its own
thread and event loop), as the coordinator sends window commands to the node agents; the burst
stays in the default group. Both lanes run by default, one after the other, in the same run.

Run: RAY_AUTH_MODE=disabled .venv/bin/python bench/ray_queueing.py --mode wait
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import time

import ray

FOLD_S = 0.007


@ray.remote(num_cpus=0, max_concurrency=20_000, concurrency_groups={"control": 16})
class Folder:
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.queue: collections.deque[asyncio.Future[bool]] = collections.deque()
        self.task: asyncio.Task[None] | None = None
        self.folded = 0

    async def ping(self) -> int:
        return 1

    async def count(self) -> int:
        return self.folded

    async def ingest(self, blob: bytes) -> bool:
        if self.mode == "sync":
            _burn(FOLD_S)
            self.folded += 1
            return True
        done = asyncio.get_running_loop().create_future()
        self.queue.append(done)
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._drain())
        return True if self.mode == "ack" else await done

    async def _drain(self) -> None:
        while self.queue:
            done = self.queue.popleft()
            _burn(FOLD_S)
            self.folded += 1
            done.set_result(True)
            await asyncio.sleep(0)


def _burn(seconds: float) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass


@ray.remote(num_cpus=0)
class Pusher:
    def __init__(self, target: object) -> None:
        self.target, self.blob = target, os.urandom(1000)

    async def push(self, n: int) -> int:
        await asyncio.gather(*(self.target.ingest.remote(self.blob) for _ in range(n)))
        return n


def measure(mode: str, calls: int, lane: str) -> str:
    folder = Folder.remote(mode)
    ping = folder.ping.options(concurrency_group=lane) if lane != "default" else folder.ping
    ray.get(ping.remote())
    pushers = [Pusher.remote(folder) for _ in range(4)]
    pushes = [p.push.remote(calls // 4) for p in pushers]
    t0, pings = time.perf_counter(), []
    while ray.get(folder.count.remote()) < calls // 4 * 4 and time.perf_counter() - t0 < 120:
        t = time.perf_counter()
        ray.get(ping.remote())
        pings.append(time.perf_counter() - t)
        time.sleep(0.05)
    ray.get(pushes)
    for a in [folder, *pushers]:
        ray.kill(a)
    return (
        f"mode {mode}, pings in the {lane} lane: {calls} calls folded in "
        f"{time.perf_counter() - t0:.1f} s; a ping took {1e3 * statistics.median(pings):.0f} ms "
        f"median, {1e3 * max(pings):.0f} ms at most ({len(pings)} pings)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["wait", "ack", "sync"], default="wait")
    ap.add_argument(
        "--lane", nargs="+", choices=["default", "control"], default=["default", "control"]
    )
    ap.add_argument("--calls", type=int, default=1250)
    args = ap.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    for lane in args.lane:
        print(measure(args.mode, args.calls, lane), flush=True)


if __name__ == "__main__":
    main()
