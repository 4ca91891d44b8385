"""Roles, pure: per-role selection in the config, which trainer a role names, each role's part
of a window (its ranks and traces its own), and the trace files an agent serves."""

from __future__ import annotations

import pytest

from coordinator.core.config import ProfilerConfig
from coordinator.core.records import TrainerRecord
from coordinator.core.roles import outside_ranks, role_ranks, trainer_of_role
from coordinator.core.schedule import Window
from coordinator.core.state import CoordinatorState, kernel_summary
from coordinator.protocol.summary_codec import KernelRow, RankSummary, encode_summary
from worker_ext.agent.node_agent import is_trace_file


def cfg(**kw):
    return ProfilerConfig.from_dict({"enable": True, "save_path": "/tmp/p", **kw})


def test_policy_keeps_the_top_level_ranks_and_a_role_named_nowhere_is_not_profiled():
    c = cfg(ranks=[0, 1], roles={"rollout": {"ranks": [0]}, "critic": {"ranks": "all"}})
    assert c.selects(1) and c.selects(1, "policy") and not c.selects(2, "policy")
    assert c.selects(0, "rollout") and not c.selects(1, "rollout")
    assert c.selects(123, "critic") and not c.selects(0, "reward")
    named = cfg(ranks=[0], roles={"policy": {"ranks": [3]}})  # roles overrides for policy
    assert named.selects(3) and not named.selects(0)
    assert role_ranks(c.ranks, c.roles, "reward") is None
    again = ProfilerConfig.from_dict(c.to_dict())
    assert again.roles == {"rollout": {"ranks": [0]}, "critic": {"ranks": "all"}}


@pytest.mark.parametrize(
    "roles, message",
    [
        (None, "'roles' must be a mapping"),
        ([0], "'roles' must be a mapping"),
        ({"rollout": None}, "'roles.rollout' must be a mapping like {ranks: [0]}"),
        ({"rollout": {"rnks": [0]}}, "unknown key 'roles.rollout.rnks'; did you mean 'ranks'?"),
        ({"rollout": {}}, "'roles.rollout' needs 'ranks'"),
        ({"rollout": {"ranks": None}}, "'roles.rollout.ranks' is None"),
        ({"rollout": {"ranks": []}}, "'roles.rollout.ranks' is empty"),
        ({"rollout": {"ranks": [-1]}}, "'roles.rollout.ranks' holds a negative rank -1"),
        ({"rollout": {"ranks": "some"}}, "'roles.rollout.ranks' must be a list of ints or 'all'"),
        ({"../x": {"ranks": [0]}}, "role must be 1-64 letters"),
        ({f"r{i}": {"ranks": [0]} for i in range(33)}, "more than 32"),
    ],
)
def test_bad_roles_are_refused_naming_the_role_and_field(roles, message):
    with pytest.raises(
        ValueError,
        match="profiler config: .*"
        + message.replace("[", r"\[").replace("{", r"\{").replace("?", r"\?"),
    ):
        cfg(roles=roles)


def test_a_role_names_one_trainer_or_says_why_not():
    roles = {"rl": "policy", "rl.rollout": "rollout", "a": "critic", "b": "critic"}
    assert trainer_of_role(roles, "rollout", None) == "rl.rollout"
    assert trainer_of_role(roles, "critic", "b") == "b"
    with pytest.raises(ValueError, match="no trainer has role 'reward'"):
        trainer_of_role(roles, "reward", None)
    with pytest.raises(ValueError, match=r"trainers \['a', 'b'\] all have role 'critic'"):
        trainer_of_role(roles, "critic", None)
    with pytest.raises(ValueError, match="trainer 'rl' has role 'policy', not 'rollout'"):
        trainer_of_role(roles, "rollout", "rl")
    assert outside_ranks([0, 4], [0, 1]) == [4] and outside_ranks("all", [0]) == []
    assert outside_ranks(None, [0]) == []


def summary(rank, name, us=100.0, steps=(2, 3)):
    step_us = [(s, 1000.0 * (rank + 1)) for s in range(steps[0], steps[1] + 1)]
    s = RankSummary(rank, 0, steps, False, "cpu", [KernelRow(name, us, 1, 0)], step_us=step_us)
    return encode_summary(s)


def test_each_role_has_its_own_part_of_a_window_even_when_ranks_share_numbers():
    st = CoordinatorState(max_windows=4)
    pol = st.register(TrainerRecord("rl", "policy", [0, 1], {}, "/r"), None, lambda r: True)
    gen = st.register(
        TrainerRecord("rl.rollout", "rollout", [0, 1], {}, "/r"), None, {0}.__contains__
    )
    rec = st.open_window(Window(0, 1, 2, 3), pol + gen)
    for key in pol + gen:
        role = "rollout" if key[0] == "rl.rollout" else "policy"
        path = f"/r/window_0000_steps_2-3/{role}/rank{key[1]}.pt.trace.json"
        st.apply_reply(
            key,
            {
                "state": "ok",
                "closed": {"window": 0, "steps": [2, 3], "partial": False, "trace_path": path},
            },
        )
        st.trace_stored(key, 0, path, None)
        st.ingest_summary(key, summary(key[1], "sample" if role == "rollout" else "mm"))
    st.close_window(rec)
    entry = rec.to_dict()
    assert entry["ranks"] == [0, 1] and entry["trace_dir"] == "/r/window_0000_steps_2-3/policy"
    assert entry["traces"][0]["path"].endswith("/policy/rank0.pt.trace.json")
    assert list(entry["roles"]) == ["rl", "rl.rollout"]  # the stepping trainer first
    part = entry["roles"]["rl.rollout"]
    assert part["role"] == "rollout" and part["ranks"] == [0] and part["rank_count"] == 1
    assert part["traces"][0]["path"].endswith("/rollout/rank0.pt.trace.json")
    assert part["trace_dir"] == "/r/window_0000_steps_2-3/rollout"
    assert part["busy_ms_per_step"] == 0.05 and part["step_ms"] == {2: 1.0, 3: 1.0}
    assert entry["roles"]["rl"]["step_ms"] == {2: 1.5, 3: 1.5}  # ranks 0 and 1: 1 and 2 ms
    # each role's own table: no op of one in the other's
    gen_table = kernel_summary(st, 0, 10, "rl.rollout")
    assert gen_table["role"] == "rollout" and [k["name"] for k in gen_table["kernels"]] == [
        "sample"
    ]
    assert [k["name"] for k in kernel_summary(st, 0, 10, None)["kernels"]] == ["mm"]


def test_the_agent_serves_trace_files_in_role_directories_and_nothing_else(tmp_path):
    good = tmp_path / "window_0001_steps_2-3" / "rollout" / "rank0.pt.trace.json.gz"
    old = tmp_path / "window_0002_steps_4-5" / "rank1.pt.trace.json"  # the layout before roles
    extra = tmp_path / "window_0003_steps_6-6" / "rollout" / "rank0-1.pt.trace.json"
    for p in (good, old, extra):
        p.parent.mkdir(parents=True)
        p.write_text("{}")
    assert is_trace_file(str(good)) and is_trace_file(str(old)) and is_trace_file(str(extra))
    bad = tmp_path / "window_0001_steps_2-3" / "rollout" / "secrets.txt"
    bad.write_text("x")
    deep = tmp_path / "window_0004_steps_1-1" / "a" / "b" / "rank0.pt.trace.json"
    deep.parent.mkdir(parents=True)
    deep.write_text("{}")
    assert not is_trace_file(str(bad)) and not is_trace_file(str(deep))
    assert not is_trace_file(
        str(tmp_path / "window_0001_steps_2-3" / ".." / "x" / "rank0.pt.trace.json")
    )


def test_a_long_rank_list_selects_exactly_its_ranks():
    import pickle

    odd = list(range(9999, -1, -2))
    for cfg in (
        ProfilerConfig(enable=True, ranks=odd, roles={"r": {"ranks": [3]}}),  # as given
        ProfilerConfig.from_dict(
            {"enable": True, "save_path": "/tmp", "ranks": odd, "roles": {"r": {"ranks": [3]}}}
        ),
    ):
        picked = [r for r in range(-1, 10_001) if cfg.selects(r)]
        assert picked == list(range(1, 10_000, 2))
        assert [r for r in range(6) if cfg.selects(r, "r")] == [3]
        assert not cfg.selects(3, "critic")
        cfg.ranks = [2]  # a new list: the set kept for the old one is not used
        assert cfg.selects(2) and not cfg.selects(1)
        assert "_rank_sets" not in pickle.loads(pickle.dumps(cfg)).__dict__
