"""The local agent's child process (a rank outside Ray): spawned, and gone with its parent."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

pytestmark = pytest.mark.subprocess  # every test here starts processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_the_local_agent_leaves_when_its_training_process_is_killed_outright():
    """A training process killed by the OOM killer or ``kill -9`` runs no clean-up, and a
    process pool's child never hears of it through the pool's pipes (it holds both ends)."""
    script = textwrap.dedent(
        """
        import time
        from worker_ext.rank.agent_link import LocalAgentLink
        print(LocalAgentLink().prepare(), flush=True)
        time.sleep(120)
        """
    )
    training = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert training.stdout is not None
        agent = int(training.stdout.readline())
        assert psutil.Process(agent).ppid() == training.pid
        training.kill()
        training.wait(timeout=30)
        assert gone(agent, 30), "the local agent outlived its training process"
    finally:
        training.kill()
        training.wait(timeout=30)
