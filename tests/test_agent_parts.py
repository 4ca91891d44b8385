"""The node agent's parts that need no Ray: folding replies, batching partials, leaving when
idle. (The agent itself is exercised in a real cluster by tests/test_node_fanout.py and
tests/test_cluster.py.)"""

import asyncio

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


async def test_a_node_whose_relay_is_gone_pushes_its_partial_itself():
    coordinator = []

    async def to_coordinator(key, report_to, data):
        coordinator.append(sorted(part.rank for part in decode_partial(data).ranks))
        return True

    async def call_agent(name, method, *args):
        raise ConnectionError(f"{name} is gone")

    b = PartialRoutes("agent-b", call_agent, to_coordinator)
    b.learn(start_cmd("agent-a", {"b": [("t", 2)]}), "b", [("t", 2)])
    blob = encode_partial(fold_summaries("b", [summary(2)]))
    assert await b.push(KEY, REPORT_TO, "b", blob) is True
    assert coordinator == [[2]]


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
