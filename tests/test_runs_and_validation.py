"""Runs, attach decisions and the argument checks on their own: pure, without Ray."""

import pytest

from coordinator.core.config import ProfilerConfig
from coordinator.core.records import TrainerRecord
from coordinator.core.run import attach_decision, config_diff, new_run, unique_run_name
from coordinator.core.validate import (
    MAX_WORLD,
    flag_problem,
    is_number,
    is_rank,
    is_step,
    rank_handles,
    role_problem,
    span,
    step_problem,
    trainer_id_problem,
)

CFG = ProfilerConfig(enable=True, save_path="/tmp/prof", run_name="job")


def run(lifecycle="configured", trainers=(), stepping=None, cfg=CFG):
    r = new_run(cfg, set())
    r.lifecycle = lifecycle
    for tid in trainers:
        r.state.trainers[tid] = TrainerRecord(tid, "policy", [0], {}, None)
    r.state.stepping_trainer = stepping
    return r


def test_a_run_that_never_had_a_trainer_is_joined_or_replaced():
    assert attach_decision(run(), CFG.to_dict(), "t", True) == ("join", [])
    other = ProfilerConfig(enable=True, save_path="/tmp/prof", run_name="job", active=5)
    assert attach_decision(run(), other.to_dict(), "t", True) == ("fresh", ["active"])


def test_a_stopped_run_gives_way_to_a_fresh_one():
    r = run("stopped", ["t"], "t")
    assert attach_decision(r, CFG.to_dict(), "t", True)[0] == "fresh"


def test_the_stepping_trainer_coming_back_resumes_its_run_whatever_its_config():
    r = run("running", ["t"], "t")
    other = {**CFG.to_dict(), "active": 9}
    assert attach_decision(r, other, "t", stepping_alive=False) == ("resume", ["active"])


def test_another_trainer_joins_with_the_same_config_and_clashes_with_another():
    r = run("running", ["t"], "t")
    assert attach_decision(r, CFG.to_dict(), "u", True) == ("join", [])
    assert attach_decision(r, {**CFG.to_dict(), "wait": 3}, "u", True) == ("conflict", ["wait"])


def test_a_run_whose_stepping_trainer_died_without_a_stop_is_replaced():
    r = run("running", ["t"], "t")
    assert attach_decision(r, {**CFG.to_dict(), "wait": 3}, "u", False)[0] == "fresh"


def test_a_default_run_name_matches_any_run_name():
    assert config_diff(CFG.to_dict(), {**CFG.to_dict(), "run_name": None}) == []


def test_run_names_and_directories_are_never_reused():
    assert unique_run_name("job", {"job", "job.2"}) == "job.3"
    r = new_run(CFG, {"job"})
    assert r.name == "job.2" and r.run_dir == "/tmp/prof/job.2" and r.lifecycle == "configured"
    assert r.info()["lifecycle"] == "configured"


@pytest.mark.parametrize("value", [0, 5, 2**63 - 1])
def test_steps_are_ints_that_fit_an_int64(value):
    assert is_step(value) and step_problem("step", value) is None


@pytest.mark.parametrize("value", [-1, 2**63, True, 1.0, "3", None])
def test_anything_else_is_not_a_step_and_the_message_shows_it(value):
    assert not is_step(value)
    assert step_problem("step", value).startswith("step must be an int in 0..2**63-1, got ")


def test_ranks_stay_below_the_world_limit():
    assert is_rank(0) and is_rank(MAX_WORLD - 1)
    assert not is_rank(MAX_WORLD) and not is_rank(-1) and not is_rank(False)


def test_numbers_are_finite_and_not_bools():
    assert is_number(1) and is_number(0.5)
    assert not any(is_number(v) for v in (float("nan"), float("inf"), True, "1"))


def test_flags_roles_and_trainer_ids_say_what_is_wrong():
    assert flag_problem("waiting", True) is None
    assert flag_problem("waiting", 1) == "waiting must be True or False, got 1"
    assert flag_problem("advances_step", None, none_ok=True) is None
    assert flag_problem("advances_step", "y", none_ok=True) == (
        "advances_step must be True, False or None, got 'y'"
    )
    assert role_problem("rollout") is None and "1-64 letters" in role_problem("r" * 65)
    assert "1-64 letters" in role_problem("../x")
    assert trainer_id_problem("sft-1.a_b") is None
    assert "1-64 letters" in trainer_id_problem("../etc")
    assert "1-64 letters" in trainer_id_problem("x" * 65)


def test_worker_lists_and_dicts_become_rank_handles():
    assert rank_handles("t", ["a", "b"]) == {0: "a", 1: "b"}
    assert rank_handles("t", {3: "c"}) == {3: "c"}
    with pytest.raises(ValueError, match="no workers given"):
        rank_handles("t", [])
    with pytest.raises(ValueError, match="worker rank str '0' is not an int"):
        rank_handles("t", {"0": "a"})
    with pytest.raises(ValueError, match="must be a list of actor handles"):
        rank_handles("t", "a")


def test_spans_are_short_whatever_the_number_of_ranks():
    assert span([0, 1, 2, 3]) == "0-3"
    assert span([0, 2]) == "[0, 2]"
    assert span(list(range(0, 100, 2))).endswith("(50 ranks)")
