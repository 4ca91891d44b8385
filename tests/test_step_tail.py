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
import uuid
from pathlib import Path

import pytest

from coordinator.protocol.step_tail import StepTail, is_gone, process_start, read_tail
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
    """A live process's file stays; once it is killed, it is reported (though made before
    the agent started: the agent saw it live), then removed; a file that is not a step file
    goes."""
    (tmp_path / "junk.step").write_bytes(b"junk")
    live = _writer(tmp_path / "live.step")
    sent: list[tuple] = []

    async def send(owner, last, walls):
        sent.append((owner["report_to"]["trainer_id"], owner["rank"], owner["generation"],
                     last, walls))  # fmt: skip

    watch = ExitWatch(send, folder=lambda: tmp_path, since=float("inf"))  # (seen live: told)
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


def _gone_file(path: Path, **owner) -> None:
    """A step file of a process that is gone (pid 2**22 + 1 is over Linux's pid_max)."""
    tail = StepTail.create(path, {"report_to": {"trainer_id": "t"}, "rank": 0, "generation": 1,
                                  "pid": 2**22 + 1, **owner}, slots=4)  # fmt: skip
    tail.step(3, 0.1)
    tail.close(remove=False)


def test_the_watch_skips_another_cluster_s_files_and_drops_stale_and_garbage_ones(tmp_path, caplog):
    """One look, in the order the folder lists them: a file whose pid is 1e999 (OverflowError)
    or whose owner nests past Python's recursion limit is removed, logged, and the files after
    it are still looked at; a file of another Ray session stays (its own agent's); a gone
    process's file made before the agent started is removed unreported; this session's new
    one is reported."""
    sent: list[int] = []

    async def send(owner, last, walls):
        sent.append(owner["made"])

    _gone_file(tmp_path / "a-inf.step", session="s", made=200.0, pid=float("inf"))
    _gone_file(tmp_path / "a-deep.step", session="s", made=200.0, pad="x" * 40000)
    data = (tmp_path / "a-deep.step").read_bytes()
    blob = data[data.index(b"{") :]
    deep = b"[" * (len(blob) // 2) + b"]" * (len(blob) // 2) + b" " * (len(blob) % 2)
    (tmp_path / "a-deep.step").write_bytes(data[: data.index(b"{")] + deep)
    watch = ExitWatch(send, folder=lambda: tmp_path, session="s", since=100.0)
    _gone_file(tmp_path / "b-other.step", session="other", made=200.0)
    _gone_file(tmp_path / "c-stale.step", session="s", made=50.0)
    _gone_file(tmp_path / "d-new.step", session="s", made=200.0)
    with caplog.at_level("WARNING"):
        assert asyncio.run(watch.look()) == 0  # (the watch stops: none of its files is left)
    assert sent == [200.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b-other.step"]
    removed = sorted(r.message.split(" is removed")[0] for r in caplog.records)
    assert removed == [
        f"exit watch: {tmp_path / n}" for n in ("a-deep.step", "a-inf.step", "c-stale.step")
    ]


def test_a_refused_steps_folder_is_said_once_and_stops_the_watch(monkeypatch, caplog):
    """The folder cannot be read: one warning, then the watch stops after ``FOLDER_TRIES``
    looks (said), not a traceback every look forever; the next ``watch()`` starts it again."""
    from worker_ext.agent import exit_watch

    monkeypatch.setattr(exit_watch, "EVERY_S", 0.001)
    looks: list[int] = []

    def refused() -> Path:
        looks.append(1)
        raise PermissionError("the steps folder is refused")

    async def watched() -> None:
        watch = ExitWatch(lambda *a: asyncio.sleep(0), folder=refused)
        watch.watch()
        assert watch._task is not None
        await asyncio.wait_for(watch._task, 30)

    with caplog.at_level("WARNING"):
        asyncio.run(watched())
    assert len(looks) == exit_watch.FOLDER_TRIES
    assert [r.message for r in caplog.records] == [
        "exit watch: a look at the step files failed: "
        "PermissionError('the steps folder is refused')",
        f"exit watch: stopped after {exit_watch.FOLDER_TRIES} failed looks",
    ]


def test_a_step_file_whose_watch_cannot_be_asked_is_removed(
    ray_session, tmp_path, monkeypatch, caplog
):
    """The node agent cannot be asked to watch (Ray refuses the call): the file made for it
    is removed and the rank keeps no tail, said once; a file nobody watches would outlive
    the job and be reported to the next one."""
    from coordinator.client.rank_reports import StepReports
    from worker_ext.rank import agent_link
    from worker_ext.rank.step_file import keep_last_steps

    monkeypatch.setenv("RAY_PROFILER_NODE_DIR", str(tmp_path))

    def no_agent(node: str):
        raise ConnectionError("no agent on n")  # (the fault injected)

    monkeypatch.setattr(agent_link, "_node_agent", no_agent)
    reports = StepReports(None, "t")
    with caplog.at_level("WARNING"):
        why = keep_last_steps(reports, {"report_to": {}, "rank": 0, "generation": 1})
    assert why == "ConnectionError: no agent on n" and reports.tail is None
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
    assert sum("no step file" in r.message for r in caplog.records) == 1


def test_an_exit_of_another_run_or_process_is_refused_and_moves_no_step(
    ray_session, ray_actors, tmp_path, caplog
):
    """A step file outlived its job: its agent reports it to the next run of the same
    coordinator name, where rank 0 is generation 1 again. Another run's name, or a pid other
    than the one the rank attached with, is refused and moves nothing; the rank's own process
    of this run moves the step."""
    from coordinator.client.connect import attach_coordinator
    from tests.configs import profiler_config

    ray = ray_session
    cfg = profiler_config(tmp_path, on_demand_only=True).to_dict()
    coord, _ = attach_coordinator(cfg, name=f"profiler-{uuid.uuid4().hex[:8]}",
                                  namespace="profiler-tests")  # fmt: skip
    ray_actors.append(coord)
    where = {"pid": 4242, "node_id": "n"}
    reply = ray.get(coord.attach_rank.remote(cfg, "sft", 0, 1, "policy", where))
    run, gen = reply["run"], reply["generation"]
    ray.get(coord.rank_start.remote("sft", 0, gen, 0))
    status = {"state": "ok", "closed": None, "summaries_pending": []}
    ray.get(coord.rank_status.remote("sft", 0, 5, status, gen))
    assert ray.get(coord.status.remote())["global_step"] == 5
    exited = coord.rank_exited.remote
    assert ray.get(exited("sft", 0, gen, 40, None, run="an-earlier-run", pid=4242)) is False
    assert ray.get(exited("sft", 0, gen, 40, None, run=run, pid=4243)) is False
    assert ray.get(exited("sft", 0, gen, 40, None, run=run)) is False
    assert ray.get(coord.status.remote())["global_step"] == 5
    assert ray.get(exited("sft", 0, gen, 40, None, run=run, pid=4242)) is True
    assert ray.get(coord.status.remote())["global_step"] == 40
