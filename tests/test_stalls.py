"""A real hang: 4 gloo ranks, rank 2 sleeps inside its step while the others wait in the
all-reduce. ``stacks()`` names it during the hang, the watchdog records the stall by itself,
and training ends with the losses of an unprofiled run."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid

import pytest

from coordinator.ops import notebook as nb
from coordinator.ops.cli import main as cli_main
from tests.configs import profiler_config
from tests.hang_workers import make_hanging_group
from trainers.hooks import ProfilingHooks
from trainers.reference.model import ModelConfig, sft_batch, sft_corpus

RANKS, STEPS, HANG_STEP, HANG_S = 4, 6, 4, 20.0


def train(ray, hooks, policy, seed=0):
    corpus, seq, losses = sft_corpus(), ModelConfig().seq_len, []
    with hooks.session(first_step=0):
        for step in range(STEPS):
            rows = sft_batch(corpus, step, 16, seq, seed)
            out = ray.get([w.train.remote(rows, step) for w in policy])
            losses.append(sum(out) / len(out))
            hooks.step(step)
    return losses


@pytest.fixture(scope="module")
def hanging(ray_session):
    policy = make_hanging_group(ray_session, RANKS)
    yield policy
    for h in policy:
        ray_session.kill(h)


def wait_for(what, timeout_s, every_s=0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(every_s)
    raise AssertionError(f"not within {timeout_s} s: {got!r:.500}")


def culprit_found(coord, ray, **kw):
    """The stacks once a culprit is named and the other ranks wait in one place (a rank still
    in its step's compute at a look, on a busy host, is looked at again)."""
    st = ray.get(coord.stacks.remote(**kw))
    ranks = [g for g in st["groups"] if g["who"] == "rank"]
    settled = sum(not g["culprit"] for g in ranks) <= 1
    return st if any(g["culprit"] for g in st["groups"]) and settled else None


def test_a_hung_rank_is_named_on_demand_and_by_the_watchdog(ray_session, hanging, tmp_path, capsys):
    ray, policy = ray_session, hanging
    for w in policy:
        w.reset.remote(0)
    off = train(ray, ProfilingHooks.attach({"enable": False}, policy), policy)

    ray.get([w.reset.remote(0) for w in policy])
    ray.get([w.hang.remote(HANG_STEP, [2], HANG_S) for w in policy])
    cfg = profiler_config(tmp_path, warmup=1, active=1, stall_min_s=4.0, stall_factor=5.0)
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    hooks = ProfilingHooks.attach(
        cfg, policy, trainer_id="sft", name=name, namespace="profiler-tests"
    )
    coord, result = hooks.coordinator, {}

    def loop():
        try:
            result["on"] = train(ray, hooks, policy)
        except BaseException as exc:  # shown by the assertion below
            result["error"] = exc

    trainer = threading.Thread(target=loop)
    trainer.start()
    try:
        # The window closes at step 1 with a waited report; reports of the idle steps after it
        # are throttled (one per 0.1 s), so during the hang the coordinator knows step 1, 2 or 3.
        wait_for(lambda: _at(ray, coord, 1, trainer, result), 60, every_s=0.2)
        on_demand = wait_for(lambda: culprit_found(coord, ray), 15)
        by_signal = culprit_found(coord, ray, method="faulthandler")
        where = ["--name", name, "--namespace", "profiler-tests"]
        assert cli_main(["stacks", *where]) == 0
        grouped = capsys.readouterr().out
        assert cli_main(["stacks", "--rank", "2", *where]) == 0
        raw = capsys.readouterr().out
        # Nobody to read is refused with what is registered, not answered with nothing.
        with pytest.raises(ray.exceptions.RayTaskError, match=r"no trainer 'nobody'.*\['sft'\]"):
            ray.get(coord.stacks.remote(trainer_id="nobody"))
        with pytest.raises(ray.exceptions.RayTaskError, match=r"ranks \[7\] not registered"):
            ray.get(coord.stacks.remote(ranks=[2, 7]))
        stall = wait_for(lambda: ray.get(coord.status.remote())["stalls"], 15)[0]
        trainer.join(timeout=120)
        assert not trainer.is_alive()
        resumed = lambda: ray.get(coord.status.remote())["stalls"][0]["resumed_step"]  # noqa: E731
        wait_for(resumed, 5, every_s=0.2)  # the watchdog's next tick (1 s) marks it
        final = ray.get(coord.status.remote())
        record = ray.get(coord.flush_record.remote(30.0))
    finally:
        ray.kill(coord)
        ray.get([w.hang.remote(-1, [], 0.0) for w in policy])

    for st in (on_demand, by_signal):
        assert st is not None, "faulthandler read no culprit"
        ranks = [g for g in st["groups"] if g["who"] == "rank"]
        assert [g["ranks"] for g in ranks] == [[2], [0, 1, 3]], st["lines"]
        hung, waiting = ranks
        assert hung["culprit"] and not waiting["culprit"]
        assert hung["stack"].startswith("slow_loader <- load_batch <- train"), hung["stack"]
        assert waiting["kind"] == "collective" and "all_reduce" in waiting["stack"]
        assert "rank 2 in slow_loader" in st["culprit"] and "3 ranks of sft" in st["culprit"]
        assert st["lines"][0].startswith("rank 2 (1): slow_loader <- load_batch")
        assert st["lines"][1].startswith("ranks 0-1, 3 (3): all_reduce")
        assert any(g["who"] == "driver" for g in st["groups"])  # the trainer's driver too
        assert not st["unreadable"], st["unreadable"]
    assert {e["method"] for e in on_demand["entries"]} == {"py-spy"}
    assert {e["method"] for e in by_signal["entries"] if e["who"] == "rank"} == {"faulthandler"}

    # What an operator reads: the CLI's grouped view, one rank's raw threads, a frame.
    print(grouped)
    assert "likely culprit: rank 2 in slow_loader" in grouped
    assert "rank 2 (1): slow_loader <- load_batch <- train  <- likely culprit" in grouped
    assert "sft rank 2 (pid" in raw and "    slow_loader (" in raw and "ranks 0-1" not in raw
    frame = nb.stacks_frame(on_demand)
    assert frame.loc[frame["culprit"], "rank"].tolist() == [2]
    assert set(frame["group"].dropna()) >= {"rank 2", "ranks 0-1, 3", "driver"}

    # The watchdog saw the same, unasked, once; it ended when the steps came back.
    assert stall["last_step"] in (1, 2, 3) and stall["trainer_id"] == "sft"
    assert "rank 2 in slow_loader" in stall["culprit"]
    assert stall["lines"][:2] == on_demand["lines"][:2]
    assert stall["flight_recorder"]["sft/0"]["reason"].startswith("not available")
    done = final["stalls"][0]
    assert len(final["stalls"]) == 1 and done["resumed_step"] == HANG_STEP
    assert final["counters"]["stalls"] == 1
    assert final["metrics"]["values"]["profiler_stalls"] == 1  # ray_profiler_stalls_total
    path = os.path.join(final["run_dir"], "stalls", "stall_1.json")
    assert done["path"] == path
    saved = wait_for(lambda: _saved_resumed(path), 5, every_s=0.2)
    assert saved["stall"]["culprit"] == stall["culprit"] and saved["stacks"]["groups"]
    assert saved["stall"]["resumed_step"] == HANG_STEP

    # The stall and its stacks outlive the cluster: the run's record holds them (stacks --from).
    assert record["error"] is None and record["pending"] == 0, record
    capsys.readouterr()
    assert cli_main(["stacks", "--from", final["run_dir"], "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(final["stalls"]))
    assert cli_main(["stacks", "--from", final["run_dir"]]) == 0
    recorded = capsys.readouterr().out
    assert f"resumed at step {HANG_STEP}" in recorded and "rank 2 in slow_loader" in recorded
    assert "  rank 2 (1): slow_loader <- load_batch <- train" in recorded

    # Training went on after the hang, exactly as it does unprofiled.
    assert result["on"] == off


def _saved_resumed(path):
    with open(path) as f:
        saved = json.load(f)
    return saved if saved["stall"]["resumed_step"] is not None else None


def _at(ray, coord, step, trainer, result):
    assert trainer.is_alive(), f"the training loop ended early: {result!r:.2000}"
    return (ray.get(coord.status.remote())["global_step"] or 0) >= step


async def test_a_stall_file_that_cannot_be_written_is_said_not_raised(tmp_path, caplog):
    """Not only OSError: a reply that will not serialise (here a circular list) is reported in
    the stall's ``error`` and the log, and leaves no half-written file."""
    import logging
    from types import SimpleNamespace

    from coordinator.service.stall_watchdog import StallWatchdog

    entry = {"index": 3, "path": None, "error": None, "lines": []}
    entry["lines"].append(entry["lines"])  # json: "Circular reference detected"
    run = SimpleNamespace(run_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="coordinator.service.stall_watchdog"):
        await StallWatchdog._write(None, run, entry, None)
    assert entry["path"] is None
    assert entry["error"] == "stall file: ValueError: Circular reference detected"
    assert "stall 3: no file written" in caplog.text
    assert os.listdir(tmp_path / "stalls") == []  # no stall_3.json.tmp left behind
