"""Window commands through node agents, with many simulated nodes on this machine (see
``tests/node_sim.py``): relays, forwarding, folded replies, and faults that stay per rank."""

import uuid

import pytest

from coordinator import get_or_create_coordinator
from coordinator.protocol.names import AGENT_NAMESPACE
from coordinator.service.node_fanout import group_size
from tests.configs import profiler_config
from tests.node_sim import PlainRank, SimNodeAgents

NODES, PER_NODE, AGENTS = 10, 1, 3  # 10 nodes: two relay groups, of 8 and 2


@pytest.fixture
def sim(ray_session, ray_actors, tmp_path):
    ray = ray_session
    tag = uuid.uuid4().hex[:6]
    names = [f"sim-{tag}-{i}" for i in range(AGENTS)]
    nodes = [f"node-{tag}-{n:02d}" for n in range(NODES)]
    agent_of = {node: names[n % AGENTS] for n, node in enumerate(nodes)}
    Agents = ray.remote(num_cpus=0)(SimNodeAgents)
    agents = [
        Agents.options(name=name, namespace=AGENT_NAMESPACE).remote(
            name, [x for x in nodes if agent_of[x] == name]
        )
        for name in names
    ]
    Rank = ray.remote(num_cpus=0)(PlainRank)
    ranks = [Rank.remote(node, agent_of[node]) for node in nodes for _ in range(PER_NODE)]
    cfg = profiler_config(tmp_path, wait=0, warmup=1, active=2, repeat=2, worker_timeout_s=3.0)
    coord = get_or_create_coordinator(cfg, name=f"fanout-{tag}", namespace="profiler-tests")
    ray_actors.extend([coord, *agents, *ranks])
    ray.get(coord.register.remote("t", ranks))
    ray.get(coord.start.remote("t", 0))
    return ray, coord, agents, ranks


def test_the_agents_keep_the_handles_from_the_registration_on(sim):
    """The first window's command need not carry every rank's handle: the registration
    handed them to the agents (an ``adopt`` command, which calls no rank)."""
    ray, coord, agents, ranks = sim
    held = sorted(k for keys in ray.get([a.held.remote() for a in agents]) for k in keys)
    assert held == [("t", r) for r in range(NODES * PER_NODE)]
    told = {c[0] for calls in commands(ray, ranks) for c in calls}
    assert told <= {"start_profile", "profile_step"}  # no rank was called for it
    st = ray.get(coord.status.remote())
    assert st["counters"].get("worker_rpcs_adopt", 0) == 0


def commands(ray, ranks):
    return [
        [c for c in calls if c[0] != "configure_profiler"]
        for calls in ray.get([r.told.remote() for r in ranks])
    ]


def test_every_rank_is_told_through_the_relays_of_its_group(sim):
    ray, coord, agents, ranks = sim
    assert group_size(NODES) == 8
    ranks_n = NODES * PER_NODE
    for k in range(6):  # two windows: warm-up 0, record 1-2 | warm-up 3, record 4-5
        ray.get(coord.step.remote("t", k))
    want = [("start_profile", 0), ("profile_step", 0), ("profile_step", 1), ("profile_step", 2)]
    want += [("start_profile", 1), ("profile_step", 3), ("profile_step", 4), ("profile_step", 5)]
    assert commands(ray, ranks) == [want] * len(ranks)
    st = ray.get(coord.status.remote())
    assert st["nodes"]["by_path"] == {"agent": NODES}
    serves = {
        rep["node_id"]: rep["agent"]["name"] for rep in ray.get([r.reply.remote() for r in ranks])
    }
    assert len(serves) == NODES and len(set(serves.values())) == AGENTS
    # Every node listed once, with the agent that serves it.
    assert {n["node"]: n["agent"] for n in st["nodes"]["listed"]} == serves
    c = st["counters"]
    assert c["node_commands"] == 2 * 8  # two groups, eight commands
    assert c.get("node_fallback_ranks", 0) == 0
    assert c["worker_rpcs_profile_step"] == 6 * len(ranks)
    assert {r["state"] for r in st["ranks"]} == {"ok"}
    assert [w["ranks"] for w in st["windows"]] == [list(range(ranks_n))] * 2


def test_a_rank_that_fails_or_hangs_is_marked_by_itself(sim):
    ray, coord, agents, ranks = sim
    ray.get(ranks[3].inject.remote(1, "raise"))
    ray.get(ranks[9].inject.remote(2, "hang"))  # in the second group
    for k in range(6):
        ray.get(coord.step.remote("t", k))
    st = ray.get(coord.status.remote())
    states = {r["rank"]: r["state"] for r in st["ranks"]}
    assert states.pop(3) == "disabled" and states.pop(9) == "unresponsive"
    assert set(states.values()) == {"ok"}
    reasons = {r["rank"]: r["reason"] for r in st["ranks"] if r["reason"]}
    assert "injected at step 1" in reasons[3]["message"]
    assert reasons[9]["type"] == "Timeout"
    assert st["nodes"]["by_path"] == {"agent": NODES}  # the agents themselves were fine
    told = commands(ray, ranks)
    assert ("start_profile", 1) not in told[3] and ("start_profile", 1) in told[4]
    assert st["windows"][1]["ranks"] == [r for r in range(NODES) if r not in (3, 9)]


def test_a_dead_agent_sends_its_nodes_direct_and_the_others_stay_on_agents(sim):
    ray, coord, agents, ranks = sim
    ray.get(coord.step.remote("t", 0))  # window 0 opened through the agents
    ray.kill(agents[1])  # hosts nodes 1, 4, 7; it relays no group (nodes 0's and 8's do)
    for k in range(1, 6):
        ray.get(coord.step.remote("t", k))
    st = ray.get(coord.status.remote())
    assert {r["state"] for r in st["ranks"]} == {"ok"}  # every rank still told
    paths = {n["node"][-2:]: n for n in st["nodes"]["listed"]}
    direct = sorted(k for k, n in paths.items() if n["path"] == "direct")
    assert direct == ["01", "04", "07"]
    assert all(paths[k]["reason"]["where"] == "relay" for k in direct)
    assert st["counters"]["node_fallback_ranks"] >= 3 * PER_NODE
    want = [("start_profile", 0), ("profile_step", 0), ("profile_step", 1), ("profile_step", 2)]
    want += [("start_profile", 1), ("profile_step", 3), ("profile_step", 4), ("profile_step", 5)]
    assert commands(ray, ranks) == [want] * len(ranks)


async def test_a_large_node_answer_is_folded_with_the_event_loop_let_go_between_nodes():
    """A relay's answer of thousands of ranks (8 a node) is folded in slices: a step report
    waits for one slice, not for the whole answer."""
    import asyncio

    from coordinator.core.config import ProfilerConfig
    from coordinator.core.records import TrainerRecord
    from coordinator.core.run import new_run
    from coordinator.core.schedule import Window
    from coordinator.protocol.replies import rank_reply
    from coordinator.service.node_fanout import YIELD_EVERY, NodeFanOut, NodeRoute

    n, per_node = 2048, 8
    run = new_run(
        ProfilerConfig.from_dict({"enable": True, "save_path": "/run"}, check_paths=False), set()
    )
    st = run.state
    st.register(TrainerRecord("t", "policy", list(range(n)), {}, "/run"), True, lambda r: True)
    keys = [("t", r) for r in range(n)]
    st.open_window(Window(0, 0, 1, 2), keys)
    closed = {"window": 0, "steps": [1, 2], "partial": False, "trace_path": "/run/w/r.json"}
    by_node = {f"n{i}": keys[i * per_node : (i + 1) * per_node] for i in range(n // per_node)}
    reply = {
        "relay": "a",
        "nodes": [
            {
                "node": node,
                "agent": "a",
                "answered": [],
                "replies": [
                    (t, r, dict(rank_reply(rank=r, closed=closed, summaries_pending=[0])))
                    for t, r in ks
                ],
                "failed": [],
                "unknown": [],
                "error": None,
            }
            for node, ks in by_node.items()
        ],
    }
    fanout = NodeFanOut("owner")
    fanout.routes = {node: NodeRoute(node, "a") for node in by_node}
    turns = 0

    async def other_calls() -> None:
        nonlocal turns
        while True:
            await asyncio.sleep(0)
            turns += 1

    other = asyncio.ensure_future(other_calls())
    await asyncio.sleep(0)
    before = turns
    direct = await fanout._apply(run, reply, by_node, "profile_step")
    other.cancel()
    assert direct == []
    assert turns - before >= n // YIELD_EVERY - 1
    assert st.windows[0].acked == set(keys)
    assert st.windows[0].summaries_pending == set(keys)


async def test_a_relay_s_answer_is_folded_while_a_slower_relay_s_is_on_its_way():
    """Each group's answer goes into the run as it comes: the replies of a fast relay's group
    are in the rank records while another relay has not answered yet."""
    import asyncio

    from coordinator.core.config import ProfilerConfig
    from coordinator.core.records import TrainerRecord
    from coordinator.core.run import new_run
    from coordinator.core.schedule import Window
    from coordinator.protocol.replies import rank_reply
    from coordinator.service.node_fanout import NodeFanOut

    n = 24  # 24 nodes of one rank: three relay groups of 8 (group_size)
    cfg = {"enable": True, "save_path": "/run"}
    run = new_run(ProfilerConfig.from_dict(cfg, check_paths=False), set())
    st = run.state
    handles = {r: f"handle-{r}" for r in range(n)}
    st.register(TrainerRecord("t", "policy", list(range(n)), handles, "/run"), True, lambda r: 1)
    for r in range(n):
        agent = {"kind": "node_agent", "pid": 1, "name": f"agent-{r:02d}"}
        st.apply_reply(("t", r), rank_reply(rank=r, node_id=f"node-{r:02d}", agent=agent))
    keys = [("t", r) for r in range(n)]
    st.open_window(Window(0, 0, 1, 2), keys)
    slow = asyncio.Event()

    class Relays(NodeFanOut):
        async def _send(self, cmd, group, timeout):
            if "node-23" in cmd["nodes"]:
                await slow.wait()  # the last group's relay answers when told to
            nodes = []
            for node, order in cmd["nodes"].items():
                ranks = order["ranks"]
                replies = [(t, r, rank_reply(rank=r, windows_captured=3)) for t, r in ranks]
                nodes.append({"node": node, "agent": order["agent"], "answered": []})
                nodes[-1] |= {"replies": replies, "failed": [], "unknown": [], "error": None}
            return {"relay": cmd["relay"], "nodes": nodes}, None

    fanout = Relays("owner")
    task = asyncio.ensure_future(fanout.fan_out(run, keys, "start_profile", [{}, 0], 5.0))
    for _ in range(50):
        await asyncio.sleep(0)
    told = [k for k in keys if st.ranks[k].windows_captured == 3]
    assert told == keys[:16] and not task.done()  # two groups of eight in, one on its way
    assert st.counters["worker_rpcs_start_profile"] == 16
    slow.set()
    assert await task == []
    assert all(st.ranks[k].windows_captured == 3 for k in keys)
