"""Failures that stop something quietly are said at WARNING (issue 46, item 9): tracker figures
not asked or not answered, once until they come again; an SPMD rank's closing status not sent.
The coordinator's calls are replaced to inject the fault."""

from __future__ import annotations

import logging

from coordinator.client.tracker_feed import TrackerFeed
from worker_ext.rank.rank_session import RankSession


class _Refusing:
    """A coordinator whose every call fails to be sent."""

    def __getattr__(self, name):
        return self

    def remote(self, *args, **kwargs):
        raise ConnectionError("the coordinator is gone")


def test_tracker_figures_not_asked_are_said_once_until_they_come_again(caplog):
    clock = [0.0]
    feed = TrackerFeed(_Refusing(), lambda metrics, step: None, ask_every_s=1.0,
                       now=lambda: clock[0])  # fmt: skip
    with caplog.at_level(logging.WARNING):
        for step in range(5):
            clock[0] += 2.0
            feed.on_step(step, None)
    said = [r.getMessage() for r in caplog.records if "window figures" in r.getMessage()]
    assert len(said) == 1 and "were not asked (ConnectionError: the coordinator is gone)" in said[0]


def test_a_rank_s_status_not_sent_is_a_warning_that_names_its_cost(caplog):
    session = RankSession("sft", 3, 4, None)
    session.coordinator = _Refusing()
    with caplog.at_level(logging.WARNING):
        session._tell(7, {"state": "ok"})
    (said,) = [r for r in caplog.records if "could not send its status" in r.getMessage()]
    assert said.levelno == logging.WARNING and "will show it as late" in said.getMessage()
