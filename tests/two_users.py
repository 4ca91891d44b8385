"""Two real unprivileged users of one node, for the shared-node tests.

Root drops to ``nobody`` (the victim, running our code) and to ``daemon`` (another local user)
with ``setpriv``: no capabilities, no supplementary groups. Both share a private sticky ``<tmp>``
(mode 1777, like ``/tmp``) made for the test, so that what one user plants there is what the
other finds. Where the machine cannot do this (not root, no ``setpriv``, no such users), the
test skips with the reason.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT

VICTIM = "nobody"
OTHER = "daemon"


def unavailable() -> str | None:
    """Why two users cannot be had here, or None."""
    if os.geteuid() != 0:
        return "the two-user tests need root (to setpriv to two unprivileged users)"
    if shutil.which("setpriv") is None:
        return "the two-user tests need setpriv (util-linux)"
    for name in (VICTIM, OTHER):
        try:
            pwd.getpwnam(name)
        except KeyError:
            return f"the two-user tests need a system user {name!r}"
    return None


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: Path


@dataclass(frozen=True)
class Node:
    """Two users and their shared ``tmp``."""

    tmp: Path
    victim: User
    other: User

    def env(self, user: User, **extra: str) -> dict[str, str]:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(user.home),
            "TMPDIR": str(self.tmp),
            "PYTHONPATH": ROOT,
            "PYTHONDONTWRITEBYTECODE": "1",
            "RAY_AUTH_MODE": "disabled",
        }
        env.update(extra)
        return env

    def run(
        self,
        user: User,
        code: str,
        *,
        timeout: float = 120,
        env: dict[str, str] | None = None,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """``python -c code`` as ``user`` in the repository, with this node's ``tmp``."""
        out = subprocess.run(
            self.argv(user, code),
            cwd=ROOT,
            env=self.env(user, **(env or {})),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and out.returncode != 0:
            raise AssertionError(
                f"as {user.name}: exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
            )
        return out

    def argv(self, user: User, code: str) -> list[str]:
        """The command line of ``python -c code`` as ``user``, with no capabilities."""
        drop = [f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups"]
        drop += ["--inh-caps=-all", "--bounding-set=-all"]
        return ["setpriv", *drop, sys.executable, "-c", code]

    def start(
        self, user: User, code: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        """``python -c code`` as ``user``, running on (a server): its stdout is a pipe; the
        caller stops it."""
        return subprocess.Popen(
            self.argv(user, code),
            cwd=ROOT,
            env=self.env(user, **(env or {})),
            stdout=subprocess.PIPE,
            text=True,
        )


@contextmanager
def two_users() -> Iterator[Node]:
    """A ``Node`` (skips the test where it cannot be had); removes everything it made."""
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    base = Path(tempfile.mkdtemp(prefix="pf2u-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        tmp = base / "tmp"
        tmp.mkdir()
        os.chmod(tmp, 0o1777)
        users = []
        for name in (VICTIM, OTHER):
            pw = pwd.getpwnam(name)
            home = base / f"home-{name}"
            home.mkdir(mode=0o700)
            os.chown(home, pw.pw_uid, pw.pw_gid)
            users.append(User(name, pw.pw_uid, pw.pw_gid, home))
        yield Node(tmp, users[0], users[1])
    finally:
        shutil.rmtree(base, ignore_errors=True)
