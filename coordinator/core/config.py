"""ProfilerConfig: what to profile, when, and where the files go. Imports neither torch nor Ray."""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.core.attach import Attach
from coordinator.core.findings import checked_advise
from coordinator.core.memory_config import Memory, MemorySnapshot
from coordinator.core.roles import POLICY, checked_ranks, checked_roles, role_ranks
from coordinator.core.slowdown import AutoCapture
from coordinator.core.storage import check_backend, is_remote, local_path, redact
from coordinator.core.trackers_config import Trackers
from coordinator.core.validate import check_known_keys
from coordinator.protocol.collective_replies import DEFAULT_COLLECTIVES_CAP, MAX_COLLECTIVES
from coordinator.protocol.summary_codec import DEFAULT_TOP_K

ACTIVITIES = ("cpu", "cuda")
EXPORT_TYPES = ("chrome_trace", "chrome_trace_gz", "stacks", "none")
ENGINES = ("torch", "kineto")
_RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


FANOUTS = ("node", "direct")
SECTIONS: dict[str, Any] = {
    "auto_capture": AutoCapture,
    "trackers": Trackers,
    "attach": Attach,
    "memory": Memory,
    "memory_snapshot": MemorySnapshot,
}
"""The config's sections: each a class with ``from_value`` and ``validate``."""


@dataclass
class ProfilerConfig:
    """Profiling settings shared by the coordinator and every rank.

    The schedule fields mean exactly what they mean in ``torch.profiler.schedule``, counted in
    absolute global steps, so a run resumed at step 500 profiles exactly the steps an
    uninterrupted run would have. Build it with ``from_dict`` (a dict, a YAML mapping or an
    OmegaConf node) and check it with ``validate``; both raise ValueError naming the field and
    the value. Every field is listed in docs/reference.md.

    Example:

    >>> cfg = ProfilerConfig.from_dict(
    ...     {"enable": True, "save_path": "/tmp/profiles", "wait": 10, "active": 2, "repeat": 0}
    ... )
    >>> cfg.ranks, cfg.warmup, cfg.selects(0), cfg.selects(1)
    ([0], 1, True, False)
    >>> ProfilerConfig.from_dict({"actve": 2})
    Traceback (most recent call last):
    ...
    ValueError: profiler config: unknown key 'actve'; did you mean 'active'?
    >>> ProfilerConfig.from_dict({"warmup": None})
    Traceback (most recent call last):
    ...
    ValueError: profiler config: 'warmup' must be an int, got NoneType: None
    """

    enable: bool = False
    """Master switch; a disabled config makes the hooks no-ops and needs no ``save_path``."""
    ranks: list[int] | str = field(default_factory=lambda: [0])
    """Global ranks of the ``policy`` role to profile, or ``"all"``."""
    roles: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Ranks to profile per role: ``{rollout: {ranks: [0]}, critic: {ranks: all}}``, each
    role's own ``ranks`` (its only field), checked against that role's world at ``register``.
    It overrides ``ranks`` for a ``policy`` it names. A registered role named nowhere (neither
    ``policy`` nor in ``roles``) is not profiled and gets no RPC. Every selected rank of every
    role opens and closes each window on the same global steps."""
    save_path: str | None = None
    """Where traces go, required when enabled: a directory (must be, or be creatable as, a
    writable one) or an fsspec URL (``s3://bucket/prefix``, ``gs://...``, ``az://...``,
    ``file://...``); a URL's backend must be installed (``pip install '.[s3]'``, ``'.[gcs]'``,
    ``'.[azure]'``: s3fs, gcsfs, adlfs), its endpoint need not be reachable at config time."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Passed as is to ``fsspec.filesystem(protocol, **storage_options)`` for a URL
    ``save_path``: endpoint, region and the like (credentials are better left to the usual
    environment variables and instance roles; any given here are redacted, ``<redacted>``,
    wherever the config is shown)."""
    staging_path: str | None = None
    """With a URL ``save_path``: the local directory on each node where traces are written and
    wait for upload; default ``$RAY_PROFILER_STAGING``, else ``<tmp>/ray-profiler-<uid>/staging``
    (``$RAY_PROFILER_STAGING`` in a node's environment wins, so each node can have its own).
    Private to the user: made 0700, refused (the rank disabled, saying why) when it is a link,
    another user's or open to others."""
    keep_local: bool = False
    """Keep the staging copy of a trace after it was uploaded."""
    run_name: str | None = None
    """Sub-directory of ``save_path`` for this run; default ``run_<UTC start time>``."""
    skip_first: int = 0
    """Steps to skip before the first cycle. The schedule fields are those of
    ``torch.profiler.schedule``, counted in absolute global steps."""
    wait: int = 0
    """Idle steps at the start of each cycle."""
    warmup: int = 1
    """Steps the profiler runs without recording before each window."""
    active: int = 3
    """Recorded steps per window (at least 1)."""
    repeat: int = 1
    """Number of cycles; 0 means the whole run."""
    skip_first_wait: bool = False
    """Skip the ``wait`` phase of the first cycle."""
    on_demand_only: bool = False
    """No scheduled windows; only captures requested at run time."""
    activities: list[str] = field(default_factory=lambda: ["cpu", "cuda"])
    """``"cpu"`` and/or ``"cuda"``; a rank without a GPU records cpu only and says so."""
    record_shapes: bool = False
    """Passed to ``torch.profiler.profile``: record the input shapes of ops."""
    profile_memory: bool = False
    """Passed to ``torch.profiler.profile``: record tensor allocations and frees."""
    with_stack: bool = False
    """Passed to ``torch.profiler.profile``: record the source of each op (Python stacks)."""
    with_flops: bool = False
    """Passed to ``torch.profiler.profile``: estimate the FLOPs of matrix products and
    convolutions."""
    with_modules: bool = False
    """Passed to ``torch.profiler.profile``: record the module hierarchy of each op."""
    export_type: str = "chrome_trace_gz"
    """``chrome_trace``, ``chrome_trace_gz``, ``stacks`` (needs ``with_stack``) or ``none``
    (the summary only)."""
    engine: str = "torch"
    """``torch`` (``torch.profiler`` in the rank) or ``kineto`` (libkineto's on-demand tracing
    with the node agent as its daemon; the ranks need ``worker_ext.kineto_env(directory=None,
    setup_hook=True)`` in their environment, whose setup hook makes the daemon directory on
    each rank's node; the hook's variable is left out with ``setup_hook=False``, and where the
    job has a ``worker_process_setup_hook`` of its own (a warning unless it is
    ``worker_ext.attach.setup``: that hook should call ``worker_ext.attach.kineto_setup()``).
    See docs/attach.md, "Two engines"."""
    top_k: int = DEFAULT_TOP_K
    """Kernels kept per rank per window in the summary."""
    collectives_cap: int = DEFAULT_COLLECTIVES_CAP
    """Collectives kept per rank per window in the summary, whole steps in order (0 to
    ``MAX_COLLECTIVES``); those past it are folded per (group, kind, bytes) and not matched
    across ranks (docs/collectives.md). About 56 bytes each in a summary and the coordinator."""
    worker_timeout_s: float = 60.0
    """Seconds the coordinator waits for a rank's acknowledgement before marking it
    unresponsive (configuring a rank warms Kineto up and may take ``max(120 s, this)``)."""
    max_windows: int = 64
    """Closed windows whose summaries the coordinator keeps in memory."""
    detail_windows: int = 8
    """Most recent closed windows that keep per-rank values (rank x kernel views)."""
    straggler_threshold: float = 1.25
    """Flag a rank whose step time or kernel time exceeds this multiple of the median."""
    max_capture_steps: int = 1000
    """The most steps (warm-up and recorded) one on-demand capture may ask for."""
    fanout: str = "node"
    """How window commands reach the ranks: ``node`` (through each node's agent, one call per
    group of nodes, about sqrt(nodes) calls per command; docs/architecture.md, "Per-node
    fan-out") or ``direct`` (one call per rank from the coordinator)."""
    agent_idle_exit_s: float = 600.0
    """A node agent with nothing to do for this long, while no coordinator it served has a live
    run, exits (0: never)."""
    record: bool = True
    """Keep the run's record in ``{save_path}/{run}/record/``: its windows' tables, phase
    times, stalls and marks, read with ``ray-profiler --from`` after the cluster is gone
    (docs/views.md, "After the run"); nothing without ``save_path``."""
    stall_watch: bool = True
    """Take every rank's stack when the stepping trainer's steps stop coming (a stall)."""
    stall_factor: float = 5.0
    """A stall: no step for ``stall_factor`` x the median step time (over the last 32 step
    reports, each the mean per step since the one before), ..."""
    stall_min_s: float = 60.0
    """... and for at least this many seconds; the watch begins at the run's first step
    report."""
    regression_threshold: float = 1.25
    """The least rise a regression mark needs: a kernel's time scaled by its window (over its
    usual time, divided by the weighted median of the other kernels' such ratios) or as it is
    when that was steadier, or the step time, at least this factor over the median of the
    run's earlier windows, besides passing their spread (``status()``, ``kernel_diff``;
    docs/results.md, "Window diffs and regression marks")."""
    advise: dict[str, dict[str, float]] = field(default_factory=dict)
    """The findings' thresholds, by rule: ``{rule_id: {threshold: value}}`` (``ray-profiler
    advise``; each rule's thresholds, defaults and their sources in docs/advise.md)."""
    auto_capture: AutoCapture = field(default_factory=AutoCapture)
    """Profile slow steps by themselves: ``enable``, ``slowdown_ratio``, ``after_steps``,
    ``active``, ``warmup``, ``cooldown_steps``, ``max_per_run``, ``ignore_first``,
    ``baseline_steps`` (see ``coordinator.core.slowdown.AutoCapture``); off by default."""
    trackers: Trackers = field(default_factory=Trackers)
    """Where each settled window's figures and the phase times go in the trainer's process:
    ``tensorboard: {log_dir}``, ``mlflow: {tracking_uri, experiment}``, ``wandb: {project,
    mode}`` (see ``coordinator.core.trackers_config.Trackers``); none by default."""
    memory: Memory = field(default_factory=Memory)
    """Every rank's memory sampled by the node agents, and leak marks (``Memory``)."""
    memory_snapshot: MemorySnapshot = field(default_factory=MemorySnapshot)
    """CUDA memory snapshots, on CUDA ranks only: ``on`` window, oom, demand
    (``MemorySnapshot``; docs/memory-and-stalls.md, "CUDA memory snapshots")."""
    attach: Attach = field(default_factory=Attach)
    """The attach hook's settings (``worker_ext.attach.setup``): ``trainer_id``, ``role``,
    ``actor_classes``, and the coordinator's ``name`` and ``namespace`` (see
    ``coordinator.core.attach.Attach``)."""

    @classmethod
    def from_dict(
        cls, mapping: Mapping[str, Any] | Any, check_paths: bool = True
    ) -> ProfilerConfig:
        """Build and validate a config from a dict or an OmegaConf-style mapping.

        Args:
            mapping: the fields (a dict, a YAML mapping, an OmegaConf node); None gives the
                defaults, a disabled config.
            check_paths: probe that a local ``save_path`` (or ``staging_path``) is writable
                from this process; the coordinator passes False (it may not mount it).

        Returns:
            The validated config.

        Raises:
            ValueError: an unknown key (naming the closest valid one), or a value of the
                wrong type or range, YAML ``null`` included (naming the field and the value).

        Example:

        >>> ProfilerConfig.from_dict({"enable": True, "save_path": "/tmp/p", "ranks": "all"}).ranks
        'all'
        """
        if mapping is None:
            return cls().validate(check_paths)
        if not hasattr(mapping, "keys") or not hasattr(mapping, "__getitem__"):
            raise ValueError(
                f"profiler config: expected a mapping, got {type(mapping).__name__}: {mapping!r}"
            )
        names = [f.name for f in dataclasses.fields(cls)]
        values: dict[str, Any] = {}
        keys = list(mapping.keys())  # (OmegaConf mappings are not always iterable dicts)
        check_known_keys(keys, names)
        for key in keys:
            section = SECTIONS.get(key)
            values[key] = section.from_value(mapping[key]) if section else _plain(mapping[key])
        return cls(**values).validate(check_paths)

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON- and msgpack-friendly copy."""
        out = dataclasses.asdict(self)
        out["ranks"] = list(self.ranks) if isinstance(self.ranks, list) else self.ranks
        out["roles"] = {
            role: {"ranks": list(r) if isinstance(r, list) else r}
            for role, spec in self.roles.items()
            for r in [spec["ranks"]]
        }
        out["storage_options"] = dict(self.storage_options)
        for name in ("trackers", "attach", "memory", "memory_snapshot"):
            out[name] = getattr(self, name).to_dict()
        return out

    def public_dict(self) -> dict[str, Any]:
        """``to_dict`` with every storage option that may be a credential redacted: the form
        that ``status()``, logs and the CLI show."""
        out = self.to_dict()
        out["storage_options"] = redact(self.storage_options)
        out["trackers"] = self.trackers.public()
        return out

    @property
    def remote(self) -> bool:
        """Whether traces are uploaded to a URL (``save_path`` is ``s3://...`` and the like)."""
        return is_remote(self.save_path)

    def validate(self, check_paths: bool = True) -> ProfilerConfig:
        """Check every field; raise ValueError naming the field and value. Returns self.

        ``check_paths=False`` skips the probe that ``save_path`` is writable from this process
        (the coordinator may run on a node that does not mount it).
        """
        _check_bool(self, "enable")
        for name in (
            "skip_first_wait",
            "on_demand_only",
            "record_shapes",
            "profile_memory",
            "with_stack",
            "with_flops",
            "with_modules",
            "keep_local",
            "stall_watch",
            "record",
        ):
            _check_bool(self, name)
        for name in ("skip_first", "wait", "warmup", "repeat"):
            _check_int(self, name, minimum=0)
        _check_int(self, "active", minimum=1)
        _check_int(self, "top_k", minimum=1)
        _check_int(self, "collectives_cap", minimum=0, maximum=MAX_COLLECTIVES)
        _check_int(self, "max_windows", minimum=1)
        _check_number(self, "worker_timeout_s", minimum_exclusive=0.0)
        _check_int(self, "detail_windows", minimum=0)
        _check_number(self, "straggler_threshold", minimum_exclusive=1.0)
        _check_int(self, "max_capture_steps", minimum=1)
        _check_number(self, "agent_idle_exit_s", minimum=0.0)
        _check_number(self, "stall_factor", minimum=1.0)
        _check_number(self, "stall_min_s", minimum_exclusive=0.0)
        _check_number(self, "regression_threshold", minimum_exclusive=1.0)
        if self.fanout not in FANOUTS:
            raise ValueError(
                f"profiler config: 'fanout' must be one of {', '.join(FANOUTS)}, "
                f"got {self.fanout!r:.80}"
            )
        for name in ("skip_first", "wait", "warmup", "active", "repeat", "max_capture_steps"):
            if getattr(self, name) > 2**62:
                raise ValueError(
                    f"profiler config: {name!r} must be at most 2**62 steps, "
                    f"got {getattr(self, name)}"
                )
        for name, section in SECTIONS.items():
            setattr(self, name, section.from_value(getattr(self, name)).validate())
        self.advise = checked_advise(self.advise)
        self.ranks = checked_ranks(self.ranks)
        self.roles = checked_roles(self.roles)
        _validate_activities(self)
        _validate_export(self)
        _validate_run_name(self)
        _validate_storage(self)
        _validate_save_path(self, check_paths)
        return self

    def selects(self, rank: int, role: str = POLICY) -> bool:
        """Whether ``rank`` of ``role`` is profiled under this config (see ``roles``). A rank
        list is looked up in a set kept beside it: a window over a 10,000-rank list opens in
        O(ranks), not O(ranks^2) (389 ms -> 7.5 ms for 10,000 lookups)."""
        chosen = role_ranks(self.ranks, self.roles, role)
        if not isinstance(chosen, list):
            return chosen == "all"
        sets = self.__dict__.setdefault("_rank_sets", {})
        kept = sets.get(role)
        if kept is None or kept[0] is not chosen or kept[1] != len(chosen):
            kept = sets[role] = (chosen, len(chosen), frozenset(chosen))
        return rank in kept[2]

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (the checkpoint) without the sets ``selects`` keeps."""
        state = dict(self.__dict__)
        state.pop("_rank_sets", None)
        return state


def _validate_activities(cfg: ProfilerConfig) -> None:
    acts: Any = cfg.activities  # whatever a YAML file held
    if acts is None or isinstance(acts, str) or not isinstance(acts, Sequence):
        raise ValueError(
            f"profiler config: 'activities' must be a list drawn from {list(ACTIVITIES)}, "
            f"got {acts!r}"
        )
    if len(acts) == 0:
        raise ValueError("profiler config: 'activities' is empty; use ['cpu'] or ['cpu', 'cuda']")
    for a in acts:
        if a not in ACTIVITIES:
            raise ValueError(
                f"profiler config: 'activities' holds unknown activity {a!r}; "
                f"known: {list(ACTIVITIES)}"
            )
    cfg.activities = list(dict.fromkeys(acts))


def _validate_save_path(cfg: ProfilerConfig, check_paths: bool) -> None:
    path: Any = cfg.save_path
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ValueError(
            f"profiler config: 'save_path' must be a path string or a URL, "
            f"got {type(path).__name__}: {path!r}"
        )
    if path is not None:
        cfg.save_path = local_path(os.fspath(path))
    if not cfg.enable:
        return
    if not cfg.save_path:
        raise ValueError("profiler config: 'save_path' is required when 'enable' is True")
    if is_remote(cfg.save_path):
        # A missing backend is a config error; an unreachable endpoint is not (ranks report it).
        check_backend(cfg.save_path)
        if check_paths and cfg.staging_path:
            check_writable_dir(cfg.staging_path, "staging_path")
        return
    if check_paths:
        check_writable_dir(cfg.save_path)


def _validate_storage(cfg: ProfilerConfig) -> None:
    """``storage_options`` is a mapping of string keys, ``staging_path`` a local path."""
    opts: Any = cfg.storage_options
    if opts is None or not isinstance(opts, Mapping):
        raise ValueError(
            "profiler config: 'storage_options' must be a mapping of fsspec options "
            f"(use {{}} for none), got {type(opts).__name__}: {redact_value(opts)!r}"
        )
    bad = [k for k in opts if not isinstance(k, str)]
    if bad:
        raise ValueError(f"profiler config: 'storage_options' keys must be strings, got {bad!r}")
    cfg.storage_options = dict(opts)
    if len(repr(opts)) > 64 * 1024:
        raise ValueError("profiler config: 'storage_options' is larger than 64 KiB")
    staging: Any = cfg.staging_path
    if staging is not None and (
        not isinstance(staging, (str, os.PathLike)) or is_remote(str(staging))
    ):
        raise ValueError(
            "profiler config: 'staging_path' must be a local directory path, "
            f"got {type(staging).__name__}: {staging!r}"
        )
    if staging is not None:
        cfg.staging_path = os.fspath(staging)


def check_writable_dir(path: str, name: str = "save_path") -> None:
    """Raise ValueError unless ``path`` is (or can be created as) a writable directory."""
    probe = os.path.abspath(path)
    if os.path.exists(probe):
        if not os.path.isdir(probe):
            raise ValueError(f"profiler config: {name!r} {path!r} exists and is not a directory")
    else:
        # The nearest existing ancestor must be a directory we can create things in.
        while not os.path.exists(probe):
            parent = os.path.dirname(probe)
            if parent == probe:
                break
            probe = parent
        if not os.path.isdir(probe):
            raise ValueError(
                f"profiler config: {name!r} {path!r} cannot be created: "
                f"{probe!r} is not a directory"
            )
    try:  # os.access lies for root and read-only mounts; a real file tells the truth
        fd, name = tempfile.mkstemp(prefix=".profiler-probe-", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise ValueError(
            f"profiler config: {name!r} {path!r} is not writable ({probe!r}: {exc.strerror})"
        ) from exc


def _plain(value: Any) -> Any:
    """Turn OmegaConf ListConfig/DictConfig-like values into plain lists."""
    if isinstance(value, (str, bytes)) or value is None:
        return value
    if isinstance(value, Sequence) or (
        hasattr(value, "__iter__") and hasattr(value, "__len__") and not hasattr(value, "keys")
    ):
        return [_plain(v) for v in value]
    return value


def _validate_export(cfg: ProfilerConfig) -> None:
    if cfg.engine not in ENGINES:
        raise ValueError(
            f"profiler config: 'engine' is {cfg.engine!r}; expected one of {list(ENGINES)}"
        )
    if cfg.export_type not in EXPORT_TYPES:
        raise ValueError(
            f"profiler config: 'export_type' is {cfg.export_type!r}; "
            f"expected one of {list(EXPORT_TYPES)}"
        )
    if cfg.export_type == "stacks" and not cfg.with_stack:
        raise ValueError(
            "profiler config: 'export_type' is 'stacks' but 'with_stack' is False; "
            "stacks need with_stack=True"
        )


def _validate_run_name(cfg: ProfilerConfig) -> None:
    name = cfg.run_name
    if name is None:
        return
    if not isinstance(name, str) or not _RUN_NAME_RE.match(name):
        raise ValueError(
            f"profiler config: 'run_name' {name!r} must be one path component of letters, "
            "digits, '.', '_' or '-' (at most 128, not starting with '.')"
        )


def _check_bool(cfg: ProfilerConfig, name: str) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, bool):
        raise ValueError(
            f"profiler config: {name!r} must be true or false, "
            f"got {type(value).__name__}: {value!r}"
        )


def _check_int(cfg: ProfilerConfig, name: str, minimum: int, maximum: int | None = None) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"profiler config: {name!r} must be an int, got {type(value).__name__}: {value!r}"
        )
    if value < minimum:
        raise ValueError(f"profiler config: {name!r} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"profiler config: {name!r} must be <= {maximum}, got {value}")


def _check_number(
    cfg: ProfilerConfig,
    name: str,
    minimum_exclusive: float | None = None,
    minimum: float | None = None,
) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"profiler config: {name!r} must be a number, got {type(value).__name__}: {value!r}"
        )
    if minimum_exclusive is not None:
        low_ok = value > minimum_exclusive
    else:
        low_ok = minimum is None or value >= minimum
    if not low_ok or value != value or value == float("inf"):
        bound = f"> {minimum_exclusive}" if minimum_exclusive is not None else f">= {minimum}"
        raise ValueError(f"profiler config: {name!r} must be a finite number {bound}, got {value}")


def redact_value(value: Any) -> Any:
    """A value for an error message: a mapping with its credentials hidden."""
    return redact(value) if isinstance(value, dict) else value
