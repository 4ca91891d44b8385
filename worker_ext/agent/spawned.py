"""A helper process of one: a spawned child (never forked: its parent may run torch or Ray),
started without re-running the parent's script, that leaves when its parent is gone: the local
agent of a rank outside Ray."""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import os
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

PARENT_POLL_S = 0.5


def spawn_pool() -> concurrent.futures.Executor:
    """A pool of one spawned child; its process starts at the first ``submit_to``."""
    ctx = multiprocessing.get_context("spawn")
    return concurrent.futures.ProcessPoolExecutor(
        1, mp_context=ctx, initializer=_leave_with, initargs=(os.getpid(),)
    )


def _leave_with(parent: int) -> None:
    """In the child: leave when ``parent`` is gone.

    A parent killed outright (by the kernel's OOM killer, by ``kill -9``) runs no clean-up, and
    the pool's pipes never tell the child: each end of them is in both processes. So a thread
    asks every ``PARENT_POLL_S`` who the parent is now."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="leave-with-parent", daemon=True).start()


def submit_to(
    pool: concurrent.futures.Executor, fn: Callable[..., Any], *args: Any
) -> concurrent.futures.Future[Any]:
    """``pool.submit(fn, *args)``, with the parent's ``__main__`` hidden from a child that
    this submit starts (raises ``BrokenProcessPool`` when the child has died)."""
    with main_hidden():
        return pool.submit(fn, *args)


@contextlib.contextmanager
def main_hidden() -> Iterator[None]:
    """Start spawned children without re-running the caller's script.

    A spawned child imports the parent's ``__main__`` from its path, which runs a script that
    has no ``if __name__ == "__main__"`` guard (its training loop included) a second time.
    """
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main
