"""The attach hook's pure parts: its config section, reading RAY_PROFILER_CONFIG, who a process
is as a rank, and what the coordinator keeps of what an attached process sends."""

from __future__ import annotations

import pytest

from coordinator.core.attach import (
    MAX_CONFIG_BYTES,
    MAX_PROBLEM,
    Attach,
    attached_entry,
    identify,
    problem_entry,
    read_source,
    safe_id,
)
from coordinator.core.config import ProfilerConfig


def test_the_attach_section_round_trips_through_the_config():
    cfg = ProfilerConfig.from_dict(
        {"attach": {"trainer_id": "grpo", "actor_classes": ["PolicyWorker"], "name": "p2"}}
    )
    assert cfg.attach == Attach("grpo", "policy", ["PolicyWorker"], "p2", "profiler")
    assert ProfilerConfig.from_dict(cfg.to_dict()).attach == cfg.attach
    assert ProfilerConfig.from_dict({}).attach == Attach()  # (a record written before it)


@pytest.mark.parametrize(
    ("section", "names"),
    [
        ({"trainer_ids": "x"}, "unknown key 'attach.trainer_ids'; did you mean 'trainer_id'"),
        ({"trainer_id": "a b"}, "'attach.trainer_id'"),
        ({"role": None}, "'attach.role'"),
        ({"actor_classes": "PolicyWorker"}, "'attach.actor_classes'"),
        ({"actor_classes": []}, "'attach.actor_classes'"),
        ({"actor_classes": ["not a class"]}, "'attach.actor_classes'"),
        ({"name": None}, "'attach.name'"),
        ({"namespace": ""}, "'attach.namespace'"),
    ],
)
def test_a_bad_attach_section_names_its_field(section, names):
    with pytest.raises(ValueError, match=names.replace("(", r"\(").replace(")", r"\)")):
        ProfilerConfig.from_dict({"attach": section})


def test_attach_null_is_refused_by_name():
    with pytest.raises(ValueError, match="'attach' must be a mapping"):
        ProfilerConfig.from_dict({"attach": None})


def test_identity_prefers_torch_distributed_then_ray_train_then_the_actor():
    a = Attach()
    assert identify(a, (3, 8), (0, 2, "sft"), ("RayTrainWorker", 1, 2)).rank == 3
    t = identify(a, None, (1, 2, "sft run/7"), ("RayTrainWorker", 0, 2))
    assert (t.trainer_id, t.rank, t.world_size, t.source) == ("sft_run_7", 1, 2, "ray.train")
    act = identify(a, None, None, ("Critic", 2, 3))
    assert (act.trainer_id, act.rank, act.world_size, act.source) == ("attached.Critic", 2, 3,
                                                                        "actor")  # fmt: skip
    # Two actor groups with their own process groups are two trainers, numbered each from 0.
    pol = identify(a, (0, 2), None, ("Policy", 0, 2))
    cri = identify(a, (0, 2), None, ("Critic", 0, 2))
    assert pol.trainer_id != cri.trainer_id
    assert identify(Attach(trainer_id="grpo"), (0, 2), None, ("Policy", 0, 2)).trainer_id == (
        "grpo.Policy"
    )


def test_a_process_with_no_identity_or_another_class_says_why():
    assert "no rank identity" in identify(Attach(), None, None, None)
    why = identify(Attach(actor_classes=["Policy"]), (0, 2), None, ("RewardModel", 0, 1))
    assert why == "actor class 'RewardModel' is not in attach.actor_classes ['Policy']"
    assert "not an actor" in identify(Attach(actor_classes=["Policy"]), (0, 2), None, None)


def test_safe_id_makes_any_name_a_trainer_id():
    assert safe_id("TorchTrainer_2026-12-05 17:00") == "TorchTrainer_2026-12-05_17_00"
    assert safe_id("..//") == "attached"
    assert len(safe_id("x" * 500)) == 64


def test_the_config_comes_from_a_file_or_the_text(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("profiler:\n  enable: true\n  active: 2\n")
    assert dict(read_source(str(path))) == {"enable": True, "active": 2}
    assert dict(read_source("{enable: true, active: 5}")) == {"enable": True, "active": 5}
    assert dict(read_source("enable: false\nwait: 3\n")) == {"enable": False, "wait": 3}


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (None, "RAY_PROFILER_CONFIG is not set"),
        ("  ", "RAY_PROFILER_CONFIG is not set"),
        ("/nowhere/profiler.yaml", "file '/nowhere/profiler.yaml' cannot be read"),
        ("{enable: [", "is not valid YAML"),
        ("- 1\n- 2\n", "must hold a mapping of profiler fields, got list"),
        ("enable: true\n" + "#" * MAX_CONFIG_BYTES, "larger than"),
    ],
)
def test_a_config_that_cannot_be_read_says_what_to_do(value, says):
    with pytest.raises(ValueError, match=says):
        read_source(value)


def test_a_directory_as_the_config_path_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        read_source(str(tmp_path))


def test_what_an_attached_process_sends_is_bounded():
    entry = problem_entry(
        {"pid": 7, "node_id": "n" * 999, "trainer_id": "bad id", "rank": -1, "job_id": 3},
        "x" * 5000,
        now=1.0,
    )
    assert len(entry["problem"]) == MAX_PROBLEM and len(entry["node_id"] or "") == 200
    got = (entry["pid"], entry["trainer_id"], entry["rank"], entry["job_id"])
    assert got == (7, None, None, None)
    for where, problem in (({}, ""), ({}, None), ([], "x")):
        with pytest.raises(ValueError):
            problem_entry(where, problem, now=1.0)
    assert attached_entry({"source": "rootkit"}) is None and attached_entry("x") is None
    assert attached_entry({"source": "actor", "pid": True, "optimizer": 5}) == {
        "job_id": None, "actor_class": None, "pid": None, "node_id": None, "source": "actor",
        "optimizer": "?",
    }  # fmt: skip


def test_a_window_says_the_optimizer_steps_its_first_rank_gave_and_ignores_nonsense():
    from coordinator.core.records import WindowRecord
    from coordinator.core.schedule import Window
    from coordinator.core.state import _note_optimizer_steps, with_window

    keys = {("skyrl", 0), ("skyrl", 1)}
    rec = WindowRecord(window=Window(0, 2, 3, 4), participants=keys, acked=set(keys))
    rec.steps = (3, 4)
    for bad in ([7], [10, 7], [-1, 3], ["7", "10"], [True, 9], [7, 2**63], None, "7-10"):
        _note_optimizer_steps(rec, ("skyrl", 0), bad)
    assert rec.optimizer_steps == {}
    _note_optimizer_steps(rec, ("skyrl", 1), [8, 11])  # a rank other than 0, first: kept ...
    _note_optimizer_steps(rec, ("skyrl", 1), [9, 12])  # ... not written over by another
    assert rec.optimizer_steps == {"skyrl": (8, 11)}
    _note_optimizer_steps(rec, ("skyrl", 0), [7, 10])  # rank 0 wins
    assert rec.to_dict()["roles"]["skyrl"]["optimizer_steps"] == [7, 10]
    assert with_window(None, rec, "skyrl")["optimizer_steps"] == [7, 10]
    assert "optimizer_steps" not in with_window(None, rec, "other")


def test_skyrl_s_summary_is_read_from_its_own_trainer_s_last_window():
    """``dump_profiler_summary`` on a SkyRL worker answers from the last window its own trainer
    took part in, not a later one of another trainer (a reference model's, say)."""
    from worker_ext.rank.skyrl_profiler import last_window_of

    windows = [
        {"index": 0, "roles": {"skyrl": {}, "ref": {}}},
        {"index": 1, "roles": {"skyrl": {}}},
        {"index": 2, "roles": {"ref": {}}},
    ]
    assert last_window_of(windows, "skyrl") == 1
    assert last_window_of(windows, "ref") == 2
    assert last_window_of(windows, "critic") is None and last_window_of([], "skyrl") is None
