"""The ``dataloader`` rule live (issue 57): two reference SFT ranks on gloo, real
torch.profiler, the node agent's summaries, the coordinator's ``advise()``. Each step a rank
first draws a batch from its DataLoader (``num_workers=0``) over a Dataset whose items sleep
``ITEM_S`` on rank 1: ``dataloader`` names rank 1 at that time within 30%, the others' wait for
it at the all-reduce is not named again, and ``summarise --advise`` on the run's traces names
the same; without the sleep, ``dataloader`` stays quiet. (The reference ranks zero their
gradients with ``zero_grad(set_to_none=False)``: ``zero_grad`` names them, at its small cost.)
"""

from __future__ import annotations

import glob
import os
from typing import Any

import pytest

from tests.late_window import late_window
from trainers.reference.workers import PolicyWorker

pytestmark = pytest.mark.ray

ITEM_S = 0.01
BATCH = 4
INJECTED_MS = ITEM_S * BATCH * 1e3


class _Items:
    """A map-style Dataset whose items sleep the worker's ``item_s``."""

    def __init__(self, worker: LoaderPolicyWorker) -> None:
        self.worker = worker

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> int:
        if self.worker.item_s:
            import time

            time.sleep(self.worker.item_s)
        return i


class LoaderPolicyWorker(PolicyWorker):
    """A reference policy rank that draws a DataLoader batch before each SFT step."""

    item_s = 0.0
    _batches: Any = None

    def set_late(self, late_s: float) -> bool:
        self.item_s = late_s
        return True

    def sft_step(self, rows: Any) -> float:
        if self._batches is None:
            from torch.utils.data import DataLoader

            self._batches = iter(DataLoader(_Items(self), batch_size=BATCH))  # type: ignore[arg-type]
        next(self._batches)
        return super().sft_step(rows)


@pytest.fixture(scope="module")
def loader_pair(ray_session):
    from tests.ray_workers import gloo_pair

    with gloo_pair(ray_session, LoaderPolicyWorker) as workers:
        yield workers


def _advise(ray: Any, workers: list[Any], tmp_path: Any, late: dict[int, float]) -> Any:
    return late_window(ray, workers, tmp_path, late, lambda c, _: ray.get(c.advise.remote()))


def test_dataloader_names_the_rank_whose_items_sleep_live_and_offline(
    ray_session, loader_pair, tmp_path, capsys
):
    from tests.test_findings_offline import advise_json, by_rule

    reply = _advise(ray_session, loader_pair, tmp_path, {1: ITEM_S})
    found = by_rule(reply)
    f = found["dataloader"]
    assert f["ranks"] == [1], reply
    assert f["cost_ms_per_step"] == pytest.approx(INJECTED_MS, rel=0.3), f
    wait = found.get("collective_wait", {"ranks": []})  # the others' wait is its data loading
    assert 1 not in wait["ranks"] or wait["cost_ms_per_step"] < 0.3 * INJECTED_MS, wait
    assert found["zero_grad"]["all_ranks"], found  # the reference ranks' own zeroing
    traces = sorted(glob.glob(str(tmp_path / "**" / "*.json*"), recursive=True))
    folders = {os.path.dirname(t) for t in traces if "rank" in os.path.basename(t)}
    assert len(folders) == 1, traces
    offline = by_rule(advise_json(capsys, folders.pop()))
    assert offline["dataloader"]["ranks"] == [1]
    assert offline["dataloader"]["cost_ms_per_step"] == pytest.approx(
        f["cost_ms_per_step"], rel=0.05
    )


def test_without_the_sleep_dataloader_is_quiet_live(ray_session, loader_pair, tmp_path):
    reply = _advise(ray_session, loader_pair, tmp_path, {})
    assert "dataloader" in reply["quiet"], reply
    for f in reply["findings"]:
        assert 1 not in f["ranks"] or f["cost_ms_per_step"] < 0.5 * INJECTED_MS, f
