"""The web API's inputs, checked before anything reaches the coordinator: pure, each bad value a
``BadRequest`` whose message names the parameter."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from coordinator.core.validate import is_int, role_problem

MAX_BODY_BYTES = 64 * 1024
CAPTURE_FIELDS = ("active", "warmup", "ranks", "start_step")
SHOWN_COLLECTIVES = 40
MAX_SHOWN_COLLECTIVES = 10_000


class BadRequest(ValueError):
    """A request the API refuses with 400; ``str`` is the reason."""


def int_param(query: Mapping[str, str], name: str, default: int | None, lo: int, hi: int) -> int:
    """``query[name]`` as an int in ``lo..hi``, or ``default`` when absent (None: required)."""
    raw = query.get(name)
    if raw is None or raw == "":
        if default is None:
            raise BadRequest(f"{name} is required (an int in {lo}..{hi})")
        return default
    try:
        value = int(raw, 10)
    except ValueError:
        raise BadRequest(f"{name} must be an int in {lo}..{hi}, got {raw[:40]!r}") from None
    if not lo <= value <= hi:
        raise BadRequest(f"{name} must be an int in {lo}..{hi}, got {value}")
    return value


def str_param(query: Mapping[str, str], name: str) -> str | None:
    """``query[name]`` (at most 128 characters), or None when absent or empty."""
    raw = query.get(name)
    if raw is None or raw == "":
        return None
    if len(raw) > 128:
        raise BadRequest(f"{name} is longer than 128 characters")
    return raw


def role_param(query: Mapping[str, str], name: str = "role") -> str | None:
    """``query[name]``, a role's name (``validate.role_problem``), or None when absent."""
    raw = str_param(query, name)
    why = role_problem(raw) if raw is not None else None
    if why is not None:
        raise BadRequest(f"{name}: {why}")
    return raw


def bool_param(query: Mapping[str, str], name: str) -> bool:
    raw = (query.get(name) or "false").lower()
    if raw in ("1", "true", "yes"):
        return True
    if raw in ("0", "false", "no"):
        return False
    raise BadRequest(f"{name} must be true or false, got {raw[:40]!r}")


def choice_param(
    query: Mapping[str, str], name: str, choices: tuple[str, ...], default: str
) -> str:
    """``query[name]``, one of ``choices``, or ``default`` when absent."""
    raw = query.get(name) or default
    if raw not in choices:
        raise BadRequest(f"{name} must be one of {', '.join(choices)}, got {raw[:40]!r}")
    return raw


def ranks_param(query: Mapping[str, str], name: str, most: int) -> list[int] | None:
    """``query[name]`` as comma-separated ranks (at most ``most``), or None when absent."""
    raw = query.get(name)
    if raw is None or raw == "":
        return None
    parts = raw.split(",")
    if len(parts) > most:
        raise BadRequest(f"{name} lists {len(parts)} ranks; at most {most}")
    if not all(p.strip().isdigit() for p in parts):
        raise BadRequest(f"{name} must be ranks separated by commas, got {raw[:40]!r}")
    return sorted({int(p) for p in parts})


def float_param(query: Mapping[str, str], name: str, default: float, lo: float, hi: float) -> float:
    """``query[name]`` as a number in ``lo..hi``, or ``default`` when absent."""
    raw = query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise BadRequest(f"{name} must be a number in {lo:g}..{hi:g}, got {raw[:40]!r}") from None
    if not lo <= value <= hi:  # (also refuses nan)
        raise BadRequest(f"{name} must be a number in {lo:g}..{hi:g}, got {raw[:40]!r}")
    return value


def window_index(raw: str) -> int:
    """A window index from the path."""
    return int_param({"window": raw}, "window", None, 0, 2**62)


def kernels_args(query: Mapping[str, str]) -> dict[str, Any]:
    """``kernel_summary`` keyword arguments from ``?top_k&trainer_id&role&per_rank&run``."""
    return {
        "top_k": int_param(query, "top_k", 20, 0, 100_000),
        "trainer_id": str_param(query, "trainer_id"),
        "role": str_param(query, "role"),
        "per_rank": bool_param(query, "per_rank"),
        "run": str_param(query, "run"),
        "by": choice_param(query, "by", ("kernel", "op"), "kernel"),
    }


def advise_args(query: Mapping[str, str]) -> dict[str, Any]:
    """``advise`` keyword arguments from ``?trainer_id&role&run``."""
    return {
        "trainer_id": str_param(query, "trainer_id"),
        "role": role_param(query),
        "run": str_param(query, "run"),
    }


def collectives_args(query: Mapping[str, str]) -> dict[str, Any]:
    """``collectives`` keyword arguments from ``?trainer_id&role&run&shown`` (``shown``: the
    largest skews listed, 40 by default: the window page charts that many)."""
    shown = int_param(query, "shown", SHOWN_COLLECTIVES, 0, MAX_SHOWN_COLLECTIVES)
    return advise_args(query) | {"shown": shown}


def diff_args(query: Mapping[str, str]) -> dict[str, Any]:
    """``kernel_diff`` keyword arguments from ``?a&b&run_a&run_b&trainer_id&top_k``; ``a`` and
    ``b`` may be ``RUN:WINDOW`` (a run's name: one kept by the coordinator, or recorded under
    its ``save_path``)."""
    out: dict[str, Any] = {}
    for side in ("a", "b"):
        raw, run = query.get(side) or "", str_param(query, f"run_{side}")
        if ":" in raw:
            named, raw = raw.rsplit(":", 1)
            if run is not None and run != named:
                raise BadRequest(f"{side} names run {named!r} and run_{side} {run!r}")
            if not named or len(named) > 128 or "/" in named or "\\" in named:
                raise BadRequest(f"{side}'s run must be a run's name, got {named[:40]!r}")
            run = named
        out[side] = int_param({side: raw}, side, None, 0, 2**62)
        out[f"run_{side}"] = run
    out["trainer_id"] = str_param(query, "trainer_id")
    out["top_k"] = int_param(query, "top_k", 50, 0, 100_000)
    return out


def capture_args(body: bytes) -> dict[str, Any]:
    """``request_capture`` keyword arguments from a JSON body: ``active`` and optionally
    ``warmup``, ``ranks``, ``start_step`` (their ranges are the coordinator's to judge)."""
    if len(body) > MAX_BODY_BYTES:
        raise BadRequest(f"the body is over {MAX_BODY_BYTES} bytes")
    try:
        data = json.loads(body or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest('the body must be a JSON object like {"active": 3}')
    unknown = sorted(set(data) - set(CAPTURE_FIELDS))
    if unknown:
        raise BadRequest(f"unknown fields {unknown}; known: {list(CAPTURE_FIELDS)}")
    if "active" not in data:
        raise BadRequest("active is required: the number of steps to record")
    for name in ("active", "warmup", "start_step"):
        if name in data and data[name] is not None and not is_int(data[name]):
            raise BadRequest(f"{name} must be an int, got {data[name]!r:.40}")
    ranks = data.get("ranks")
    if ranks is not None and (
        not isinstance(ranks, list) or len(ranks) > 100_000 or not all(is_int(r) for r in ranks)
    ):
        raise BadRequest("ranks must be a list of ints or null")
    out = {"active": data["active"], "ranks": ranks, "start_step": data.get("start_step")}
    if data.get("warmup") is not None:
        out["warmup"] = data["warmup"]
    return out
