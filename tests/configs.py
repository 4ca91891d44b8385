"""Shared test set-up: an enabled profiler config, and joining a cluster from a script."""

from __future__ import annotations

import os
from typing import Any

from coordinator.core.config import ProfilerConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def profiler_config(save_path: Any, **overrides: Any) -> ProfilerConfig:
    """Enabled, every rank, CPU activity, plain traces under ``{save_path}/run``."""
    base: dict[str, Any] = {
        "enable": True,
        "save_path": str(save_path),
        "run_name": "run",
        "ranks": "all",
        "activities": ["cpu"],
        "export_type": "chrome_trace",
    }
    base.update(overrides)
    return ProfilerConfig(**base)


def join_cluster(address: str = "auto", namespace: str = "profiler") -> None:
    """``ray.init`` for a test driver script, with this checkout importable by the workers."""
    import ray

    ray.init(
        address=address,
        namespace=namespace,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": ROOT, "RAY_AUTH_MODE": "disabled"}},
    )
