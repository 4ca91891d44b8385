import contextlib
import multiprocessing.process
import os
import subprocess

import pytest
from hypothesis import settings

# CI runs the property tests with a fixed seed, so a red build is reproducible; local runs explore.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest_plugins = ["tests.timings"]  # PROFILER_TEST_TIMINGS=<file>: each test's wall and CPU


# Fixtures that start Ray or another process: a test that uses one (directly or through another
# fixture) is marked ``ray`` or ``subprocess``; ``make test-fast`` runs every test without these.
PROCESS_FIXTURES = {"ray_session": "ray", "head": "ray", "s3": "subprocess"}
FAST_TIER = os.environ.get("PROFILER_FAST_TIER") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "ray: the test needs a Ray cluster")
    config.addinivalue_line("markers", "subprocess: the test starts another process")


def pytest_collection_modifyitems(config, items):
    for item in items:
        for fixture, mark in PROCESS_FIXTURES.items():
            if fixture in item.fixturenames:
                item.add_marker(mark)


def _forbidden(what):
    def refuse(*args, **kwargs):
        raise RuntimeError(
            f"the fast tier runs no {what}: mark this test @pytest.mark.subprocess (or use a "
            "Ray fixture), so that only `make test` runs it"
        )

    return refuse


@pytest.fixture(autouse=True)
def _fast_tier_guard(monkeypatch):
    """In ``make test-fast``, a test that starts a process or Ray fails instead of running
    slowly: the tier's promise (no Ray, no subprocess) is checked, not assumed."""
    if FAST_TIER:
        monkeypatch.setattr(subprocess.Popen, "__init__", _forbidden("subprocess"))
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _forbidden("process"))
        with contextlib.suppress(ImportError):
            import ray

            monkeypatch.setattr(ray, "init", _forbidden("Ray cluster"))
    yield


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for the whole test session."""
    import ray

    ray.init(
        address="local",  # a cluster of its own, never one a `ray start` left running
        num_cpus=32,  # logical slots: actors are mostly idle, the machine has 2 cores
        include_dashboard=False,
        log_to_driver=False,
        namespace="profiler-tests",
        runtime_env={"env_vars": {"PYTHONPATH": ROOT, "RAY_AUTH_MODE": "disabled"}},
    )
    yield ray
    ray.shutdown()


@pytest.fixture
def ray_actors(ray_session):
    """Actors made through ``ray_actors.append(h)`` are killed after the test."""
    made = []
    yield made
    for h in made:
        with contextlib.suppress(Exception):
            ray_session.kill(h)


class WorkerPool:
    """ToyWorker actors shared by the tests of a session: a fresh actor costs a process, a torch
    import and Kineto's first start, seconds each on 2 cores. A test takes some with
    ``toy_workers(n)``; they are reset and come back afterwards, unless the test killed them."""

    def __init__(self, ray):
        self.ray, self.idle, self.every = ray, [], []

    def take(self, n):
        from tests.ray_workers import ToyWorker

        while len(self.idle) < n:
            h = self.ray.remote(num_cpus=0)(ToyWorker).remote()
            self.idle.append(h)
            self.every.append(h)
        taken, self.idle = self.idle[:n], self.idle[n:]
        return taken

    def give_back(self, handles):
        refs = {h: h.reset.remote() for h in handles}
        for h, ref in refs.items():
            try:
                self.ray.get(ref, timeout=30)
                self.idle.append(h)
            except Exception:  # killed by the test, or stuck: never reused
                with contextlib.suppress(Exception):
                    self.ray.kill(h)

    def close(self):
        for h in self.every:
            with contextlib.suppress(Exception):
                self.ray.kill(h)


@pytest.fixture(scope="session")
def worker_pool(ray_session):
    pool = WorkerPool(ray_session)
    yield pool
    pool.close()


@pytest.fixture
def toy_workers(worker_pool):
    """``toy_workers(n)``: n ToyWorker actors for this test, returned to the pool after it."""
    lent = []

    def take(n):
        handles = worker_pool.take(n)
        lent.extend(handles)
        return handles

    yield take
    worker_pool.give_back(lent)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The fault matrix's table (fault x scope -> pass), when its tests ran."""
    import sys

    matrix = sys.modules.get("tests.test_fault_matrix")
    if matrix is not None and matrix.RESULTS:
        terminalreporter.section("fault matrix")
        terminalreporter.write_line(matrix.matrix_table())
