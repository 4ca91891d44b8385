"""The node agent's watch on attached ranks' processes: when one is gone, its last steps go to the
coordinator (``coordinator.protocol.step_tail``).

An attached rank 0 keeps its step in a mapped file of this node's ``steps`` folder and asks its
agent to watch (``NodeAgent.watch_exits``). Every ``EVERY_S`` the agent looks at the folder;
a file whose process has ended (its pid gone, or another process's now) is read, its steps
after the last report are sent to the coordinator its owner names (``rank_exited``, with the
run and the process, which the coordinator checks), and the file is removed. A coordinator that
cannot be reached is tried again, ``TRIES`` times at most. A file of another Ray session (one
user's agents of two clusters on one node share the folder) is left to its own agent; a gone
process's file made before this agent started and never seen live by it (its job outlived its
watch) and a file that cannot be read as a step file are removed unreported, said once in the
log. The watch stops when the folder holds none of this session's files, or is refused
``FOLDER_TRIES`` times in a row (said once), and starts again at the next ``watch``.
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
FOLDER_TRIES = 5
Send = Callable[[dict[str, Any], int, Any], Awaitable[Any]]


class ExitWatch:
    """See the module docstring; ``send(owner, last_step, walls)``; ``session``: this Ray
    session's name (None: every file's); ``since``: when the agent started (time.time)."""

    def __init__(
        self,
        send: Send,
        folder: Callable[[], Path] = steps_dir,
        session: str | None = None,
        since: float = 0.0,
    ) -> None:
        self.send, self.folder, self.session, self.since = send, folder, session, since
        self.failures: dict[str, int] = {}
        self._live: set[Path] = set()  # files whose process this agent saw running
        self._others: set[Path] = set()  # files of another Ray session: not this watch's
        self._task: asyncio.Task[None] | None = None

    def watch(self) -> None:
        """Look at the folder from now on, until it is empty (from the event loop)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        refused = 0
        while True:
            try:
                if not await self.look():
                    return
                refused = 0
            except Exception as exc:  # the watch must outlive its own faults
                refused += 1
                if refused == 1:
                    log.warning("exit watch: a look at the step files failed: %r", exc)
                if refused >= FOLDER_TRIES:  # (said once; the next watch() tries again)
                    log.warning("exit watch: stopped after %d failed looks", refused)
                    return
            await asyncio.sleep(EVERY_S)

    async def look(self) -> int:
        """One look: report and remove the files of ended processes; how many files of this
        session are left."""
        loop = asyncio.get_running_loop()
        gone = await loop.run_in_executor(None, self._ended, self.folder())
        for path, read in gone:
            if await self._report(path, read):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                self._live.discard(path)
        left = await loop.run_in_executor(None, _files, self.folder())
        return len([p for p in left if p not in self._others])

    async def _report(self, path: Path, read: TailRead | None) -> bool:
        """Whether ``path`` is done with: reported, or never will be."""
        if read is None:
            return True
        owner = read.owner
        try:
            await self.send(owner, read.last_step, read.unreported())
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

    def _ended(self, folder: Path) -> list[tuple[Path, TailRead | None]]:
        """This session's step files whose process has ended, read (None: to be removed
        unreported: not a step file, unreadable, or stale: see the module docstring)."""
        out: list[tuple[Path, TailRead | None]] = []
        for path in _files(folder):
            try:
                got = read_tail(path)
                read: TailRead | None = got
                owner = got.owner
                if self.session is not None and owner.get("session") != self.session:
                    self._others.add(path)
                    continue  # (another cluster's: its agent's)
                if not is_gone(int(owner["pid"]), owner.get("started")):
                    self._live.add(path)
                    continue
                if not isinstance(owner.get("report_to"), dict):
                    raise ValueError(f"{path} names no coordinator")
                if float(owner.get("made", 0)) < self.since and path not in self._live:
                    log.warning("exit watch: %s is removed: made before this agent "
                                "started, its process gone", path)  # fmt: skip
                    read = None
            except FileNotFoundError:
                continue
            except Exception as exc:  # (any garbage: this file goes, the others are looked at)
                log.warning("exit watch: %s is removed: %r", path, exc)
                read = None
            out.append((path, read))
        return out


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.endswith(".step")]
