"""A node agent's trace reports go in batches: one call per coordinator run about once a second."""

from __future__ import annotations

import asyncio

from worker_ext.agent.trace_reports import MAX_BATCH, TraceReports

RUN_A = {"namespace": "p", "name": "c", "trainer_id": "t", "run": "a"}
RUN_B = {**RUN_A, "run": "b"}


async def test_reports_of_one_run_go_together_and_each_run_apart():
    sent: list[tuple[str, list[int]]] = []

    async def send(report_to, reports):
        sent.append((report_to["run"], [r["rank"] for r in reports]))

    traces = TraceReports(send, linger_s=0.05)
    for rank in range(8):
        traces.add(RUN_A, {"rank": rank, "window": 0, "path": f"/w/rank{rank}"})
    traces.add(RUN_B, {"rank": 0, "window": 3, "path": "/w/b"})
    assert sent == []  # they wait for the others
    await asyncio.sleep(0.2)
    assert sorted(sent) == [("a", list(range(8))), ("b", [0])]
    assert traces.sent == 2


async def test_a_full_batch_goes_at_once_and_a_failing_send_loses_only_its_batch():
    sent: list[int] = []

    async def send(report_to, reports):
        if reports[0]["rank"] == -1:
            raise RuntimeError("the coordinator is restarting")
        sent.append(len(reports))

    traces = TraceReports(send, linger_s=30.0)
    traces.add(RUN_A, {"rank": -1})
    await traces.drain()  # a failed send raises nothing
    for rank in range(MAX_BATCH):
        traces.add(RUN_A, {"rank": rank})
    await asyncio.sleep(0.01)
    assert sent == [MAX_BATCH]  # not 30 s later
    for task in list(traces._tasks):  # (the linger of the first batch, still asleep)
        task.cancel()


async def test_send_now_sends_what_is_queued_without_waiting_for_the_linger():
    sent: list[int] = []

    async def send(report_to, reports):
        sent.append(len(reports))

    traces = TraceReports(send, linger_s=30.0)
    for rank in range(3):
        traces.add(RUN_A, {"rank": rank})
    traces.send_now()  # the agent finished its last trace job
    await asyncio.sleep(0.01)
    assert sent == [3]
    for task in list(traces._tasks):
        task.cancel()
