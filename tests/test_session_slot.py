"""A process's one RankSession slot (issue 46, item 10): a session switched off frees it, a
refused one frees nothing of another's, and a framework training that raised without an
exception hook (Hugging Face's) does not keep the next one from attaching."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from worker_ext.rank.rank_session import RankSession, _claim, _off

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_session_switched_off_mid_run_frees_its_slot_and_only_its_own():
    a, b, c = (RankSession("t", 0, 1, None) for _ in range(3))
    try:
        assert _claim(a) is None
        refused = _claim(b)
        assert refused is not None and "already attached" in refused and "'t' rank 0" in refused
        _off(b, "attach", refused)  # (a refused session frees nothing of the first one's)
        assert _claim(c) is not None
        _off(a, "plan", "this rank's windows can no longer carry the run's numbers")
        assert _claim(c) is None  # a later attach in this process is not refused
    finally:
        _off(c, "test", "done")


FAILED_THEN_AGAIN = """
import os, ray, torch.distributed as dist
from trainers.framework_steps import FrameworkSteps
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
         runtime_env={{"env_vars": {{"PYTHONPATH": {root!r}, "RAY_AUTH_MODE": "disabled"}}}})
dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
cfg = {{"enable": True, "save_path": {save!r}, "skip_first": 1, "warmup": 0, "active": 5}}
first = FrameworkSteps(cfg, "hf", name="slot-test", namespace="slot-test")
first.begin(0)
for k in (1, 2, 3):  # the window opens at 2; the training then raises: no on_train_end
    first.step_ends(k)
assert first.session.phase == "recording", first.session.phase
second = FrameworkSteps(cfg, "hf", name="slot-test", namespace="slot-test")
second.begin(3)  # trainer.train() again, with a new callback
print("SECOND", second.session.enabled, second.session.disabled_reason)
print("FIRST", first.session)
second.end(finished=True)
ray.kill(ray.get_actor("slot-test", namespace="slot-test"))
"""


@pytest.mark.subprocess
def test_a_framework_training_that_raised_does_not_keep_the_next_one_from_attaching(tmp_path):
    code = FAILED_THEN_AGAIN.format(root=ROOT, store=tmp_path / "store", save=str(tmp_path))
    env = {**os.environ, "PYTHONPATH": ROOT, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SECOND True None" in proc.stdout and "FIRST None" in proc.stdout, proc.stdout
