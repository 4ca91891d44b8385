"""The torch profiler of one window, in this process (no agent, no Ray: the fast tier): what
torch is asked to build, and that its results are freed in the closing step."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

from coordinator.core.schedule import Window
from tests.test_rank_profiler import cfg_for
from tests.torch_helpers import TinyMLP
from worker_ext.rank.torch_session import experimental_config, free_results, window_profiler


def _profiled_window(cfg, steps: int = 3):
    window = Window(index=0, warmup_start=0, first=1, last=steps - 1)
    prof = window_profiler(cfg, "cpu", 0, window, 0, lambda p: None)
    model = TinyMLP()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it drops trace_only: it must not
        prof.start()
        for _ in range(steps):
            model.train_step()
            prof.step()
        prof.stop()
    return prof


def _held() -> int:
    """torch profilers whose window results are still alive (``bench/window_cost.py``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (isinstance on torch's deprecated module objects)
        return sum(
            1
            for o in gc.get_objects()
            if isinstance(o, torch.profiler.profile)
            and getattr(getattr(o, "profiler", None), "kineto_results", None) is not None
        )


@pytest.mark.parametrize(
    "kw, trace_only",
    [
        ({}, True),
        ({"record_shapes": True, "with_flops": True, "profile_memory": True}, True),
        ({"with_stack": True}, False),  # torch refuses trace_only with stacks
        ({"with_stack": True, "export_type": "stacks"}, False),  # verbose, for folded stacks
    ],
)
def test_a_window_skips_torch_s_event_build_unless_it_needs_stacks(tmp_path, kw, trace_only):
    """Nothing in the rank reads torch's events (the agent reads the trace): torch is told not
    to build them in stop(), the closing step's largest share after stop and export."""
    cfg = cfg_for(tmp_path, **kw)
    made = experimental_config(cfg)
    assert (made is not None and made.trace_only) == trace_only
    prof = _profiled_window(cfg)
    if trace_only:
        with pytest.raises(RuntimeError, match="trace_only"):
            prof.events()
    else:
        assert len(prof.events()) > 0


@pytest.mark.parametrize("kw", [{}, {"with_stack": True}])
def test_a_closed_window_s_results_are_freed_at_once_not_by_a_later_collection(tmp_path, kw):
    """Left alone, a stopped window's results live on in a reference cycle until some garbage
    collection inside a later step frees them, with the GIL held (0.06-0.11 s for a trace-only
    window of 100,000 events, 0.2-0.35 s with torch's events): ``free_results`` frees them in
    the closing step. Without it they are still alive here, so this test fails on that stall."""
    gc.collect()
    before = _held()
    prof = _profiled_window(cfg_for(tmp_path, **kw))
    assert _held() == before + 1  # (what a later collection would have freed)
    free_results(prof)
    assert prof.profiler.kineto_results is None and _held() == before
    free_results(prof)  # (twice: nothing left, nothing raised)
