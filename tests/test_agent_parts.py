"""The node agent's parts that need no Ray: folding replies, batching partials, leaving when
idle. (The agent itself is exercised in a real cluster by tests/test_node_fanout.py and
tests/test_cluster.py.)"""

import asyncio
import logging

import pytest

from coordinator.core.partial import fold_summaries
from coordinator.protocol.partial_codec import decode_partial, encode_partial
from coordinator.protocol.summary_codec import KernelRow, RankSummary
from worker_ext.agent.idle_exit import IdleExit
from worker_ext.agent.partials import Gather, PartialRoutes, node_blob
from worker_ext.agent.rank_fanout import RankFanOut, command_problem

REPORT_TO = {"namespace": "ns", "name": "profiler", "trainer_id": "t", "run": "r1"}


def summary(rank, window=0):
    kernels = [KernelRow("aten::mm", 10.0 * (rank + 1), 1, 0)]
    return RankSummary(
        rank=rank, window=window, steps=(1, 2), partial=False, device="cpu", kernels=kernels
    )


def test_a_reply_is_forwarded_only_when_it_says_something_new():
    fan = RankFanOut("agent", "node")
    reply = {"state": "ok", "phase": "warmup", "window": 0, "closed": None, "summaries": []}
    assert fan._routine("o", ("t", 0), reply) is False  # the first: forwarded
    assert fan._routine("o", ("t", 0), {**reply, "phase": "recording"}) is True
    closed = {**reply, "closed": {"window": 0, "steps": [1, 2]}}
    assert fan._routine("o", ("t", 0), closed) is False  # news travels once...
    assert fan._routine("o", ("t", 0), reply) is True  # ...and is not news again
    assert fan._routine("o", ("t", 0), {**reply, "state": "disabled"}) is False
    assert fan._routine("other", ("t", 0), reply) is False  # another coordinator: its own
    assert fan._routine("o", ("t", 0), "not a dict") is False


@pytest.mark.parametrize(
    ("cmd", "problem"),
    [
        ([], "a dict with a 'nodes' dict"),
        ({"nodes": {}, "method": "rm -rf"}, "method must be one of"),
        ({"nodes": {}, "method": "profile_step", "args": [1]}, "names its owner"),
        (
            {"nodes": {}, "method": "profile_step", "args": [], "owner": "o", "timeout_s": 0},
            "timeout_s must be in",
        ),
        (
            {
                "nodes": {"n": {"ranks": [["t", 0]], "handles": []}},
                "method": "stop_profile",
                "args": [],
                "owner": "o",
                "timeout_s": 5,
            },
            "handles must match its ranks",
        ),
    ],
)
def test_a_malformed_node_command_is_refused_with_what_is_wrong(cmd, problem):
    assert problem in command_problem(cmd)


KEY = ("ns", "profiler", "t", "r1", 0)


def gather(pushed, linger_s):
    async def push(key, report_to, data):
        pushed.append(sorted(part.rank for part in decode_partial(data).ranks))
        return True

    return Gather(node_blob("node-1"), push, linger_s)


async def test_a_node_partial_is_pushed_once_every_expected_rank_is_in():
    pushed = []
    g = gather(pushed, linger_s=30.0)
    g.expect(KEY, {0, 1, 2})
    got = await asyncio.gather(*(g.add(KEY, REPORT_TO, r, summary(r)) for r in (2, 0, 1)))
    assert got == [True, True, True] and pushed == [[0, 1, 2]]


async def test_a_late_rank_does_not_hold_the_others_back_past_the_linger():
    pushed = []
    g = gather(pushed, linger_s=0.2)
    g.expect(KEY, {0, 1})
    assert await g.add(KEY, REPORT_TO, 0, summary(0)) is True  # rank 1 never comes...
    assert await g.add(KEY, REPORT_TO, 1, summary(1)) is True  # ...until late: on its own
    assert pushed == [[0], [1]]


async def test_a_failed_push_reaches_every_summary_of_the_partial():
    async def push(key, report_to, data):
        raise ConnectionError("the coordinator is gone")

    g = Gather(node_blob("node-1"), push, linger_s=0.05)
    results = await asyncio.gather(
        *(g.add(KEY, REPORT_TO, r, summary(r)) for r in (0, 1)), return_exceptions=True
    )
    assert [type(r).__name__ for r in results] == ["ConnectionError", "ConnectionError"]


def start_cmd(relay, nodes):
    return {
        "owner": "ns/profiler#0",
        "run": "r1",
        "relay": relay,
        "method": "start_profile",
        "args": [{"index": 0}, 0],
        "timeout_s": 5.0,
        "nodes": {
            n: {"agent": f"agent-{n}", "ranks": ranks, "handles": None}
            for n, ranks in nodes.items()
        },
        "idle_exit_s": 600.0,
    }


async def test_node_partials_meet_at_their_relay_and_reach_the_coordinator_merged():
    """Three agents' routes wired to each other in process: b and c send their node's
    partial to a, the relay, which pushes one merged partial."""
    coordinator = []

    async def to_coordinator(key, report_to, data):
        p = decode_partial(data)
        coordinator.append((p.source, sorted(part.rank for part in p.ranks)))
        return True

    routes = {}

    async def call_agent(name, method, *args):  # what NodeAgent.collect_partial does
        assert method == "collect_partial"
        return await routes[name].collect(*args)

    for name in ("agent-a", "agent-b", "agent-c"):
        routes[name] = PartialRoutes(name, call_agent, to_coordinator, linger_s=30.0)
    nodes = {"a": [("t", 0), ("t", 1)], "b": [("t", 2)], "c": [("t", 3)]}
    cmd = start_cmd("agent-a", nodes)
    routes["agent-a"].lead(cmd)
    for n, keys in nodes.items():
        routes[f"agent-{n}"].learn(cmd, n, keys)
    blobs = {
        n: encode_partial(fold_summaries(n, [summary(r) for _, r in keys]))
        for n, keys in nodes.items()
    }
    got = await asyncio.gather(
        *(routes[f"agent-{n}"].push(KEY, REPORT_TO, n, blob) for n, blob in blobs.items())
    )
    assert got == [True, True, True]
    assert coordinator == [("agent-a", [0, 1, 2, 3])]


async def test_a_node_whose_relay_is_gone_pushes_its_partial_itself(caplog):
    coordinator = []

    async def to_coordinator(key, report_to, data):
        coordinator.append(sorted(part.rank for part in decode_partial(data).ranks))
        return True

    async def call_agent(name, method, *args):
        raise ConnectionError(f"{name} is gone")

    b = PartialRoutes("agent-b", call_agent, to_coordinator)
    b.learn(start_cmd("agent-a", {"b": [("t", 2)]}), "b", [("t", 2)])
    blob = encode_partial(fold_summaries("b", [summary(2)]))
    with caplog.at_level(logging.WARNING, logger="worker_ext.agent.partials"):
        assert await b.push(KEY, REPORT_TO, "b", blob) is True
    assert coordinator == [[2]]
    # not in silence: the agent's log, and what the ranks' jobs report (next test)
    why = b.relay_failures[KEY]
    assert why["where"] == "relay" and why["type"] == "ConnectionError"
    assert why["message"].startswith("the relay agent-a did not take node b's partial of window")
    assert [r.getMessage() for r in caplog.records] == [why["message"]]


async def test_a_rank_whose_relay_failed_says_so_and_its_trace_report_does_not(tmp_path):
    """The agent's own glue (``NodeAgent._publish``, ``_stored``) on the real routes and
    node gather, the relay refusing: the rank's job says why, the push still succeeded."""
    from types import SimpleNamespace

    from coordinator.protocol.summary_codec import encode_summary
    from worker_ext.agent.node_agent import NodeAgent
    from worker_ext.agent.partials import group_key
    from worker_ext.agent.trace_jobs import JobResult, TraceJob

    async def to_coordinator(key, report_to, data):
        return True

    async def call_agent(name, method, *args):
        raise ConnectionError(f"{name} is gone")

    routes = PartialRoutes("agent-b", call_agent, to_coordinator)
    routes.learn(start_cmd("agent-a", {"b": [("t", 2)]}), "b", [("t", 2)])
    agent = SimpleNamespace(
        _routes=routes, _partials=Gather(node_blob("b"), routes.to_relay("b"), 0.05)
    )
    job = TraceJob(
        2, 0, (1, 2), False, "cpu", 20, False, "chrome_trace", "raw", "final", report_to=REPORT_TO
    )
    res = JobResult(window=0, pid=1)
    assert await NodeAgent._publish(agent, job, encode_summary(summary(2)), res) is True
    assert [e["where"] for e in res.errors] == ["relay"]
    assert res.errors[0] is routes.relay_failures[group_key(REPORT_TO, 0)]
    reports = []
    stored = SimpleNamespace(
        _traces=SimpleNamespace(add=lambda to, r: reports.append(r)), _node="b"
    )
    NodeAgent._stored(stored, job, res)
    assert reports[0]["error"] is None  # the trace itself is fine


async def test_a_lost_summary_the_coordinator_cannot_be_told_of_says_so(caplog):
    from types import SimpleNamespace

    from worker_ext.agent.node_agent import NodeAgent
    from worker_ext.agent.trace_jobs import TraceJob

    async def unreachable(report_to, method, *args):
        raise ConnectionError("the coordinator is gone")

    job = TraceJob(
        3, 4, (1, 2), False, "cpu", 20, False, "chrome_trace", "raw", "final", report_to=REPORT_TO
    )
    why = {"where": "summary", "type": "ValueError", "message": "not a trace"}
    with caplog.at_level(logging.WARNING, logger="worker_ext.agent.node_agent"):
        await NodeAgent._notify(SimpleNamespace(_call=unreachable), job, why)
    assert why["message"] == (
        "not a trace [the coordinator could not be told at once: ConnectionError: the "
        "coordinator is gone]"
    )  # the error the rank's next reply carries to the coordinator
    (record,) = caplog.records
    assert "rank 3's summary of window 4 is lost (not a trace)" in record.getMessage()


async def test_an_idle_agent_leaves_only_once_no_run_is_live():
    live, left = [True], []

    async def owners_live():
        return live[0]

    idle = IdleExit(0.3, owners_live, leave=lambda: left.append(True))
    idle.touch()
    await asyncio.sleep(1.0)
    assert left == []  # idle, but a run is live
    with idle.busy():
        live[0] = False
        await asyncio.sleep(1.0)
        assert left == []  # no live run, but busy
    await asyncio.sleep(1.0)
    assert left == [True]


async def test_an_idle_time_of_zero_never_leaves():
    left = []

    async def owners_live():
        return False

    idle = IdleExit(0.2, owners_live, leave=lambda: left.append(True))
    idle.touch(0)
    await asyncio.sleep(0.6)
    assert left == []


async def test_a_restarted_coordinator_s_first_command_drops_what_its_earlier_incarnations_left():
    """An agent outlives its coordinator's restarts: the handles and last replies kept for
    ``ns/profiler#0`` go at ``ns/profiler#1``'s first command; another coordinator's stay."""
    from coordinator.protocol.agent_rpc import ADOPT

    fan = RankFanOut("agent-n1", "n1")

    def adopt(owner, ranks):
        order = {"agent": "agent-n1", "ranks": ranks, "handles": [object() for _ in ranks]}
        cmd = {
            "owner": owner,
            "run": "r",
            "relay": "agent-n1",
            "method": ADOPT,
            "args": [],
            "timeout_s": 5.0,
            "nodes": {"n1": order},
        }
        return fan.command(cmd)

    await adopt("ns/profiler#0", [("t", 0), ("t", 1)])
    await adopt("ns/other#0", [("u", 0)])
    fan._routine("ns/profiler#0", ("t", 0), {"state": "ok"})  # a reply it forwarded
    assert len(fan.handles) == 3 and len(fan._last) == 1
    await adopt("ns/profiler#1", [("t", 0)])  # restarted: registered again
    assert sorted(fan.handles) == [("ns/other#0", "u", 0), ("ns/profiler#1", "t", 0)]
    assert fan._last == {}
    await adopt("ns/profiler#1", [("t", 1)])  # its own entries stay
    assert len(fan.handles) == 3
