"""Each guard against a torch.profiler crash, run in a subprocess.

A regression then shows up as a non-zero exit code of the child (a segfault is -11), not as a
dead test run. The ``raw_`` tests show that the hazard each guard avoids is real in this torch.
"""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.subprocess  # every test here starts another process

PRELUDE = """
import os, sys, tempfile, threading
import torch
from coordinator.core.config import ProfilerConfig
from coordinator.core.schedule import Window
from coordinator.protocol.summary_codec import decode_summary
from worker_ext.rank.rank_profiler import RankProfiler
from tests.torch_helpers import TinyMLP
tmp = tempfile.mkdtemp()
def make(rank=0, **kw):
    base = dict(enable=True, save_path=tmp, ranks="all", activities=["cpu"],
                export_type="chrome_trace")
    base.update(kw)
    return RankProfiler(rank, ProfilerConfig(**base).validate(), os.path.join(tmp, "run"))
model = TinyMLP()
def window(rp, first=0, last=2, index=0, close=True):
    rp.start_window(Window(index, first, first, last), first)
    for k in range(first, last + (1 if close else 0)):
        model.train_step()
        rp.step(k)
"""


def run_child(body: str, timeout: int = 120) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(body) + "\nprint('CHILD-OK')\n"
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": ROOT},
    )


def assert_clean(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0 and "CHILD-OK" in proc.stdout, (
        f"child exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
        f"stderr:\n{proc.stderr[-3000:]}"
    )


def assert_crashes(proc: subprocess.CompletedProcess) -> None:
    if proc.returncode == 0:
        pytest.skip("this torch no longer crashes here; the guard is still kept")
    assert "CHILD-OK" not in proc.stdout


def test_second_stop_is_never_sent_to_torch():
    proc = run_child(
        """
        rp = make()  # its warm-up stops a profiler too: patch after it
        real_stop_trace = torch.profiler.profile.stop_trace
        calls = []
        def failing_stop_trace(self):
            calls.append(1)
            real_stop_trace(self)
            if len(calls) == 1:
                raise RuntimeError("injected: torch raised after stopping")
        torch.profiler.profile.stop_trace = failing_stop_trace
        window(rp)
        st = rp.stop_window()
        assert st["state"] == "disabled", st
        assert st["reason"]["where"] == "step" and "injected" in st["reason"]["message"], st
        rp.stop_window(); rp.step(5)
        assert len(calls) == 1, calls  # the torch session was stopped exactly once
        torch.profiler.profile.stop_trace = real_stop_trace
        rp2 = make(1)
        window(rp2, index=1)
        assert rp2.wait_for_summaries(30)["state"] == "ok"
        """
    )
    assert_clean(proc)


def test_raw_double_stop_then_export_crashes():
    proc = run_child(
        """
        p = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        p.start(); model.train_step(); p.stop(); p.stop()
        p.export_chrome_trace(os.path.join(tmp, "t.json"))
        """
    )
    assert_crashes(proc)


def test_exception_in_trace_export_never_escapes_the_handler():
    proc = run_child(
        """
        def broken_export(self, path, *a, **kw):
            raise OSError(28, "No space left on device")
        torch.profiler.profile.export_chrome_trace = broken_export
        rp = make()
        window(rp)
        st = rp.stop_window()
        assert st["state"] == "disabled" and st["reason"]["where"] == "export", st
        assert st["reason"]["type"] == "OSError" and "No space" in st["reason"]["message"]
        window(rp, first=3, last=5, index=1)  # later commands are no-ops
        for k in range(3): model.train_step()
        files = [f for _, _, fs in os.walk(tmp) for f in fs]
        assert files == [], files  # no trace, and no half-written temp file
        """
    )
    assert_clean(proc)


def test_raw_exception_from_on_trace_ready_crashes_the_next_stop():
    proc = run_child(
        """
        def boom(p):
            raise RuntimeError("handler failed")
        sched = torch.profiler.schedule(wait=0, warmup=1, active=1)
        p = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                   schedule=sched, on_trace_ready=boom)
        p.start()
        for _ in range(3):
            model.train_step()
            try:
                p.step()
            except RuntimeError:
                pass
        p.stop()
        """
    )
    assert_crashes(proc)


def test_calls_from_a_second_thread_are_refused():
    proc = run_child(
        """
        rp = make()
        rp.start_window(Window(0, 0, 0, 3), 0)
        model.train_step()
        out = {}
        t = threading.Thread(target=lambda: out.update(st=rp.step(0)))
        t.start(); t.join()
        assert out["st"]["state"] == "disabled", out
        assert "second thread" in out["st"]["reason"]["message"]
        model.train_step()
        st = rp.step(1)  # back on the owner thread: the live profiler is stopped here, once
        assert st["phase"] == "idle" and st["state"] == "disabled", st
        assert not torch._C._autograd._profiler_enabled()
        """
    )
    assert_clean(proc)


def test_raw_profiler_calls_from_two_threads_crash():
    proc = run_child(
        """
        p = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        p.start(); model.train_step()
        t = threading.Thread(target=p.stop); t.start(); t.join()
        p.export_chrome_trace(os.path.join(tmp, "t.json"))
        """
    )
    assert_crashes(proc)


def test_never_two_profilers_at_once():
    proc = run_child(
        """
        a, b = make(0), make(1)
        a.start_window(Window(0, 0, 0, 1), 0)
        st = b.start_window(Window(0, 0, 0, 1), 0)
        assert st["state"] == "ok" and st["phase"] == "idle" and st["windows_skipped"] == 1, st
        assert "rank 0" in st["last_skip_reason"]
        for k in range(2):
            model.train_step(); a.step(k); b.step(k)
        (s,) = [decode_summary(x) for x in a.wait_for_summaries(30)["summaries"]]
        assert len(s.kernels) > 5  # nobody took the session over
        # A user's own profiler running: the rank skips rather than take it over.
        user = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        user.start()
        st = b.start_window(Window(1, 2, 2, 3), 2)
        assert st["phase"] == "idle" and "another torch.profiler" in st["last_skip_reason"], st
        model.train_step()
        user.stop()
        assert len(user.key_averages()) > 5
        """
    )
    assert_clean(proc)


def test_summaries_parse_while_the_next_window_records():
    proc = run_child(
        """
        rp = make(export_type="chrome_trace_gz")
        got = []
        for i in range(6):  # back-to-back windows: the agent works while the next one runs
            # every reply drains the summaries that are ready: collect them all
            got += rp.start_window(Window(i, 2 * i, 2 * i, 2 * i + 1), 2 * i)["summaries"]
            for k in (2 * i, 2 * i + 1):
                for _ in range(3): model.train_step()
                got += rp.step(k)["summaries"]
        st = rp.wait_for_summaries(60)
        got += st["summaries"]
        assert st["state"] == "ok", st
        assert sorted(decode_summary(x).window for x in got) == list(range(6))
        """
    )
    assert_clean(proc)
