import contextlib
import os

import pytest
from hypothesis import settings

# CI runs the property tests with a fixed seed, so a red build is reproducible; local runs explore.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for the whole test session."""
    import ray

    ray.init(
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
