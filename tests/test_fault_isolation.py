"""A fault anywhere disables that rank's profiling, says why, and never reaches training."""

import gzip
import os

import pytest
import torch

from coordinator.core.config import ProfilerConfig
from coordinator.core.schedule import Window
from coordinator.protocol.summary_codec import decode_summary
from tests.torch_helpers import TinyMLP, summaries
from worker_ext.agent.trace_jobs import TraceJob, run_job
from worker_ext.rank.agent_link import LocalAgentLink
from worker_ext.rank.mixin import ProfilerWorkerMixin
from worker_ext.rank.rank_profiler import RankProfiler

pytestmark = pytest.mark.subprocess  # every test here starts another process


def make(tmp_path, run=None, agent=None, **kw):
    base = dict(
        enable=True,
        save_path=str(tmp_path),
        ranks="all",
        activities=["cpu"],
        export_type="chrome_trace",
    )
    base.update(kw)
    cfg = ProfilerConfig(**base).validate()
    return RankProfiler(0, cfg, run or str(tmp_path / "run"), agent=agent)


def one_window(rp, model):
    statuses = [rp.start_window(Window(0, 0, 1, 2), 0)]
    for k in range(3):
        model.train_step()
        statuses.append(rp.step(k))
    statuses.append(rp.stop_window())
    statuses.append(rp.wait_for_summaries(30))
    return statuses


def raiser(message, after=None):
    def fn(self, *a, **kw):
        if after is not None:
            after(self, *a, **kw)
        raise RuntimeError(message)

    return fn


def assert_disabled(rp, where, type_name, message):
    st = rp.status()
    assert st["state"] == "disabled"
    assert st["reason"]["where"] == where, st["reason"]
    assert st["reason"]["type"] == type_name
    assert message in st["reason"]["message"]
    assert st["phase"] == "idle"
    assert not torch._C._autograd._profiler_enabled()  # nothing left running


def test_fault_in_warm_up(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.profiler.profile, "start", raiser("no kineto"))
    rp = make(tmp_path)
    assert_disabled(rp, "warm_up", "RuntimeError", "no kineto")


@pytest.mark.parametrize(
    "method,where,wrap_real",
    [("start", "start_window", False), ("step", "step", False), ("stop", "step", True)],
)
def test_torch_raising_in_a_command(tmp_path, monkeypatch, method, where, wrap_real):
    rp = make(tmp_path)
    model = TinyMLP()
    real = getattr(torch.profiler.profile, method)
    monkeypatch.setattr(
        torch.profiler.profile, method, raiser("torch broke", real if wrap_real else None)
    )
    statuses = one_window(rp, model)  # raises nothing
    monkeypatch.undo()
    assert_disabled(rp, where, "RuntimeError", "torch broke")
    assert all(s["state"] in ("ok", "disabled") for s in statuses)
    assert one_window(rp, model)[-1]["windows_captured"] == 0  # stays off for the run


def test_unwritable_run_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    rp = make(tmp_path, run=str(blocker / "run"))
    one_window(rp, TinyMLP())
    st = rp.status()
    assert st["state"] == "disabled" and st["reason"]["where"] == "export"
    assert st["reason"]["type"] in ("NotADirectoryError", "FileExistsError")


def test_disk_full_while_compressing_keeps_the_plain_trace(tmp_path, monkeypatch):
    """The agent's own steps, run here so the fault can be injected."""
    rp = make(tmp_path, export_type="chrome_trace")
    one_window(rp, TinyMLP())
    plain = rp.status()["last_trace_path"]

    def full(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gzip, "open", full)
    job = TraceJob(0, 0, (1, 2), False, "cpu", 10, False, "chrome_trace_gz", plain, plain + ".gz")
    res = run_job(job)
    assert res.summary is not None and decode_summary(res.summary).steps == (1, 2)
    assert [(e["where"], e["type"]) for e in res.errors] == [("compress", "OSError")]
    assert res.trace_path == plain and os.path.exists(plain)
    assert [p.name for p in (tmp_path / "run").rglob("*") if p.is_file()] == ["rank0.pt.trace.json"]


def test_an_unreadable_trace_loses_that_windows_summary_only(tmp_path, monkeypatch):
    real = torch.profiler.profile.export_chrome_trace

    def truncated(self, path):
        real(self, path)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", truncated)
    rp = make(tmp_path, export_type="chrome_trace_gz")
    statuses = one_window(rp, TinyMLP())
    st = rp.status()
    assert st["state"] == "ok"  # profiling goes on
    (failure,) = [f for s in statuses for f in s["summary_failures"]]
    assert failure["window"] == 0 and failure["where"] == "summary"
    assert "not a valid chrome trace" in failure["message"]
    assert os.path.exists(failure["trace_path"])  # the raw trace stays for whoever looks
    assert not [b for s in statuses for b in s["summaries"]]
    monkeypatch.undo()
    assert [decode_summary(b).window for b in summaries(one_window(rp, TinyMLP()))] == [0]


class _DyingAgent(LocalAgentLink):
    """A real agent process that dies on its next job (fault injection)."""

    def submit(self, job):
        return self._executor().submit(os._exit, 3)


class _UnstartableAgent(LocalAgentLink):
    def prepare(self):
        raise RuntimeError("no room for another process")

    def submit(self, job):
        raise RuntimeError("no room for another process")


@pytest.mark.parametrize(
    "agent,message",
    [(_DyingAgent, "died or could not be reached"), (_UnstartableAgent, "no room")],
    ids=["dies", "cannot_start"],
)
def test_a_dead_agent_costs_one_summary_and_never_training(tmp_path, agent, message):
    rp = make(tmp_path, agent=agent(), export_type="chrome_trace_gz")
    statuses = one_window(rp, TinyMLP())
    st = rp.status()
    assert st["state"] == "ok" and st["summaries_pending"] == []
    assert message in st["last_agent_error"]["message"]
    (failure,) = [f for s in statuses for f in s["summary_failures"]]
    assert failure["where"] == "agent" and failure["window"] == 0
    assert failure["trace_path"].endswith("rank0.pt.trace.json") and os.path.exists(
        failure["trace_path"]
    )
    assert not torch._C._autograd._profiler_enabled()


def test_bad_window_from_the_coordinator(tmp_path):
    worker = ProfilerWorkerMixin()
    cfg = ProfilerConfig(enable=True, save_path=str(tmp_path), ranks="all", activities=["cpu"])
    worker.configure_profiler(0, cfg.to_dict(), str(tmp_path / "run"), warm_up=False)
    st = worker.start_profile({"index": 0, "warmup_start": 5, "first": 2, "last": 1}, 0)
    assert st["state"] == "disabled" and st["reason"]["where"] == "start_profile"


def test_bad_config_from_the_coordinator(tmp_path):
    worker = ProfilerWorkerMixin()
    st = worker.configure_profiler(0, {"enable": True, "actve": 1}, str(tmp_path))
    assert st["state"] == "disabled" and "did you mean 'active'" in st["reason"]["message"]


def test_calls_before_configure_are_harmless():
    worker = ProfilerWorkerMixin()
    assert worker.profile_step(3)["state"] == "not_configured"
    assert worker.stop_profile()["state"] == "not_configured"
    assert worker.start_profile({}, 0)["state"] == "not_configured"
    assert worker.dump_profiler_summary()["state"] == "not_configured"
