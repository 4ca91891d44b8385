"""What a caller of the coordinator may send: pure checks with messages that say what to fix.

Any Ray client can call the coordinator's methods, so every argument is checked for its type
and for a size that makes sense before it touches the run: steps and ranks fit in an int64,
ranks stay below ``MAX_WORLD``, names are short.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from typing import Any, TypeVar

MAX_STEP = 2**63 - 1
MAX_WORLD = 1 << 20  # ranks are 0 .. MAX_WORLD - 1: a million GPUs is not a sane world size
MAX_SUMMARY_BYTES = 4 * 1024 * 1024  # as summary_codec.MAX_PAYLOAD_BYTES: checked before decoding
MAX_TEXT = 4096
TRAINER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


T = TypeVar("T")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A real, finite number (not a bool, not NaN, not infinite)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_step(value: Any) -> bool:
    """A global step: an int in 0 .. 2**63 - 1."""
    return is_int(value) and 0 <= value <= MAX_STEP


def is_rank(value: Any) -> bool:
    """A global rank: an int in 0 .. MAX_WORLD - 1."""
    return is_int(value) and 0 <= value < MAX_WORLD


def step_problem(name: str, value: Any) -> str | None:
    if is_step(value):
        return None
    return f"{name} must be an int in 0..2**63-1, got {_show(value)}"


def flag_problem(name: str, value: Any, none_ok: bool = False) -> str | None:
    """Why ``value`` is not a flag (True or False, or None when ``none_ok``), or None."""
    if isinstance(value, bool) or (none_ok and value is None):
        return None
    options = "True, False or None" if none_ok else "True or False"
    return f"{name} must be {options}, got {value!r:.80}"


def role_problem(value: Any) -> str | None:
    """Why ``value`` is not a role name, or None: a role names a directory in each window, so
    it is 1-64 letters, digits, '.', '_' or '-' (not starting with '.', '_' or '-')."""
    if isinstance(value, str) and TRAINER_ID.match(value):
        return None
    return f"role must be 1-64 letters, digits, '.', '_' or '-', got {_show(value)}"


def trainer_id_problem(value: Any) -> str | None:
    if isinstance(value, str) and TRAINER_ID.match(value):
        return None
    return f"trainer_id must be 1-64 letters, digits, '.', '_' or '-', got {_show(value)}"


def rank_handles(trainer_id: str, workers: Any) -> dict[int, Any]:
    """``{rank: handle}`` from a list in rank order or a dict; ValueError for anything else."""
    if isinstance(workers, dict):
        handles = {}
        for r, h in workers.items():
            if not is_rank(r):
                raise ValueError(
                    f"trainer {trainer_id!r}: worker rank {_show(r)} is not an int in "
                    f"0..{MAX_WORLD - 1}"
                )
            handles[r] = h
    elif isinstance(workers, (list, tuple)):
        if len(workers) > MAX_WORLD:
            raise ValueError(
                f"trainer {trainer_id!r}: {len(workers)} workers, more than {MAX_WORLD}"
            )
        handles = dict(enumerate(workers))
    else:
        raise ValueError(
            f"trainer {trainer_id!r}: workers must be a list of actor handles in rank order "
            f"or a dict rank -> handle, got {type(workers).__name__}"
        )
    if not handles:
        raise ValueError(f"trainer {trainer_id!r}: no workers given")
    return handles


def check_known_keys(keys: Any, names: list[str], prefix: str = "") -> None:
    """ValueError for the first key not in ``names``, naming the closest one.

    >>> check_known_keys(["actve"], ["active", "warmup"])
    Traceback (most recent call last):
    ...
    ValueError: profiler config: unknown key 'actve'; did you mean 'active'?
    """
    for key in keys:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"profiler config: unknown key {prefix + str(key)!r}{hint}")


def section_values(value: Any, fields: list[str], name: str) -> dict[str, Any]:
    """A config section's fields from a mapping (an OmegaConf one too): ValueError naming the
    section when it is not a mapping, and an unknown key by name (``check_known_keys``)."""
    if value is None or not hasattr(value, "keys"):
        raise ValueError(
            f"profiler config: {name!r} must be a mapping of {fields}, got "
            f"{type(value).__name__}: {value!r:.80}"
        )
    keys = list(value.keys())  # (OmegaConf mappings are not always iterable dicts)
    check_known_keys(keys, fields, f"{name}.")
    return {k: value[k] for k in keys}


def section_of(cls: type[T], value: Any, name: str) -> T:
    """A config section (a dataclass ``cls``) from a mapping, or ``value`` when it is one."""
    if isinstance(value, cls):
        return value
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    return cls(**section_values(value, names, name))


def span(ranks: list[int]) -> str:
    """``0-7`` for a contiguous list of ranks, else the list."""
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return str(ranks) if len(ranks) <= 16 else f"{ranks[:8]}... ({len(ranks)} ranks)"


def _show(value: Any) -> str:
    """A value for an error message, never longer than a line."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(value).__name__} {text}"


DRIVER_KEYS = ("pid", "node_id", "dump")
DUMP_KEYS = ("signal", "path", "main_thread", "note", "flight_recorder", "flight_recorder_note")


def checked_driver(driver: Any) -> dict[str, Any] | None:
    """A trainer's driver as ``register`` receives it (``pid``, ``node_id``, ``dump``): the
    checked copy, or ValueError naming what is wrong."""
    if driver is None:
        return None
    if not isinstance(driver, dict) or set(driver) - set(DRIVER_KEYS):
        raise ValueError(
            f"driver must be a dict with keys {', '.join(DRIVER_KEYS)}: {_show(driver)}"
        )
    pid, node = driver.get("pid"), driver.get("node_id")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise ValueError(f"driver pid must be an int > 0, got {_show(pid)}")
    if not isinstance(node, str) or not 0 < len(node) <= 256:
        raise ValueError(f"driver node_id must be a non-empty str, got {_show(node)}")
    dump = driver.get("dump")
    if dump is not None:
        if not isinstance(dump, dict) or set(dump) - set(DUMP_KEYS):
            raise ValueError(f"driver dump must be a dict with keys {', '.join(DUMP_KEYS)}")
        for key, value in dump.items():
            if isinstance(value, bool) or not isinstance(value, (int, str, type(None))):
                raise ValueError(f"driver dump {key!r} must be an int, a str or None")
            if isinstance(value, str) and len(value) > 4096:
                raise ValueError(f"driver dump {key!r} is longer than 4096 characters")
    return {"pid": pid, "node_id": node, "dump": dict(dump) if dump else None}
