"""The node agent's watch on attached ranks' processes: when one is gone, its last steps go to the
coordinator (``coordinator.protocol.step_tail``).

An attached rank 0 keeps its step in a mapped file of this node's ``steps`` folder and asks its
agent to watch (``NodeAgent.watch_exits``). Every ``EVERY_S`` the agent looks at the folder;
a file whose process has ended (its pid gone, or another process's now) is read, its steps
after the last report are sent to the coordinator its owner names (``rank_exited``), and the
file is removed. A coordinator that cannot be reached is tried again, ``TRIES`` times at most;
a file that is not a step file is removed, said once in the log. The watch stops when the
folder is empty and starts again at the next ``watch``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from coordinator.protocol.step_tail import TailRead, is_gone, read_tail, steps_dir

log = logging.getLogger(__name__)
EVERY_S = 0.5
TRIES = 20
Send = Callable[[dict[str, str], int, int, int, Any], Awaitable[Any]]


class ExitWatch:
    """See the module docstring; ``send(report_to, rank, generation, last_step, walls)``."""

    def __init__(self, send: Send, folder: Callable[[], Path] = steps_dir) -> None:
        self.send, self.folder = send, folder
        self.failures: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    def watch(self) -> None:
        """Look at the folder from now on, until it is empty (from the event loop)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                if not await self.look():
                    return
            except Exception:  # the watch must outlive its own faults
                log.exception("exit watch: a look at the step files failed")
            await asyncio.sleep(EVERY_S)

    async def look(self) -> int:
        """One look: report and remove the files of ended processes; how many files are left."""
        loop = asyncio.get_running_loop()
        gone = await loop.run_in_executor(None, _ended, self.folder())
        for path, read in gone:
            if await self._report(path, read):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        return len(await loop.run_in_executor(None, _files, self.folder()))

    async def _report(self, path: Path, read: TailRead | None) -> bool:
        """Whether ``path`` is done with: reported, or never will be."""
        if read is None:
            return True
        owner = read.owner
        try:
            await self.send(owner["report_to"], owner["rank"], owner["generation"],
                            read.last_step, read.unreported())  # fmt: skip
            return True
        except Exception as exc:
            key = str(path)
            self.failures[key] = tries = self.failures.get(key, 0) + 1
            log.warning("exit watch: rank %s's last step %s not reported (try %d of %d): %r",
                        owner.get("rank"), read.last_step, tries, TRIES, exc)  # fmt: skip
            if tries < TRIES:
                return False
            self.failures.pop(key, None)
            return True


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.endswith(".step")]


def _ended(folder: Path) -> list[tuple[Path, TailRead | None]]:
    """The step files whose process has ended, read (None: not a step file, or unreadable)."""
    out: list[tuple[Path, TailRead | None]] = []
    for path in _files(folder):
        try:
            read = read_tail(path)
            owner = read.owner
            if not is_gone(int(owner["pid"]), owner.get("started")):
                continue
            if not isinstance(owner.get("report_to"), dict):
                raise ValueError(f"{path} names no coordinator")
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("exit watch: %s is removed: %r", path, exc)
            read = None
        out.append((path, read))
    return out
