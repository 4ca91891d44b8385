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


@ray.remote(num_cpus=0, max_concurrency=20_000)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["wait", "ack", "sync"], default="wait")
    ap.add_argument("--calls", type=int, default=1250)
    args = ap.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    folder = Folder.remote(args.mode)
    ray.get(folder.ping.remote())
    pushes = [p.push.remote(args.calls // 4) for p in (Pusher.remote(folder) for _ in range(4))]
    t0, pings = time.perf_counter(), []
    while ray.get(folder.count.remote()) < args.calls // 4 * 4 and time.perf_counter() - t0 < 120:
        t = time.perf_counter()
        ray.get(folder.ping.remote())
        pings.append(time.perf_counter() - t)
        time.sleep(0.05)
    ray.get(pushes)
    print(
        f"mode {args.mode}: {args.calls} calls folded in {time.perf_counter() - t0:.1f} s; "
        f"a ping took {1e3 * statistics.median(pings):.0f} ms median, "
        f"{1e3 * max(pings):.0f} ms at most ({len(pings)} pings)"
    )


if __name__ == "__main__":
    main()
