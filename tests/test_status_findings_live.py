"""The latest window's findings in ``status()`` and in the trainer's tracker, on a real run
(issue 57): two reference SFT ranks in one gloo group, one late at each all-reduce
(``tests/late_window.py``). ``status()`` carries ``advise()``'s three costliest; the tracker
feed logs each rule's cost and the table of text (TensorBoard's event files read back); and a
rule that raises leaves ``status()`` of the run's record answering, with a problem line."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from coordinator.client.tracker_feed import FINDINGS_TEXT, TrackerFeed
from coordinator.core import findings as rules
from coordinator.core.trackers_config import Trackers
from coordinator.service.status_findings import MAKING, REMAKING, SHOWN, bounded
from tests.late_window import late_window
from tests.test_advise_live import LATE_S, late_pair  # noqa: F401 (a fixture)
from trainers.trackers import make_tracker

pytestmark = pytest.mark.ray


class Collected:
    """A trainer's own ``log`` that takes text too."""

    def __init__(self) -> None:
        self.metrics: list[tuple[int, dict]] = []
        self.texts: list[tuple[str, str, int]] = []

    def __call__(self, metrics: dict, step: int) -> None:
        self.metrics.append((step, dict(metrics)))

    def text(self, tag: str, text: str, step: int) -> None:
        self.texts.append((tag, text, step))


def test_status_and_the_tracker_carry_advise_s_costliest(
    ray_session,
    late_pair,  # noqa: F811 (test_advise_live's fixture, imported: one pair of ranks)
    tmp_path,
):
    pytest.importorskip("tensorboard", reason="the test extra installs tensorboard")
    ray, own = ray_session, Collected()
    sink = make_tracker(Trackers(tensorboard={"log_dir": str(tmp_path / "tb")}), "run", own)

    def read(coordinator, _):
        st = settled_status(ray, coordinator)
        again = ray.get(coordinator.status.remote())  # (polled: the same, kept)
        advise = ray.get(coordinator.advise.remote())
        feed = TrackerFeed(coordinator, sink)
        feed.flush(timeout_s=30.0)
        sink.close()
        record = ray.get(coordinator.flush_record.remote(30.0))
        return st, again, advise, feed, record

    st, again, advise, feed, record = late_window(ray, late_pair, tmp_path, {1: LATE_S}, read)
    assert feed.logged_windows[-1] == 0, feed.logged_windows
    (entry,) = st["findings"]
    assert entry == again["findings"][0] == bounded(advise), (entry, advise)
    assert entry["window"] == 0 and entry["trainer_id"] == "sft" and len(entry["findings"]) <= SHOWN
    top = entry["findings"][0]
    assert (top["rule"], top["ranks"]) == ("collective_wait", [1]), entry
    assert top["cost_ms_per_step"] == pytest.approx(LATE_S * 1e3, rel=0.3)

    (step, logged), *_ = [(k, m) for k, m in own.metrics if "profiler/findings" in m]
    for f in advise["findings"]:
        assert logged[f"profiler/finding/{f['rule']}_ms_per_step"] == f["cost_ms_per_step"]
    for rule in advise["quiet"]:
        assert logged[f"profiler/finding/{rule}_ms_per_step"] == 0.0
    assert logged["profiler/findings"] == len(advise["findings"])
    ((tag, text, at),) = own.texts
    assert (tag, at) == (FINDINGS_TEXT, step) and "| collective_wait | 1 |" in text, text
    assert tensorboard_text(tmp_path / "tb", FINDINGS_TEXT) == {step: text}
    assert record["error"] is None and record["pending"] == 0, record
    record_status_survives_a_rule_that_raises(record["dir"], entry)


def settled_status(ray, coordinator) -> dict:
    """``status()`` once its findings are made: it never waits for them, and says so while
    they are being made (the first poll after the window has them made in the background)."""
    deadline = time.monotonic() + 60.0
    while True:
        st = ray.get(coordinator.status.remote())
        making = [e for e in st["findings"] if {MAKING, REMAKING} & set(e["problems"])]
        if st["findings"] and not making:
            return st
        assert time.monotonic() < deadline, st["findings"]
        time.sleep(0.05)


def record_status_survives_a_rule_that_raises(record: str, live: dict) -> None:
    """From the run's record, ``status()`` carries the live findings; with a rule that
    raises, it still answers, its findings' problem line naming the fault."""
    from coordinator.ops.recorded import RecordedCoordinator, open_record

    st = asyncio.run(RecordedCoordinator(open_record(record)).call("status"))
    assert st["findings"] == [live], st["findings"]

    def broken(fig, th):
        raise RuntimeError("a rule's fault")

    mp = pytest.MonkeyPatch()
    try:  # (the fault injected; the record read anew, nothing kept of the first read)
        mp.setitem(rules.RULES, "straggler", dataclasses.replace(rules.RULES["straggler"],
                                                                 judge=broken))  # fmt: skip
        st = asyncio.run(RecordedCoordinator(open_record(record)).call("status"))
    finally:
        mp.undo()
    (entry,) = st["findings"]
    assert entry["findings"] == [] and entry["window"] == 0, entry
    assert entry["problems"] == ["the findings could not be made: RuntimeError: a rule's fault"]
    assert [w["index"] for w in st["windows"]] == [0], st["windows"]  # (the rest answers)


def tensorboard_text(log_dir, tag) -> dict[int, str]:
    """``add_text``'s strings of ``tag`` by step, read from the event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    events = acc.Tensors(f"{tag}/text_summary")
    return {e.step: e.tensor_proto.string_val[0].decode() for e in events}
