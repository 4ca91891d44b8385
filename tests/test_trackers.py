"""Figures in the trainer's tracker (issue 31, item 6): the ``trackers`` config, each settled
window's figures, the phase means at most once a second, and what TensorBoard's event files,
MLflow's local file store and W&B's offline run directory hold after a real run."""

from __future__ import annotations

import glob
import json
import os
import time
import uuid

import pytest

from coordinator.client.tracker_feed import PHASE_PREFIX, TrackerFeed
from coordinator.core.aggregate import WindowAggregate
from coordinator.core.config import ProfilerConfig
from coordinator.core.tracker_figures import metric_name, window_figures
from coordinator.core.trackers_config import Trackers
from tests.test_aggregate import summary

STEPS_OWN = 40  # 4 s: the figures of both windows (steps 3-4, 8-9) come in mid-run

# ------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("trackers", "message"),
    [
        (None, "'trackers' must be a mapping"),
        ({"tensorboard": None}, "'trackers.tensorboard' must be a mapping (log_dir)"),
        ({"tensorbord": {}}, "unknown key 'trackers.tensorbord'; did you mean 'tensorboard'"),
        ({"tensorboard": {}}, "'trackers.tensorboard.log_dir' must be a non-empty string"),
        ({"tensorboard": {"log_dir": " "}}, "'trackers.tensorboard.log_dir' must be a non-empty"),
        ({"mlflow": {"uri": "x"}}, "unknown key 'trackers.mlflow.uri'"),
        ({"mlflow": {"experiment": 3}}, "'trackers.mlflow.experiment' must be a non-empty string"),
        ({"wandb": {"mode": "online-ish"}}, "'trackers.wandb.mode' must be one of online, offline"),
    ],
)  # fmt: skip
def test_a_bad_trackers_config_is_refused_naming_the_field(trackers, message):
    with pytest.raises(ValueError) as err:
        ProfilerConfig.from_dict({"trackers": trackers})
    assert message in str(err.value)


def test_trackers_survive_the_round_trip_and_a_tracking_uri_s_password_is_never_shown():
    cfg = ProfilerConfig.from_dict(
        {
            "trackers": {
                "mlflow": {"tracking_uri": "https://me:secret@mlflow.example/"},
                "wandb": {"mode": "offline"},
            }
        }  # fmt: skip
    )
    assert ProfilerConfig.from_dict(cfg.to_dict()).trackers == cfg.trackers
    shown = json.dumps(cfg.public_dict())
    assert "secret" not in shown and "https://***@mlflow.example/" in shown
    assert ProfilerConfig().trackers == Trackers() and not Trackers().any()


# ------------------------------------------------------------------ figures


def test_a_window_s_figures_are_its_table_s_step_times_shares_kernels_and_marks():
    agg = WindowAggregate(0)
    agg.add(summary(0, [("aten::addmm", 300.0, 1), ("c10d::allreduce_", 100.0, 1)], (1000.0,)))
    agg.add(summary(1, [("aten::addmm", 300.0, 1)], (3000.0,)))
    ks = agg.to_dict(5, straggler_threshold=1.25)
    marks = {"kernels": [{"name": "aten::addmm", "ratio": 1.5}], "step_regressed": False}
    f = window_figures(ks, marks)
    assert f["profiler/step_ms_median"] == ks["stragglers"]["median_step_ms"] == 2.0
    assert f["profiler/step_ms_slowest"] == 3.0 and f["profiler/slowest_rank"] == 1
    assert f["profiler/kernel_share/aten__addmm"] == ks["kernels"][0]["share"]
    assert f["profiler/kernel_share/c10d__allreduce_"] == ks["kernels"][1]["share"]
    mean = ks["breakdown"]["mean"]
    assert f["profiler/share/compute"] == mean["compute_share"]
    assert f["profiler/share/idle"] == mean["other_share"]
    assert f["profiler/stragglers"] == len(ks["stragglers"]["flagged"]) == 1
    assert (f["profiler/marked"], f["profiler/marked_kernels"]) == (1.0, 1.0)
    unjudged = window_figures(ks, None)
    assert "profiler/marked" not in unjudged
    assert metric_name("rollout", "step_ms_median") == "profiler/rollout/step_ms_median"
    assert metric_name("policy", "kernel_share/void at::native::f<(int)1>") == (
        "profiler/kernel_share/void_at__native__f__int_1_"
    )


def record(index, closed=True, pending=(), recorded=True):
    from coordinator.core.records import WindowRecord
    from coordinator.core.schedule import Window

    rec = WindowRecord(Window(index, 10 * index, 10 * index + 1, 10 * index + 2), closed=closed)
    rec.summaries_pending = set(pending)
    if recorded:
        rec.steps = (10 * index + 1, 10 * index + 2)
        rec.aggregate("t")
    return rec


def test_settled_windows_are_given_in_order_and_none_is_skipped():
    from coordinator.core.tracker_figures import settled_after

    def got(records, after):
        return [r.window.index for r in settled_after(records, after)]

    done = [record(0), record(1, recorded=False), record(2)]
    assert got(reversed(done), -1) == [0, 2]  # in order; one that recorded nothing passed over
    assert got(done, 0) == [2] and got(done, 2) == []
    waiting = [record(0), record(1, pending=[("t", 1)]), record(2)]
    assert got(waiting, -1) == [0]  # window 2 waits for window 1's summaries
    assert got(waiting, 1) == [2]
    assert got([record(0, closed=False), record(1)], -1) == [1]  # (still open: not closed yet)


# --------------------------------------------------------------------- feed


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_phase_means_are_logged_at_most_once_a_second_and_the_rest_at_the_end():
    clock, logged = Clock(), []
    feed = TrackerFeed(None, lambda m, k: logged.append((k, m)), now=clock)  # no coordinator
    for k in range(6):  # 0.4 s a step: one log after step 2 (1.2 s), the rest at the end
        clock.t = 0.4 * (k + 1)
        feed.on_step(k, [k, 0.4, {"train": 0.1 * (k + 1)}])
    feed.flush(timeout_s=0)
    assert [k for k, _ in logged] == [2, 5]
    assert logged[0][1] == pytest.approx({f"{PHASE_PREFIX}step_ms": 400.0,
                                          f"{PHASE_PREFIX}train_ms": 200.0})  # fmt: skip
    assert logged[1][1][f"{PHASE_PREFIX}train_ms"] == pytest.approx(500.0)


def test_a_tracker_that_raises_is_dropped_and_training_goes_on():
    calls = []

    def broken(metrics, step):
        calls.append(step)
        raise RuntimeError("tracker down")

    clock = Clock()
    feed = TrackerFeed(None, broken, now=clock)
    for k in range(5):
        clock.t = 1.0 * (k + 1)
        feed.on_step(k, [k, 1.0, {}])  # never raises
    assert calls == [0] and not feed.on


# --------------------------------------------------------------- a real run


@pytest.mark.ray
def test_a_real_run_s_figures_are_read_back_from_each_tracker(
    ray_session, toy_workers, tmp_path, monkeypatch
):
    import ray

    from trainers.hooks import ProfilingHooks

    pytest.importorskip("tensorboard", reason="the test extra installs tensorboard")
    workers = toy_workers(2)
    cfg = {
        "enable": True, "save_path": str(tmp_path / "p"), "ranks": "all", "wait": 2,
        "warmup": 1, "active": 2, "repeat": 2, "export_type": "none",
        "trackers": {
            "tensorboard": {"log_dir": str(tmp_path / "tb")},
            "mlflow": {"tracking_uri": (tmp_path / "mlruns").as_uri(), "experiment": "prof"},
            "wandb": {"project": "prof", "mode": "offline"},
        },
    }  # fmt: skip
    own: list[tuple[int, dict]] = []
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # (MLflow 3 prefers a database)
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    hooks = ProfilingHooks.attach(cfg, workers, trainer_id="sft", name=name,
                                  namespace="profiler-tests",
                                  tracker=lambda m, k: own.append((k, dict(m))))  # fmt: skip
    try:
        with hooks.session(first_step=0):
            for k in range(12):  # windows at steps 3-4 and 8-9
                with hooks.region("train"):
                    ray.get([w.train_step.remote() for w in workers])
                hooks.step(k)
        tables = [ray.get(hooks.coordinator.kernel_summary.remote(window=i, top_k=5))
                  for i in (0, 1)]  # fmt: skip
    finally:
        ray.kill(hooks.coordinator)
        wandb_teardown()
    windows = [(k, m) for k, m in own if "profiler/step_ms_median" in m]
    assert [k for k, _ in windows] == [4, 9]  # each window at its last recorded step
    for (_, m), ks in zip(windows, tables, strict=True):  # what the live table says
        apart = ("profiler/marked", "profiler/finding")  # (the findings: test_status_findings)
        assert {k: v for k, v in m.items() if not k.startswith(apart)} == window_figures(ks, None)
        assert "profiler/finding/straggler_ms_per_step" in m  # (each rule that ran)
        assert m.get("profiler/marked", 0.0) == 0.0  # a steady run: nothing marked
    phases = [(k, m) for k, m in own if f"{PHASE_PREFIX}step_ms" in m]
    assert phases and all(m[f"{PHASE_PREFIX}train_ms"] > 0 for _, m in phases)
    want = {k: m["profiler/step_ms_median"] for k, m in windows}
    assert tensorboard_scalars(tmp_path / "tb", "profiler/step_ms_median") == want
    assert mlflow_metric(tmp_path / "mlruns", "profiler/step_ms_median") == want
    assert wandb_history(tmp_path, "profiler/step_ms_median") == want


def wandb_teardown() -> None:
    """W&B keeps its settings (its directory among them) for the process: a test's next run
    reads ``WANDB_DIR`` again only after this."""
    import wandb

    wandb.teardown()


def tensorboard_scalars(log_dir, tag) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {e.step: pytest.approx(e.value, rel=1e-6) for e in acc.Scalars(tag)}


def mlflow_metric(store, key) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("prof").experiment_id])
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}


def wandb_records(path: str):
    """The records of a W&B run file: a 7-byte header (``:W&B``, magic, version), then
    LevelDB-log records (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last) in 32 KiB
    blocks, a block's tail under 7 bytes left empty."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", data[:7]
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if room < 7 or (length == 0 and kind == 0):
            pos += room
            continue
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield buf
            buf = b""


def wandb_history(root, key, step_key="profiler/global_step") -> dict[int, float]:
    """``key`` against the profiler's step (``step_key`` None: W&B's own ``_step``), from the
    history records of the offline run."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(str(root), "wandb", "offline-run-*", "run-*.wandb"))
    out = {}
    for raw in wandb_records(path):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") != "history":
            continue
        row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item}
        if key in row:
            out[int(row[step_key or "_step"])] = row[key]
    return out


@pytest.mark.ray
def test_the_trainer_s_own_mlflow_and_wandb_runs_get_the_figures_and_stay_open(
    ray_session, toy_workers, tmp_path, monkeypatch
):
    import mlflow
    import ray
    import wandb

    from trainers.hooks import ProfilingHooks

    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    workers = toy_workers(2)
    cfg = {
        "enable": True, "save_path": str(tmp_path / "p"), "ranks": "all", "wait": 2,
        "warmup": 1, "active": 2, "repeat": 2, "export_type": "none",
        "trackers": {"mlflow": {}, "wandb": {"mode": "offline"}},
    }  # fmt: skip
    mlflow.set_tracking_uri((tmp_path / "mlruns").as_uri())
    mlflow.set_experiment("prof")
    mine = mlflow.start_run(run_name="the trainer's")
    run = wandb.init(project="prof", mode="offline", dir=str(tmp_path))
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    try:
        hooks = ProfilingHooks.attach(
            cfg, workers, trainer_id="sft", name=name, namespace="profiler-tests"
        )
        with hooks.session(first_step=0):
            # The trainer logs its own loss at each step, as trainers do. Both windows' figures
            # arrive mid-run (asked every 2 s): each rides on one of the trainer's commits.
            for k in range(STEPS_OWN):
                ray.get([w.train_step.remote() for w in workers])
                time.sleep(0.1)
                wandb.log({"loss": float(k)}, step=k)
                hooks.step(k)
            assert list(hooks._feed.logged_windows) == [0, 1]  # (before the end of the session)
        ray.kill(hooks.coordinator)
        # the trainer's runs are still the active ones: the hooks neither ended nor replaced them
        assert mlflow.active_run().info.run_id == mine.info.run_id and wandb.run is run
    finally:
        wandb.finish()
        mlflow.end_run()
        wandb_teardown()
    assert set(mlflow_metric(tmp_path / "mlruns", "profiler/step_ms_median")) == {4, 9}
    assert set(wandb_history(tmp_path, "profiler/step_ms_median")) == {4, 9}
    assert wandb_history(tmp_path, "loss", step_key=None) == {k: float(k) for k in range(STEPS_OWN)}


# --------------------------------------------------------------------- bounds (issue 46 item 12)


def test_the_trainer_s_own_run_holds_at_most_max_waiting_rows_and_says_so_once(caplog):
    from trainers import trackers

    class NeverCommits:  # (a W&B run whose trainer has stopped committing)
        step, logged = 7, []

        def define_metric(self, *args, **kwargs):
            return None

        def log(self, row, commit=True):
            self.logged.append(row)

    run = NeverCommits()
    own = trackers._OwnRun(run)
    with caplog.at_level("WARNING", logger="trainers.trackers"):
        for k in range(trackers.MAX_WAITING + 500):
            own({"profiler/step_ms_median": float(k)}, k)
    assert len(run.logged) == 1  # (one row rode on the trainer's one commit)
    assert len(own.waiting) == trackers.MAX_WAITING and own.dropped == 499
    assert sum("oldest are dropped" in r.message for r in caplog.records) == 1
    own.close()  # the newest rows are the ones kept
    assert run.logged[-1][trackers.STEP_METRIC] == trackers.MAX_WAITING + 499


def test_the_feed_keeps_only_the_latest_windows_it_logged(ray_session):
    import ray

    from coordinator.client.tracker_feed import LOGGED_KEPT

    logged = []
    feed = TrackerFeed(None, lambda m, k: logged.append(k))
    n = LOGGED_KEPT * 4
    feed._ref = ray.put({"run": "r", "windows": [
        {"window": i, "metrics": {"x": 1.0}, "step": i} for i in range(n)]})  # fmt: skip
    feed._take(block_s=30)
    assert logged == list(range(n)) and feed.after == n - 1  # every window logged
    assert list(feed.logged_windows) == list(range(n - LOGGED_KEPT, n))  # the latest kept
