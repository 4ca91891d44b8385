"""Which ranks of which role are profiled: the config's top-level ``ranks`` (for the ``policy``
role) and its ``roles`` mapping. Pure; the config, the coordinator and every rank use it.

    ranks: [0]                      # the policy's ranks (unless ``roles`` names ``policy``)
    roles:
      rollout: {ranks: [0]}         # generation rank 0 too
      critic: {ranks: all}

A role that neither names is not profiled: its ranks get no profiler RPC at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from coordinator.core.validate import MAX_WORLD, check_known_keys, role_problem

POLICY = "policy"
"""The role whose ranks the top-level ``ranks`` selects, unless ``roles`` names it."""
MAX_ROLES = 32
ROLE_FIELDS = ["ranks"]

RankSelection = list[int] | str
"""A sorted list of global ranks, or ``"all"``."""


def checked_ranks(value: Any, where: str = "'ranks'") -> RankSelection:
    """``value`` as a rank selection (a sorted list without repeats, or ``"all"``); ValueError
    naming ``where`` and the value otherwise."""
    if value is None:
        raise ValueError(f"profiler config: {where} is None; give a list of ranks or 'all'")
    if isinstance(value, str):
        if value != "all":
            raise ValueError(
                f"profiler config: {where} must be a list of ints or 'all', got {value!r:.80}"
            )
        return value
    if not isinstance(value, Sequence):
        raise ValueError(
            f"profiler config: {where} must be a list of ints or 'all', "
            f"got {type(value).__name__}: {value!r:.80}"
        )
    if len(value) == 0:
        raise ValueError(f"profiler config: {where} is empty; give at least one rank or 'all'")
    if len(value) > MAX_WORLD:
        raise ValueError(
            f"profiler config: {where} lists {len(value)} ranks, more than {MAX_WORLD}"
        )
    for r in value:
        if isinstance(r, bool) or not isinstance(r, int):
            raise ValueError(f"profiler config: {where} holds a non-int rank {r!r:.80}")
        if r < 0:
            raise ValueError(f"profiler config: {where} holds a negative rank {r}")
        if r >= MAX_WORLD:
            raise ValueError(f"profiler config: {where} holds rank {r}, beyond {MAX_WORLD - 1}")
    return sorted({int(r) for r in value})


def checked_roles(value: Any) -> dict[str, dict[str, RankSelection]]:
    """The config's ``roles``: ``{role: {"ranks": [...] | "all"}}``, checked; ValueError naming
    the role and field otherwise (YAML ``null`` included: give ``{}`` for no roles)."""
    if value is None or not isinstance(value, Mapping):
        raise ValueError(
            "profiler config: 'roles' must be a mapping of role name to {ranks: ...}, "
            f"got {type(value).__name__}: {value!r:.80}"
        )
    if len(value) > MAX_ROLES:
        raise ValueError(
            f"profiler config: 'roles' names {len(value)} roles, more than {MAX_ROLES}"
        )
    out: dict[str, dict[str, RankSelection]] = {}
    for role in list(value.keys()):
        problem = role_problem(role)
        if problem:
            raise ValueError(f"profiler config: 'roles': {problem}")
        spec = value[role]
        if spec is None or not isinstance(spec, Mapping):
            raise ValueError(
                f"profiler config: 'roles.{role}' must be a mapping like {{ranks: [0]}}, "
                f"got {type(spec).__name__}: {spec!r:.80}"
            )
        check_known_keys(list(spec.keys()), ROLE_FIELDS, prefix=f"roles.{role}.")
        if "ranks" not in spec:
            raise ValueError(f"profiler config: 'roles.{role}' needs 'ranks' (a list or 'all')")
        out[str(role)] = {"ranks": checked_ranks(spec["ranks"], f"'roles.{role}.ranks'")}
    return out


def role_ranks(
    ranks: RankSelection, roles: Mapping[str, Mapping[str, RankSelection]], role: str
) -> RankSelection | None:
    """The ranks of ``role`` that are profiled, or None when the role is not profiled."""
    if role in roles:
        return roles[role]["ranks"]
    return ranks if role == POLICY else None


def outside_ranks(chosen: RankSelection | None, world: Sequence[int]) -> list[int]:
    """The selected ranks a role's world does not have (none for ``all`` or an unselected
    role)."""
    if not isinstance(chosen, list):
        return []
    have = set(world)
    return [r for r in chosen if r not in have]


def trainer_of_role(roles: Mapping[str, str], role: str, trainer_id: str | None) -> str:
    """The trainer whose table ``role`` names (``roles``: trainer_id -> role); ValueError when
    no trainer, or several, have that role, or ``trainer_id`` has another role."""
    if trainer_id is not None:
        if roles.get(trainer_id, role) != role:
            raise ValueError(f"trainer {trainer_id!r} has role {roles[trainer_id]!r}, not {role!r}")
        return trainer_id
    mine = sorted(tid for tid, r in roles.items() if r == role)
    if not mine:
        known = sorted(set(roles.values()))
        raise ValueError(f"no trainer has role {role!r}; the roles registered: {known}")
    if len(mine) > 1:
        raise ValueError(f"trainers {mine} all have role {role!r}; name one with trainer_id")
    return mine[0]
