"""An attached rank 0's step file (``coordinator.protocol.step_tail``) and its node agent's watch
(``worker_ext.agent.exit_watch``), with real processes killed outright (SIGKILL: nothing runs
in them at the end): what the process stored is read after it is gone, and the watch reports
it once and removes the file."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.protocol.step_tail import is_gone, process_start, read_tail
from worker_ext.agent.exit_watch import ExitWatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WRITER = """
import os, sys
from coordinator.protocol.step_tail import StepTail, process_start
tail = StepTail.create(sys.argv[1], {"report_to": {"name": "c", "namespace": "n",
                       "trainer_id": "t"}, "rank": 0, "generation": 3, "pid": os.getpid(),
                       "started": process_start(os.getpid())}, slots=8)
for k in range(1, 21):
    tail.step(k, k / 1000)
    if k == 15:
        tail.sent(15)
print("stepped", flush=True)
sys.stdin.read()  # (until killed)
"""


def _writer(path: Path) -> subprocess.Popen:
    """A live process that has stored steps 1-20 (the report of 15 sent)."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "stepped\n"
    assert not is_gone(proc.pid, process_start(proc.pid))
    return proc


def _kill(proc: subprocess.Popen) -> int:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    return proc.pid


def _killed_writer(path: Path) -> int:
    return _kill(_writer(path))


@pytest.mark.subprocess
def test_a_killed_process_s_last_steps_are_read_from_its_step_file(tmp_path):
    path = tmp_path / "1.step"
    pid = _killed_writer(path)
    got = read_tail(path)
    assert (got.last_step, got.sent_step) == (20, 15)
    assert got.unreported() == (16, [0.016, 0.017, 0.018, 0.019, 0.02])
    assert got.owner["generation"] == 3 and is_gone(pid, None)


def test_a_file_that_is_not_a_step_file_is_refused_with_its_name(tmp_path):
    bad = tmp_path / "2.step"
    bad.write_bytes(b"x" * 100)
    try:
        read_tail(bad)
    except ValueError as exc:
        assert str(bad) in str(exc) and "not a step file" in str(exc)
    else:
        raise AssertionError("a bad step file was read")


@pytest.mark.subprocess
def test_the_watch_reports_a_gone_process_once_and_removes_its_file(tmp_path):
    """A live process's file stays; once it is killed, it is reported, then removed; a file
    that is not a step file goes."""
    (tmp_path / "junk.step").write_bytes(b"junk")
    live = _writer(tmp_path / "live.step")
    sent: list[tuple] = []

    async def send(report_to, rank, generation, last, walls):
        sent.append((report_to["trainer_id"], rank, generation, last, walls))

    watch = ExitWatch(send, folder=lambda: tmp_path)
    try:
        assert asyncio.run(watch.look()) == 1 and sent == []
    finally:
        _kill(live)
    assert [asyncio.run(watch.look()) for _ in range(2)] == [0, 0]
    assert sent == [("t", 0, 3, 20, (16, [0.016, 0.017, 0.018, 0.019, 0.02]))]
    assert list(tmp_path.iterdir()) == []


def test_a_step_file_that_cannot_be_made_is_said_once_and_changes_nothing(
    tmp_path, monkeypatch, caplog
):
    """The node's folder is refused (a file where the folder should be): the attached rank
    trains on without a step file, told why in its log; nothing raises into its step."""
    from coordinator.client.rank_reports import StepReports
    from worker_ext.rank.step_file import keep_last_steps

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("RAY_PROFILER_NODE_DIR", str(blocker))
    reports = StepReports(None, "t")
    with caplog.at_level("WARNING"):
        why = keep_last_steps(reports, {"report_to": {}, "rank": 0, "generation": 1})
    assert why is not None and str(blocker) in why, why
    assert reports.tail is None and list(tmp_path.iterdir()) == [blocker]
    assert [r.message for r in caplog.records if "no step file" in r.message] == [
        f"profiler: no step file; the last steps before this process exits will not be "
        f"reported ({why})"
    ]
