"""Memory across ranks on real runs: two Ray ranks, their node agent sampling them out of
process. One rank leaks host memory at a known rate: it alone is marked, with its rate within
30% of the truth, and named the culprit; a run whose memory rises once and stays gets no mark."""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid

import pytest

from coordinator.ops.cli import main as cli_main
from tests.configs import profiler_config
from tests.fault_cases import wait_for_windows
from trainers.hooks import ProfilingHooks

MiB = 1 << 20
RATE = 3 * MiB  # bytes a second: 180 MiB a minute
SPAN_S = 10.0
MEMORY = {"sample_s": 0.2, "leak_span_s": SPAN_S, "leak_min_mib_per_min": 20}


@pytest.fixture(scope="module")
def leaky(ray_session):
    from tests.ray_workers import LeakyWorker

    workers = [ray_session.remote(num_cpus=0)(LeakyWorker).remote() for _ in range(2)]
    ray_session.get([w.pid.remote() for w in workers])
    yield workers
    for w in workers:
        ray_session.kill(w)


def train(ray, hooks, workers, seconds, rates, rise=(0, 0)):
    step, t0 = 0, time.monotonic()
    with hooks.session(first_step=0):
        while time.monotonic() - t0 < seconds:
            ray.get(
                [w.leaky_step.remote(r, s) for w, r, s in zip(workers, rates, rise, strict=True)]
            )
            hooks.step(step)
            step += 1
        return ray.get(hooks.coordinator.memory.remote(series=True))


def attach(ray, workers, tmp_path, **more):
    ray.get([w.reset.remote() for w in workers])  # (before the hooks configure them)
    cfg = profiler_config(tmp_path, wait=10, warmup=1, active=2, repeat=1, memory=MEMORY, **more)
    name = f"profiler-{uuid.uuid4().hex[:8]}"
    return ProfilingHooks.attach(cfg, workers, trainer_id="sft", name=name), name


def test_the_leaking_rank_alone_is_marked_with_its_rate(ray_session, leaky, tmp_path, capsys):
    ray = ray_session
    hooks, name = attach(ray, leaky, tmp_path)
    try:
        m = train(ray, hooks, leaky, SPAN_S * 1.8, rates=(0, RATE))
        by_rank = {r["rank"]: r for r in m["ranks"]}
        assert [r["state"] for r in m["ranks"]] == ["sampled", "sampled"], m["ranks"]
        assert by_rank[0]["growth"] is None, by_rank[0]
        growth = by_rank[1]["growth"]
        assert growth is not None, [(r["rank"], r["series"][-5:]) for r in m["ranks"]]
        assert growth["bytes_per_min"] == pytest.approx(RATE * 60, rel=0.3)
        node = m["nodes"][by_rank[1]["node_id"]]  # the node's memory, read by its agent
        left = node["available_bytes"] / (growth["bytes_per_min"] / 60)
        assert growth["time_left_s"] == pytest.approx(left, rel=0.01), (growth, node)
        assert by_rank[1]["culprit"] and not by_rank[0]["culprit"]
        assert m["culprits"] == [m["culprits"][0]] and "rank 1 grows" in m["culprits"][0]
        assert by_rank[1]["peak_rss_bytes"] >= by_rank[1]["rss_bytes"] > by_rank[0]["rss_bytes"]
        assert len(by_rank[1]["series"]) > 30 and m["windows"], m["windows"]
        st = ray.get(hooks.coordinator.status.remote())
        assert [r["state"] for r in st["ranks"]] == ["ok", "ok"]
        assert [w["steps"] for w in st["windows"]] == [[11, 12]]
        assert [(k["rank"], k["culprit"]) for k in st["memory"]["marked"]] == [(1, True)]
        assert st["metrics"]["exported"], st["metrics"]  # the leak gauges too
        assert st["metrics"]["values"]["profiler_memory_leaking_ranks"] == 1.0
        assert cli_main(["--name", name, "--namespace", "profiler", "memory"]) == 0
        table = capsys.readouterr().out
        assert "leak: policy rank 1 grows" in table and "<- culprit" in table
        assert "its node's memory is gone in about" in table and "node memory gone in" in table
        assert cli_main(["--name", name, "--namespace", "profiler", "memory", "--json"]) == 0
        public = json.loads(capsys.readouterr().out)
        public_keys = {"trainer_id", "rank", "rss_bytes", "peak_rss_bytes", "growth"}
        assert public_keys <= set(public["ranks"][0])
        print(table)
        chart_in_a_browser(hooks.coordinator, name, tmp_path)
    finally:
        ray.kill(hooks.coordinator)


@pytest.mark.subprocess
def test_the_memory_outlives_the_coordinator_and_the_cluster_in_the_run_s_record(
    ray_session, leaky, tmp_path
):
    """The run's record keeps every rank's series, peaks and marks: ``memory --from``,
    ``status --from`` and ``serve --from`` (``/api/memory`` and the run page's chart), each in
    a process whose Ray address leads nowhere, answer what the coordinator answered."""
    from tests.test_run_record import cli_no_cluster

    ray = ray_session
    hooks, _ = attach(ray, leaky, tmp_path)
    try:
        train(ray, hooks, leaky, SPAN_S * 1.8, rates=(0, RATE))  # (the run stops at its end)
        live = ray.get(hooks.coordinator.memory.remote(series=True))
        marked = ray.get(hooks.coordinator.status.remote())["memory"]["marked"]
        entry = ray.get(hooks.coordinator.flush_record.remote(30.0))
    finally:
        ray.kill(hooks.coordinator)
    assert [(m["rank"], m["culprit"]) for m in marked] == [(1, True)], live["ranks"]
    assert entry["error"] is None and entry["pending"] == 0, entry
    record = entry["dir"]
    got = cli_no_cluster("memory", "--from", record, "--json")
    assert got.returncode == 0, got.stderr
    recorded, want = json.loads(got.stdout), json.loads(json.dumps(live))
    assert [r["series"] for r in recorded["ranks"]] == [None, None]  # (as live: series=False)
    assert len(want["ranks"][1]["series"]) > 30
    for r in want["ranks"]:
        r["series"] = None
    assert {**recorded, "taken_at": 0} == {**want, "taken_at": 0}
    table = cli_no_cluster("memory", "--from", record).stdout
    assert "leak: policy rank 1 grows" in table and "<- culprit" in table, table
    st = json.loads(cli_no_cluster("status", "--from", record, "--json").stdout)
    assert st["memory"]["marked"] == json.loads(json.dumps(marked))
    assert st["memory"]["culprits"] == live["culprits"] and st["record"]["error"] is None
    chart_from_the_record(record, json.loads(json.dumps(live)), tmp_path)


def chart_from_the_record(record, live, tmp_path):
    """``serve --from RECORD`` with no cluster: ``/api/memory`` is the coordinator's last
    ``memory(series=True)``, and the run page draws its chart (a line a rank, the culprit
    named, the window as a band)."""
    from tests.test_web import _open, _serve_record, chromium_browser, sign_in, wait_js

    proc, url, token = _serve_record(record)
    try:
        status, _, body, _ = _open(url + "/api/memory", {"Authorization": f"Bearer {token}"})
        assert status == 200 and {**json.loads(body), "taken_at": 0} == {**live, "taken_at": 0}
        with chromium_browser() as browser:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            sign_in(page, url, token)
            page.goto(url + "/")
            chart = "document.querySelector('.memory-chart[data-role=policy]')?.chart"
            wait_js(page, f"{chart}?.data?.datasets?.length === 2", 30)
            labels = page.evaluate(f"{chart}.data.datasets.map(d => d.label)")
            assert labels[0] == "rank 0" and labels[1].endswith("(culprit)"), labels
            points = page.evaluate(f"{chart}.data.datasets[1].data.length")
            assert points == len(live["ranks"][1]["series"])
            assert page.evaluate(f"{chart}.config.options.plugins.memoryBands.windows.length") == 1
            assert "leak: policy rank 1 grows" in page.inner_text("#memory")
        assert errors == []
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_rise_that_stays_and_a_steady_rank_get_no_mark(ray_session, leaky, tmp_path):
    """...and its window, with ``profile_memory``, shows each rank's peak and top ops."""
    ray = ray_session
    hooks, name = attach(ray, leaky, tmp_path, profile_memory=True)
    try:
        m = train(ray, hooks, leaky, SPAN_S * 1.8, rates=(0, 0), rise=(0, 200 * MiB))
        assert [r["state"] for r in m["ranks"]] == ["sampled", "sampled"], m["ranks"]
        assert [r["growth"] for r in m["ranks"]] == [None, None], m["ranks"]
        assert m["culprits"] == []
        by_rank = {r["rank"]: r for r in m["ranks"]}
        assert by_rank[1]["peak_rss_bytes"] > by_rank[0]["peak_rss_bytes"] + 150 * MiB
        wait_for_windows(ray, hooks.coordinator)
        mem = ray.get(hooks.coordinator.kernel_summary.remote(window=0))["memory"]
        assert set(mem["peak_bytes"]) == {0, 1} and all(b > 0 for b in mem["peak_bytes"].values())
        assert set(mem["peak_step"].values()) <= {11, 12}
        assert all(mem["allocated_bytes"][r] >= mem["freed_bytes"][r] > 0 for r in (0, 1))
        assert mem["ops"] and mem["ops"][0]["total_bytes"] > 0 and mem["ops"][0]["name"]
        window_page_in_a_browser(hooks.coordinator, name, mem)
    finally:
        ray.kill(hooks.coordinator)


def test_a_rank_whose_process_dies_is_marked_lost_and_keeps_its_peak(ray_session, tmp_path):
    from tests.ray_workers import LeakyWorker

    ray = ray_session
    workers = [ray.remote(num_cpus=0, max_restarts=0)(LeakyWorker).remote() for _ in range(2)]
    hooks, _ = attach(ray, workers, tmp_path)
    try:
        with hooks.session(first_step=0):
            for step in range(20):
                ray.get([w.leaky_step.remote(0) for w in workers])
                hooks.step(step)
            ray.kill(workers[1])
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the run goes on with rank 0
                ray.get(workers[0].leaky_step.remote(0))
                step += 1
                hooks.step(step)
                m = ray.get(hooks.coordinator.memory.remote())
                dead = m["ranks"][1]
                if dead["state"] in ("lost", "unreachable"):
                    break
        assert dead["state"] in ("lost", "unreachable"), dead
        assert dead["peak_rss_bytes"] and dead["reason"]
        assert m["ranks"][0]["state"] == "sampled"
    finally:
        ray.kill(hooks.coordinator)
        for w in workers:
            ray.kill(w)


@contextlib.contextmanager
def web_page(coord, name, path):
    """The web view of coordinator ``name`` served on loopback, and ``path`` opened in
    Chromium; the page's JavaScript errors must be none when the block ends."""
    from coordinator.ops.web.server import CoordinatorLink
    from tests.test_web import ServerThread, chromium_browser, sign_in

    web = ServerThread(CoordinatorLink(name, "profiler", coord))
    try:
        with chromium_browser() as browser:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            sign_in(page, web.url)
            page.goto(web.url + path)
            yield web, page
        assert errors == []
    finally:
        web.close()


def chart_in_a_browser(coord, name, tmp_path):
    """The run page in Chromium: the policy role's memory chart, a line a rank, the window as a
    band, the culprit named above it."""
    from tests.test_web import screenshot, wait_js

    with web_page(coord, name, "/") as (web, page):
        status, m = web.http("GET", "/api/memory")
        assert status == 200 and len(m["ranks"][1]["series"]) > 30
        chart = "document.querySelector('.memory-chart[data-role=policy]')?.chart"
        wait_js(page, f"{chart}?.data?.datasets?.length === 2", 30)
        labels = page.evaluate(f"{chart}.data.datasets.map(d => d.label)")
        assert labels[0] == "rank 0" and labels[1].startswith("rank 1 +")
        assert labels[1].endswith("(culprit)")
        assert page.evaluate(f"{chart}.config.options.plugins.memoryBands.windows.length") == 1
        assert "leak: policy rank 1 grows" in page.inner_text("#memory")
        screenshot(page, tmp_path, "memory.png")


def window_page_in_a_browser(coord, name, mem):
    """The window page's memory part: the rank with the highest peak, and a row a rank."""
    from tests.test_web import wait_js

    with web_page(coord, name, "/#/window/0") as (_, page):
        wait_js(page, "document.getElementById('memory-peak') !== null", 30)
        text = page.inner_text("#memory-peak")
        assert text.startswith(f"highest peak: rank {mem['max_peak_rank']},"), text


def test_snapshots_on_demand_and_on_oom_reach_the_coordinator_with_their_rank(
    ray_session, tmp_path, capsys
):
    """The CUDA snapshot paths end to end, torch's CUDA memory calls replaced in the ranks: the
    CLI asks, each rank's node agent writes its pipe, the files are named per rank; an OOM in
    rank 1 names rank 1 and its file in ``status()``."""
    from tests.ray_workers import LeakyWorker

    ray = ray_session
    workers = [ray.remote(num_cpus=0)(LeakyWorker).remote() for _ in range(2)]
    hooks, name = attach(ray, workers, tmp_path)
    run_dir = str(tmp_path / "run")
    try:
        on = ["oom", "demand"]
        ray.get([w.fake_cuda_snapshots.remote(r, run_dir, on) for r, w in enumerate(workers)])
        with hooks.session(first_step=0):
            for step in range(10):
                ray.get([w.leaky_step.remote(0) for w in workers])
                hooks.step(step)
            argv = [
                "--name",
                name,
                "--namespace",
                "profiler",
                "memory",
                "--snapshot",
                "--wait",
                "30",
            ]
            assert cli_main(argv) == 0
            out = capsys.readouterr().out
            for r in (0, 1):
                path = f"{run_dir}/memory/demand-001/policy/rank{r}.memory.pickle"
                assert f"rank {r}: {path}" in out and os.path.isfile(path), out
            assert ray.get(workers[1].fake_oom.remote()) == 1
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                snaps = ray.get(hooks.coordinator.status.remote())["memory"]["snapshots"]
                oom = [s for s in snaps if s["on"] == "oom"]
                if oom:
                    break
                time.sleep(0.5)
            ray.get([w.leaky_step.remote(0) for w in workers])
            hooks.step(10)
        (s,) = oom
        assert (s["trainer_id"], s["rank"], s["error"]) == ("sft", 1, None)
        assert s["path"].startswith(f"{run_dir}/memory/policy/rank1.oom-") and os.path.isfile(
            s["path"]
        )
    finally:
        ray.kill(hooks.coordinator)
        for w in workers:
            ray.kill(w)
