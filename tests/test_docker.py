"""The Docker image built and run: a Ray head, a worker node and the demo, in containers.

The product's ``docker/Dockerfile`` is built ``FROM`` a base made here from Debian's packages
(``tests/docker_base.py``: Docker Hub is out of reach), then ``docker/compose.yaml`` starts two
Ray nodes; the demo runs beside the head with its ranks dealt over both nodes, and
``ray-profiler status``, ``top`` and ``collect`` run against it in containers. Everything
started is stopped and removed at the end, failure or not; the images stay, as Docker's cache.
A cold build (a fresh machine, as in CI: no base, no image cached) takes many minutes, so the
test has the time for it; and what an earlier run could not remove (a run killed mid-way) is
removed at the start of the next (``sweep``), where no time limit of that run can cut it.

The engine: used if it answers; started here (and stopped after) when ``dockerd`` is installed
and this user may start it; otherwise the test skips, saying why (``make test`` installs
``docker.io`` and ``docker-compose`` when missing, as root).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time

import pytest

from tests.conftest import ROOT
from tests.docker_base import BaseError, ensure_test_base, image_id

pytestmark = pytest.mark.subprocess
PROJECT_PREFIX = "rpctest"  # each run's compose project: rpctest<pid>

IMAGE = "ray-profiler-coordinator:test"
COMPOSE = os.path.join(ROOT, "docker", "compose.yaml")
ENGINE_WAIT_S = 60.0
HEAD_NODE = (
    "import ray; ray.init(address='auto', log_to_driver=False); "
    "print(ray.get_runtime_context().get_node_id())"
)


def answers() -> bool:
    """Whether a Docker engine answers the client."""
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def engine():
    """A Docker engine that answers, or a skip that says why none can run here."""
    for tool, package in (("docker", "docker.io"), ("docker-compose", "docker-compose")):
        if shutil.which(tool) is None:
            pytest.skip(f"no {tool}: `make test` installs {package} (apt-get, as root)")
    if answers():
        yield
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        pytest.skip("no Docker engine answers and dockerd is not installed (docker.io)")
    if os.geteuid() != 0:
        pytest.skip("no Docker engine answers, and only root may start dockerd here")
    with tempfile.NamedTemporaryFile("w+", prefix="dockerd-", suffix=".log") as log:
        proc = subprocess.Popen(
            [dockerd], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + ENGINE_WAIT_S
            while not answers():
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = log.read()[-1500:]
                    pytest.skip(f"dockerd could not start here (exit {proc.poll()}):\n{tail}")
                time.sleep(0.5)
            yield
        finally:
            proc.terminate()  # dockerd stops its containerd and leaves the images
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)


def sh(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
    """``cmd``'s output; the test fails with its output when it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n" + (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )
    return proc.stdout


def sweep() -> list[str]:
    """Remove the containers and volumes of this test's compose projects that an earlier run
    left behind (a run still going on this machine keeps its own); what was removed."""
    project = '{{.Label "com.docker.compose.project"}}'
    gone = []
    for ls, rm in (
        (["docker", "ps", "-a", "--format", "{{.ID}} " + project], ["docker", "rm", "-f"]),
        (
            ["docker", "volume", "ls", "--format", "{{.Name}} " + project],
            ["docker", "volume", "rm"],
        ),
    ):
        rows = sh([*ls, "--filter", "label=com.docker.compose.project"], 60).splitlines()
        stale = [i for i, _, p in (r.partition(" ") for r in rows) if _left_behind(p)]
        if stale:
            sh([*rm, *stale], 120)
            gone += stale
    return gone


def _left_behind(project: str) -> bool:
    """A project of this test whose run is over (its pid is gone), or of this very run."""
    found = re.fullmatch(rf"{PROJECT_PREFIX}\D*(\d+)", project)
    if found is None:
        return False
    pid = int(found.group(1))
    return pid == os.getpid() or not os.path.exists(f"/proc/{pid}")


@pytest.mark.timeout(2400)  # (a cold build: the base from Debian's packages, then the image)
def test_the_image_builds_and_two_nodes_run_the_demo_status_top_and_collect(engine, tmp_path):
    sweep()
    try:
        base, _ = ensure_test_base()
        _, rebuilt = ensure_test_base()
    except BaseError as exc:
        pytest.fail(f"the test base could not be made: {exc}")
    assert not rebuilt, "a second run of the base rebuilt it: its layers should all be cached"
    sh(
        [
            "docker", "build", "-q", "-f", "docker/Dockerfile", "-t", IMAGE,
            "--build-arg", f"BASE={base}", "--build-arg", "TORCH_INDEX=", ".",
        ],
        timeout=1800,
    )  # fmt: skip
    user = sh(["docker", "image", "inspect", "--format", "{{.Config.User}}", IMAGE], 60)
    assert user.strip() == "ray"
    baked = sh(["docker", "image", "inspect", "--format", "{{json .Config.Env}}", IMAGE], 60)
    assert "RAY_AUTH_MODE=token" in baked and "RAY_AUTH_TOKEN" not in baked, baked

    # What a run cut short leaves (a container, a volume of its project) goes at the next start.
    stale = f"{PROJECT_PREFIX}stale{os.getpid()}"
    sh(["docker", "volume", "create", "--label", f"{_label(stale)}", f"{stale}_data"], 60)
    sh(["docker", "create", "--label", _label(stale), "--name", f"{stale}_c", IMAGE, "true"], 60)
    assert len(sweep()) == 2 and sweep() == []
    project = f"{PROJECT_PREFIX}{os.getpid()}"
    token = secrets.token_hex(32)  # (Ray's token auth is on in the image: each run has its own)
    env = {**os.environ, "IMAGE": IMAGE, "COMPOSE_PROJECT_NAME": project, "RAY_AUTH_TOKEN": token}
    compose = ["docker-compose", "-f", COMPOSE]
    collected = tmp_path / "collected"
    collected.mkdir()
    collected.chmod(0o777)  # the image's user writes there
    try:
        sh([*compose, "up", "--no-build", "-d", "ray-head", "ray-worker"], 300, env)
        demo = sh([*compose, "run", "--rm", "demo"], 600, env)
        assert "sft trainer, 2 policy ranks" in demo and "coordinator left running" in demo

        def cli(*args: str, volume: str | None = None) -> str:
            mount = ["-v", volume] if volume else []
            return sh([*compose, "run", "--rm", *mount, "demo", "ray-profiler", *args], 300, env)

        status = json.loads(cli("--json", "status"))
        nodes = {r["rank"]: r["node_id"] for r in status["ranks"]}
        here = sh([*compose, "run", "--rm", "demo", "python", "-c", HEAD_NODE], 300, env)
        head_node = here.strip().splitlines()[-1]
        # --spread deals the ranks over the nodes in turn, the driver's (the head's) first
        assert nodes[0] == head_node and nodes[1] not in (head_node, None), (nodes, head_node)
        assert status["nodes"]["by_path"] == {"agent": 2}  # a node agent on each node
        assert len(status["windows"]) == 2
        # Another token (a container that does not have the cluster's) is refused by the cluster.
        other = [*compose, "run", "--rm", "-e", f"RAY_AUTH_TOKEN={'0' * 64}", "demo",
                 "ray-profiler", "status"]  # fmt: skip
        refused = subprocess.run(other, env=env, cwd=ROOT, capture_output=True, text=True,
                                 timeout=300)  # fmt: skip
        said = refused.stdout + refused.stderr
        assert refused.returncode != 0, said[-3000:]
        assert "authentication token is missing or incorrect" in said.lower(), said[-3000:]
        top = cli("top", "--k", "5")
        assert "policy ranks [0, 1]" in top and "aten::" in top
        out = cli(
            "collect", "--window", "0", "--to", "/collected", volume=f"{collected}:/collected"
        )
        assert "2 traces" in out
        for rank in (0, 1):
            with gzip.open(collected / f"rank{rank}.pt.trace.json.gz") as f:
                trace = json.load(f)
            assert trace["distributedInfo"]["rank"] == rank
            assert any(e.get("name") == "ProfilerStep#5" for e in trace["traceEvents"])
        for container in sh(
            ["docker", "ps", "-q", "--filter", f"label={_label(project)}"], 60
        ).split():
            ports = sh(
                ["docker", "inspect", "--format", "{{json .HostConfig.PortBindings}}", container],
                60,
            )
            assert ports.strip() in ("{}", "null"), ports  # nothing listens on the host
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(
                [*compose, "down", "-v", "--remove-orphans", "--timeout", "10"],
                env=env, cwd=ROOT, capture_output=True, timeout=180,
            )  # fmt: skip
    left = sh(["docker", "ps", "-aq", "--filter", f"label={_label(project)}"], 60)
    assert left.strip() == "", f"containers left running: {left}"
    assert image_id(IMAGE)  # the image stays: Docker's cache for the next run


def _label(project: str) -> str:
    return f"com.docker.compose.project={project}"
