"""``engine: kineto`` in real training processes: libkineto's on-demand tracing, with the local
agent playing its daemon, against ``torch.profiler`` on the same work in the same process."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import pytest

from worker_ext.agent.kineto_ipc import kineto_env

pytestmark = pytest.mark.subprocess
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def kdir():
    """A daemon directory short enough for libkineto's socket paths (a pytest tmp_path is not)."""
    d = tempfile.mkdtemp(prefix="kt-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def run(tmp_path, kdir: str, plan: dict, env: dict[str, str] | None = None) -> dict:
    environ = {**os.environ, **(kineto_env(kdir) if env is None else env)}
    got = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.scripts.kineto_rank_run",
            str(tmp_path / "run"),
            json.dumps(plan),
        ],  # fmt: skip
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [x for x in got.stdout.splitlines() if x.startswith("RESULT ")]
    assert got.returncode == 0 and lines, got.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def by_window(out: dict) -> dict[int, dict]:
    return {s["window"]: s for s in out["summaries"]}


def test_kineto_windows_record_the_planned_steps_with_torch_s_op_counts(tmp_path, kdir):
    # (windows of the two engines far apart: a torch.profiler started while libkineto still
    # writes drops libkineto's trace)
    plan = {"steps": 106, "sleep_s": 0.1,
            "windows": [["torch", 10, 20, 23], ["kineto", 30, 40, 43],
                        ["torch", 70, 80, 83], ["kineto", 90, 100, 103]]}  # fmt: skip
    out = run(tmp_path, kdir, plan)
    got = by_window(out)
    assert sorted(got) == [0, 1, 2, 3], out
    assert out["failures"] == [] and out["errors"] == [], out
    for i, (_, _, first, last) in enumerate(plan["windows"]):
        assert got[i]["steps"] == [first, last] and not got[i]["partial"], got[i]
        assert len(got[i]["step_us"]) == last - first + 1
    torch_w, kineto_w = (got[0], got[2]), (got[1], got[3])
    for t in torch_w:
        for k in kineto_w:
            counts = {n: c for n, (c, _) in k["kernels"].items()}
            assert counts == {n: c for n, (c, _) in t["kernels"].items()}
    # Times: every kineto step within the spread of the torch steps of the same run.
    torch_steps = [u for t in torch_w for u in t["step_us"]]
    lo, hi = min(torch_steps), max(torch_steps)
    for k in kineto_w:
        assert lo * 0.8 <= statistics.median(k["step_us"]) <= hi * 1.25, (k["step_us"], lo, hi)
    # The trace files: under the usual names, with the rank and nothing of libkineto's left.
    for i, (_, _, first, last) in enumerate(plan["windows"]):
        path = tmp_path / "run" / f"window_{i:04d}_steps_{first}-{last}" / "policy"
        with open(path / "rank0.pt.trace.json") as f:
            doc = json.load(f)
        assert doc["rank"] == 0 and doc["distributedInfo"]["rank"] == 0
    assert out["hidden"] == [], out["hidden"]


def test_a_late_config_is_a_partial_window_that_says_so(tmp_path, kdir):
    # Started on its first step: libkineto takes the config a poll later, steps later.
    plan = {"steps": 40, "sleep_s": 0.25, "windows": [["kineto", 12, 12, 30]]}
    out = run(tmp_path, kdir, plan)
    (s,) = out["summaries"]
    assert s["partial"] and s["steps"][0] > 12 and s["steps"][1] == 30, s
    assert any("of the planned 12-30" in e and "after the window's first step" in e
               for e in out["errors"]), out["errors"]  # fmt: skip


def test_a_loop_s_end_waits_until_libkineto_wrote_its_last_window(tmp_path, kdir):
    # libkineto writes from the rank's process, on a thread that wakes once a second: a
    # process that ends at once after its last window (a Ray Train worker) would lose it.
    # (a warm-up of 2 s: the config's lead past libkineto's poll and the agent's start, loaded)
    plan = {"steps": 24, "sleep_s": 0.1, "finish_s": 30, "windows": [["kineto", 0, 21, 23]]}
    out = run(tmp_path, kdir, plan)
    assert out["unwritten"] == [] and [s["steps"] for s in out["summaries"]] == [[21, 23]], out


def test_a_window_of_a_process_that_steps_no_optimizer_is_reported_lost_with_why(tmp_path, kdir):
    # libkineto counts iterations by optimizer steps: the window's config never goes out, yet
    # its steps ran, so the coordinator waits for its trace until the agent says it is lost.
    plan = {"steps": 8, "sleep_s": 0.05, "no_optimizer": True, "windows": [["kineto", 0, 2, 5]]}
    out = run(tmp_path, kdir, plan)
    assert out["closed"][-1]["steps"] == [2, 5] and out["summaries"] == [], out
    assert any("this process steps no optimizer" in f for f in out["failures"]), out
    assert out["hidden"] == [], out["hidden"]  # (the cancel file: gone with the report)


def test_a_loop_that_ends_before_the_window_posted_ahead_leaves_no_config_queued(tmp_path, kdir):
    # Window 0's end posts window 1's config (steps 48-49); the loop ends at step 29: that
    # config, queued or taken by the daemon, is taken back, so nothing is sent later.
    sched = {"skip_first": 2, "wait": 2, "warmup": 20, "active": 2, "repeat": 2}
    plan = {"steps": 30, "sleep_s": 0.1, "finish_s": 30, "schedule": sched,
            "windows": [["kineto", 4, 24, 25]]}  # fmt: skip
    out = run(tmp_path, kdir, plan)
    assert [s["steps"] for s in out["summaries"]] == [[24, 25]], out
    assert out["queued"] == [], out["queued"]


def test_the_user_s_own_torch_profiler_is_detected_and_training_goes_on(tmp_path, kdir):
    # Window 1's warm-up lasts 18 steps of 0.1 s: its config's lead must outlast libkineto's
    # poll (1 s) and the hand-off under load, or it starts late (a schedule with warm-up of
    # exactly a poll is one status() says may start late: kineto_fit).
    plan = {"steps": 60, "sleep_s": 0.1, "user_profiler_at": 28,
            "windows": [["kineto", 10, 20, 35], ["kineto", 30, 48, 50]]}  # fmt: skip
    out = run(tmp_path, kdir, plan)
    assert any("a torch.profiler of the process's own" in s for s in out["skips"]), out
    assert any("a torch.profiler of the process's own" in f for f in out["failures"]), out
    assert [s["window"] for s in out["summaries"]] == [1]  # the next window is whole
    assert out["summaries"][0]["steps"] == [48, 50] and not out["summaries"][0]["partial"], out
    assert out["states"] == {"kineto": "ok"}
    assert out["hidden"] == [], out["hidden"]  # libkineto's .tmp of the dropped window: gone


def test_a_process_without_the_daemon_environment_is_refused_with_the_fix(tmp_path, kdir):
    plan = {"steps": 5, "sleep_s": 0.0, "windows": [["kineto", 1, 2, 3]]}
    clean = {k: "" for k in ("KINETO_USE_DAEMON", "KINETO_IPC_SOCKET_DIR", "KINETO_CONFIG")}
    out = run(tmp_path, kdir, plan, env=clean)
    assert out["states"] == {"kineto": "disabled"}
    assert (
        "runtime_env={'env_vars': worker_ext.kineto_env()}" in out["reasons"]["kineto"]["message"]
    )
    assert out["summaries"] == []


def test_a_process_whose_directory_was_missing_at_import_is_refused_with_the_fix(tmp_path, kdir):
    # Started outside Ray on a node where nothing made the directory: libkineto never bound.
    plan = {"steps": 5, "sleep_s": 0.0, "windows": [["kineto", 1, 2, 3]]}
    cold = os.path.join(kdir, "cold")
    moved = {"KINETO_IPC_SOCKET_DIR": cold, "RAY_PROFILER_KINETO_DIR": cold}
    env = {**kineto_env(os.path.join(kdir, "k")), **moved}
    out = run(tmp_path, kdir, plan, env=env)
    assert out["states"] == {"kineto": "disabled"}, out
    message = out["reasons"]["kineto"]["message"]
    assert f"libkineto has no socket in {cold}" in message and "kineto_env()" in message
    assert out["summaries"] == [] and not os.path.exists(cold)


def test_the_attach_hook_sets_the_daemon_environment_only_where_its_config_reader_says_kineto(
    kdir,
):
    probe = (
        "import os, sys\n"
        "if sys.argv[1] == 'torch-first': import torch\n"
        "import worker_ext.attach as a\n"
        "a.setup()\n"
        "print('DAEMON', os.environ.get('KINETO_USE_DAEMON'), os.environ.get('KINETO_CONFIG'))\n"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("KINETO")}
    base["RAY_PROFILER_KINETO_DIR"] = os.path.join(kdir, "k")

    def daemon(config: str, order: str = "hook-first") -> str:
        env = {**base, "RAY_PROFILER_CONFIG": config}
        got = subprocess.run([sys.executable, "-c", probe, order], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        lines = [x for x in got.stdout.splitlines() if x.startswith("DAEMON")]
        assert lines, got.stderr
        return lines[0]

    conf = os.path.join(kdir, "k", "client.conf")
    colon = os.path.join(kdir, "a:b.yaml")  # a file path the reader takes for YAML text
    plain = os.path.join(kdir, "profiler.yaml")
    for path in (colon, plain):
        with open(path, "w") as f:
            f.write("enable: true\nengine: kineto\n")
    # Where the config reader (read_source) says anything but enable: true and engine: kineto,
    # nothing is set and nothing made: no polling thread, no socket in the job's workers.
    for off in (
        "enable: false\nengine: kineto\n",
        "enable: true\nnotes:\n  engine: kineto\n",
        "enable: true\nattach: {engine: kineto}\n",
        colon,
        "enable: [\nengine: kineto",
    ):
        assert daemon(off) == "DAEMON None None", off
    assert not os.path.exists(os.path.join(kdir, "k"))
    assert daemon("enable: true\nengine: kineto\n") == f"DAEMON 1 {conf}"
    assert os.path.isfile(conf)
    assert daemon('{"enable": true, "engine": "kineto"}') == f"DAEMON 1 {conf}"
    assert daemon(plain) == f"DAEMON 1 {conf}"
    assert daemon("enable: true\nengine: torch\n") == "DAEMON None None"
    assert daemon("enable: true\nengine: kineto\n", "torch-first") == "DAEMON None None"
