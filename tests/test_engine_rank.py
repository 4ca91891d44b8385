"""The engine adapter in one process, on the small real engine: its windows, and every fault of
an engine's profiler kept inside the rank (the engine goes on generating)."""

from __future__ import annotations

import os

import pytest
import torch

from coordinator.core.schedule import Window
from coordinator.protocol.summary_codec import decode_summary
from tests.configs import profiler_config
from trainers.reference.engine import FixedDirEngine, TinyEngine
from trainers.reference.model import CausalLM, ModelConfig
from worker_ext.rank.engine_rank import EngineProfilerMixin


class Generator(EngineProfilerMixin):
    """An actor class as a user writes one (used here without Ray)."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, n=4):
        gen = torch.Generator().manual_seed(0)
        return self.engine.model.sample(torch.zeros(2, 4, dtype=torch.long), n, gen)


class NoTraceEngine(TinyEngine):
    """A fault: stop_profile() returns but no trace is ever written."""

    def stop_profile(self):
        self.stops = getattr(self, "stops", 0) + 1
        self._prof.stop()
        self._prof = None


class AsyncEngine(TinyEngine):
    """A fault: an async engine handed over as it is."""

    async def start_profile(self, output_dir=None):
        raise AssertionError("never awaited")


class BrokenEngine(TinyEngine):
    """A fault: the engine's profiler cannot start."""

    def start_profile(self, output_dir=None):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")


def engine(cls=TinyEngine, **kw):
    torch.set_num_threads(1)
    return cls(CausalLM(ModelConfig()), **kw)


def configure(actor, tmp_path, rank=0, role="rollout", **cfg):
    cfg.setdefault("roles", {"rollout": {"ranks": [0]}})
    config = profiler_config(tmp_path, **cfg).to_dict()
    return actor.configure_profiler(rank, config, str(tmp_path / "run"), True, None, role)


def run_window(actor, window, first_step=0):
    replies = [actor.start_profile(window.to_dict(), first_step)]
    for k in range(first_step, window.last + 1):
        actor.generate()
        replies.append(actor.profile_step(k))
    return replies


@pytest.mark.subprocess  # the local agent: a process of its own
def test_a_window_records_the_engine_from_its_first_recorded_step_to_its_last(tmp_path):
    actor = Generator(engine())
    assert configure(actor, tmp_path)["state"] == "ok"
    replies = run_window(actor, Window(0, 1, 2, 3))  # warm-up from 1, records 2-3
    assert [r["phase"] for r in replies] == ["warmup", "warmup", "recording", "recording", "idle"]
    assert actor.engine.traces_written == 1
    closed = replies[-1]["closed"]
    assert closed["steps"] == [2, 3] and not closed["partial"]
    assert closed["trace_path"] == str(
        tmp_path / "run" / "window_0000_steps_2-3" / "rollout" / "rank0.pt.trace.json.gz"
    )
    done = actor.dump_profiler_summary(wait_s=60)
    (summary,) = [decode_summary(b) for b in done["summaries"]]
    assert summary.rank == 0 and summary.steps == (2, 3)
    assert "aten::multinomial" in {k.name for k in summary.kernels}


@pytest.mark.subprocess  # the local agent: a process of its own
def test_an_engine_writing_into_its_own_directory_is_read_from_there(tmp_path):
    fixed = tmp_path / "vllm"
    actor = Generator(engine(FixedDirEngine, trace_dir=str(fixed)))
    actor.engine_trace_dir = str(fixed)
    fixed.mkdir()
    (fixed / "old.pt.trace.json").write_text("{}")  # an earlier trace is not this window's
    configure(actor, tmp_path, export_type="chrome_trace")
    closed = run_window(actor, Window(0, 0, 0, 1))[-1]["closed"]
    assert closed["trace_path"].endswith("window_0000_steps_0-1/rollout/rank0.pt.trace.json")
    assert os.listdir(fixed) == ["old.pt.trace.json"]
    assert actor.dump_profiler_summary(wait_s=60)["summaries"]


def test_faults_disable_the_rank_and_never_reach_the_engine(tmp_path):
    # no output_dir and no engine_trace_dir: refused at configure, saying what to set
    plain = Generator(engine(FixedDirEngine))
    st = configure(plain, tmp_path)
    assert st["state"] == "disabled" and "set engine_trace_dir" in st["reason"]["message"]
    # the engine's profiler cannot start: that rank is disabled, generation goes on
    broken = Generator(engine(BrokenEngine))
    configure(broken, tmp_path)
    replies = run_window(broken, Window(0, 0, 0, 1))
    assert replies[-1]["state"] == "disabled" and replies[-1]["reason"]["where"] == "start_profile"
    assert "CUPTI" in replies[-1]["reason"]["message"]
    assert broken.generate().shape == (2, 8)
    # an async engine as it is: refused with what to do, nothing left un-awaited
    run = Generator(engine(AsyncEngine))
    configure(run, tmp_path)
    st = run.start_profile(Window(0, 0, 0, 1).to_dict(), 0)
    assert st["state"] == "disabled" and "start_profile() is async" in st["reason"]["message"]
    # the engine writes nothing: disabled after the bounded wait, its profiler stopped once
    silent = Generator(engine(NoTraceEngine))
    silent.engine_trace_wait_s = 0.3
    configure(silent, tmp_path)
    last = run_window(silent, Window(0, 0, 0, 1))[-1]
    assert last["state"] == "disabled" and "wrote no trace" in last["reason"]["message"]
    assert silent.engine.stops == 1
    # a URL save_path: an engine rank writes locally only
    remote = Generator(engine())
    st = remote.configure_profiler(
        0, {**profiler_config(tmp_path).to_dict(), "save_path": "memory://x"}, "memory://x/run"
    )
    assert st["state"] == "disabled" and "local save_path" in st["reason"]["message"]


def test_an_unselected_role_and_a_stop_in_the_warm_up_touch_nothing(tmp_path):
    idle = Generator(engine(BrokenEngine))  # it would fail if the adapter touched it
    assert configure(idle, tmp_path, rank=1)["state"] == "not_selected"
    assert run_window(idle, Window(0, 0, 0, 1))[-1]["state"] == "not_selected"
    other = Generator(engine())
    st = configure(other, tmp_path, role="critic")  # roles names rollout only
    assert st["state"] == "not_selected"
    early = Generator(engine())
    configure(early, tmp_path)
    assert early.start_profile(Window(0, 0, 5, 6).to_dict(), 0)["phase"] == "warmup"
    assert early.stop_profile()["phase"] == "idle" and early.engine.traces_written == 0
    assert early.stop_profile()["state"] == "ok"  # safe to repeat
    assert early.engine._prof is None  # never started
