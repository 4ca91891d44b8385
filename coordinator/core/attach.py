"""The attach hook's pure parts: its config (``ProfilerConfig.attach``), reading the config from
``RAY_PROFILER_CONFIG``, and who a process is once it steps an optimizer.

A process attached by ``worker_ext.attach.setup`` (Ray's ``worker_process_setup_hook``) becomes
a rank at its first optimizer step. Its rank and world come from ``torch.distributed`` when it
is initialised, else from Ray Train's context, else from its actor class (its index among the
job's live actors of that class, in actor-id order). Its trainer id is ``attach.trainer_id``,
else Ray Train's experiment name, else ``attached``; a Ray actor outside Ray Train adds its
class (``attached.PolicyWorker``), so two actor groups that each number their ranks from 0 are
two trainers.

>>> a = Attach()
>>> identify(a, dist=(1, 2), train=None, actor=("PolicyWorker", 0, 4)).describe()
'attached.PolicyWorker rank 1 of 2 (torch.distributed)'
>>> identify(a, dist=None, train=(0, 2, "sft-7"), actor=("RayTrainWorker", 1, 2)).describe()
'sft-7 rank 0 of 2 (ray.train)'
>>> identify(Attach(actor_classes=["Critic"]), dist=None, train=None, actor=("Policy", 0, 2))
"actor class 'Policy' is not in attach.actor_classes ['Critic']"
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from coordinator.core.validate import is_int, role_problem, section_values, trainer_id_problem
from coordinator.protocol.names import DEFAULT_NAME, DEFAULT_NAMESPACE
from coordinator.protocol.replies import AttachedEntry, AttachProblemEntry

CONFIG_ENV = "RAY_PROFILER_CONFIG"
"""The environment variable that holds the attach hook's config: a YAML file's path, or the
YAML text itself."""
DEFAULT_TRAINER_ID = "attached"
MAX_CONFIG_BYTES = 1 << 20
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
MAX_TEXT = 200  # characters kept of any text an attached process sends
MAX_PROBLEM = 1000
SOURCES = ("torch.distributed", "ray.train", "actor")


@dataclass
class Attach:
    """What the attach hook profiles (``ProfilerConfig.attach``)."""

    trainer_id: str | None = None
    """The attached ranks' trainer id; default Ray Train's experiment name, else ``attached``.
    A Ray actor outside Ray Train adds its class: ``attached.PolicyWorker``."""
    role: str = "policy"
    """The role of the attached ranks (``ranks`` and ``roles`` select among them)."""
    actor_classes: list[str] | None = None
    """Only processes that are actors of these classes (by class name) are profiled; default
    every process that steps an optimizer."""
    name: str = DEFAULT_NAME
    """The coordinator actor's name (it is created on demand)."""
    namespace: str = DEFAULT_NAMESPACE
    """The coordinator actor's namespace."""
    skyrl: bool = False
    """SkyRL's own ``trainer.policy.torch_profiler_config`` drives the coordinator: its policy
    workers' profiler (``build_profiler_from_policy_cfg``) becomes a coordinated one, stepped
    on SkyRL's global steps; no other process is attached by its optimizer steps."""

    @classmethod
    def from_value(cls, value: Any) -> Attach:
        """From a mapping (unknown keys refused by name), or an ``Attach``."""
        if isinstance(value, Attach):
            return value
        fields = section_values(value, [f.name for f in dataclasses.fields(cls)], "attach")
        return cls(**{k: _plain_list(v) for k, v in fields.items()})

    def validate(self) -> Attach:
        """Raise ValueError naming the field and the value; returns self."""
        if self.trainer_id is not None and trainer_id_problem(self.trainer_id):
            raise ValueError(
                f"profiler config: 'attach.trainer_id': {trainer_id_problem(self.trainer_id)}"
            )
        if problem := role_problem(self.role):
            raise ValueError(f"profiler config: 'attach.role': {problem}")
        classes: Any = self.actor_classes
        if classes is not None and (
            not isinstance(classes, list)
            or not classes
            or not all(isinstance(c, str) and c.isidentifier() for c in classes)
        ):
            raise ValueError(
                "profiler config: 'attach.actor_classes' must be null (every process) or a "
                f"non-empty list of class names, got {type(classes).__name__}: {classes!r:.80}"
            )
        if not isinstance(self.skyrl, bool):
            raise ValueError(
                "profiler config: 'attach.skyrl' must be true or false, "
                f"got {type(self.skyrl).__name__}: {self.skyrl!r:.80}"
            )
        for name in ("name", "namespace"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or len(value) > 128:
                raise ValueError(
                    f"profiler config: 'attach.{name}' must be a non-empty string of at most "
                    f"128 characters, got {type(value).__name__}: {value!r:.80}"
                )
        return self

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["actor_classes"] = None if self.actor_classes is None else list(self.actor_classes)
        return out


@dataclass(frozen=True)
class Identity:
    """An attached process as a rank: its trainer, rank, world and where they came from."""

    trainer_id: str
    rank: int
    world_size: int
    source: str  # "torch.distributed", "ray.train" or "actor"

    def describe(self) -> str:
        return f"{self.trainer_id} rank {self.rank} of {self.world_size} ({self.source})"


def identify(
    attach: Attach,
    dist: tuple[int, int] | None,
    train: tuple[int, int, str] | None,
    actor: tuple[str, int, int] | None,
) -> Identity | str:
    """Who this process is as a rank, or why it is not profiled (see the module docstring).

    Args:
        dist: ``torch.distributed``'s (rank, world size), when it is initialised.
        train: Ray Train's (world rank, world size, experiment name), in a Ray Train worker.
        actor: (class name, index, count) of this Ray actor among the job's live actors of its
            class, when this process is an actor.
    """
    cls = actor[0] if actor is not None else None
    if attach.actor_classes is not None and cls not in attach.actor_classes:
        what = f"actor class {cls!r}" if cls else "this process (not an actor)"
        return f"{what} is not in attach.actor_classes {attach.actor_classes}"
    base = attach.trainer_id or (safe_id(train[2]) if train else None) or DEFAULT_TRAINER_ID
    trainer_id = base if train is not None or cls is None else safe_id(f"{base}.{cls}")
    if dist is not None:
        return Identity(trainer_id, dist[0], dist[1], "torch.distributed")
    if train is not None:
        return Identity(trainer_id, train[0], train[1], "ray.train")
    if actor is not None:
        return Identity(trainer_id, actor[1], actor[2], "actor")
    return (
        "no rank identity: torch.distributed is not initialised, this is not a Ray Train "
        "worker, and not a Ray actor"
    )


def safe_id(text: str) -> str:
    """``text`` as a trainer id: characters outside letters, digits, '.', '_' and '-' become
    '_', at most 64 characters, never starting with one of '._-'."""
    out = _UNSAFE.sub("_", text)[:64].lstrip("._-")
    return out or DEFAULT_TRAINER_ID


def read_source(value: str | None) -> Mapping[str, Any]:
    """The config mapping that ``RAY_PROFILER_CONFIG`` names: a YAML file's path, or the YAML
    text itself; a mapping whose only key is ``profiler`` (a trainer's whole config file) is
    read as its ``profiler`` section.

    Raises:
        ValueError: unset, no such file, unreadable, too large, not YAML, or not a mapping;
            the message names the variable and what to do.
    """
    import yaml

    if value is None or not value.strip():
        raise ValueError(
            f"{CONFIG_ENV} is not set: give the workers a YAML file's path or the YAML text "
            f'(runtime_env={{"env_vars": {{"{CONFIG_ENV}": "/shared/profiler.yaml"}}}})'
        )
    text, where = value, f"{CONFIG_ENV} (YAML text)"
    if "\n" not in value and ":" not in value and "{" not in value:
        where = f"{CONFIG_ENV} file {value!r}"
        try:
            if os.path.getsize(value) > MAX_CONFIG_BYTES:
                raise ValueError(f"{where} is larger than {MAX_CONFIG_BYTES} bytes")
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ValueError(
                f"{where} cannot be read ({exc.strerror or exc}): give an existing YAML file "
                "on every node, or the YAML text itself"
            ) from exc
    if len(text) > MAX_CONFIG_BYTES:
        raise ValueError(f"{where} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{where} is not valid YAML: {str(exc).splitlines()[0]}") from exc
    if isinstance(loaded, Mapping) and list(loaded.keys()) == ["profiler"]:
        loaded = loaded["profiler"]
    if not isinstance(loaded, Mapping):
        raise ValueError(
            f"{where} must hold a mapping of profiler fields, got {type(loaded).__name__}"
        )
    return loaded


def engine_of(value: str | None) -> str | None:
    """The capture engine the attach hook's config asks for (``read_source``): its ``engine``
    when it says ``enable: true``; None when it is off, or unreadable (the first optimizer step
    refuses it, and says why)."""
    try:
        mapping = read_source(value)
    except ValueError:
        return None
    if mapping.get("enable") is not True:
        return None
    engine = mapping.get("engine", "torch")
    return engine if isinstance(engine, str) else None


def attached_entry(value: Any) -> AttachedEntry | None:
    """What ``attach_rank``'s ``where["attached"]`` says of the rank, bounded; None when it is
    not a mapping or names no known ``source`` (a caller other than the hook)."""
    if not isinstance(value, Mapping) or value.get("source") not in SOURCES:
        return None
    return {
        "job_id": _text(value.get("job_id")),
        "actor_class": _text(value.get("actor_class")),
        "pid": _int(value.get("pid")),
        "node_id": _text(value.get("node_id")),
        "source": str(value["source"]),
        "optimizer": _text(value.get("optimizer")) or "?",
    }


def problem_entry(where: Any, problem: Any, now: float) -> AttachProblemEntry:
    """A line of ``status()["attach_problems"]`` from what a process sent, bounded.

    Raises:
        ValueError: ``problem`` is not a non-empty string, or ``where`` not a mapping.
    """
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"problem must be a non-empty string, got {type(problem).__name__}")
    if not isinstance(where, Mapping):
        raise ValueError(f"where must be a mapping, got {type(where).__name__}")
    trainer = where.get("trainer_id")
    return {
        "at": now,
        "problem": problem[:MAX_PROBLEM],
        "pid": _int(where.get("pid")),
        "node_id": _text(where.get("node_id")),
        "job_id": _text(where.get("job_id")),
        "actor_class": _text(where.get("actor_class")),
        "trainer_id": trainer if trainer_id_problem(trainer) is None else None,
        "rank": _int(where.get("rank")),
    }


def _text(value: Any) -> str | None:
    return value[:MAX_TEXT] if isinstance(value, str) else None


def _int(value: Any) -> int | None:
    return int(value) if is_int(value) and 0 <= value < 2**63 else None


def _plain_list(value: Any) -> Any:
    if isinstance(value, (str, bytes)) or value is None or hasattr(value, "keys"):
        return value
    if hasattr(value, "__iter__"):
        return list(value)
    return value
