"""``trackers:`` in the profiler config: where each settled window's figures and the phase times
go besides the coordinator, the trainer's own tracker. Pure: no torch, no Ray, no tracker
imported (``trainers/trackers.py`` writes; this checks).

>>> Trackers.from_value({"tensorboard": {"log_dir": "/tmp/tb"}}).validate().tensorboard
{'log_dir': '/tmp/tb'}
>>> Trackers.from_value({"tensorboard": None})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: profiler config: 'trackers.tensorboard' must be a mapping (log_dir), got ...
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from coordinator.core.validate import check_known_keys

WANDB_MODES = ("online", "offline", "disabled")
FIELDS: dict[str, dict[str, bool]] = {
    "tensorboard": {"log_dir": True},
    "mlflow": {"tracking_uri": False, "experiment": False},
    "wandb": {"project": False, "mode": False},
}
"""Each tracker's keys, and whether the key is required."""
_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")


@dataclass
class Trackers:
    """Which trackers get the profiler's figures (see docs/own-trainer.md, "In your tracker").

    ``tensorboard: {log_dir}``, ``mlflow: {tracking_uri, experiment}``, ``wandb: {project,
    mode}``; a tracker left out is off. Each is an optional extra of the trainer's process.
    """

    tensorboard: dict[str, Any] | None = None
    """``{log_dir}``: TensorBoard event files go there (``torch.utils.tensorboard``; the
    ``tensorboard`` extra). A tracker is off when left out; a YAML ``null`` under its name is
    refused."""
    mlflow: dict[str, Any] | None = None
    """``{tracking_uri, experiment}`` (default: MLflow's own): the trainer's active MLflow run,
    else a run started in this experiment (the ``mlflow`` extra); a ``user:password@`` in the
    URI is never shown."""
    wandb: dict[str, Any] | None = None
    """``{project, mode}`` (default: W&B's own): the trainer's active W&B run, else one started
    in this project; ``mode``: ``online``, ``offline`` or ``disabled`` (the ``wandb`` extra)."""

    @classmethod
    def from_value(cls, value: Any) -> Trackers:
        """From a mapping (a dict, a YAML mapping, an OmegaConf node) or a ``Trackers``."""
        if isinstance(value, Trackers):
            return value
        if not hasattr(value, "keys") or not hasattr(value, "__getitem__"):
            raise ValueError(
                f"profiler config: 'trackers' must be a mapping of {list(FIELDS)}, got "
                f"{type(value).__name__}: {value!r:.80}"
            )
        keys = list(value.keys())
        check_known_keys(keys, list(FIELDS), "trackers.")
        return cls(**{k: _plain(k, value[k]) for k in keys})

    def validate(self) -> Trackers:
        """Raise ValueError naming the field and the value; returns self."""
        for name, spec in FIELDS.items():
            given = getattr(self, name)
            if given is None:
                continue
            check_known_keys(list(given), list(spec), f"trackers.{name}.")
            for key, required in spec.items():
                value = given.get(key)
                if value is None and not required:
                    continue
                if not isinstance(value, str) or not value.strip():
                    raise ValueError(
                        f"profiler config: 'trackers.{name}.{key}' must be a non-empty string, "
                        f"got {type(value).__name__}: {value!r:.80}"
                    )
        mode = (self.wandb or {}).get("mode")
        if mode is not None and mode not in WANDB_MODES:
            raise ValueError(
                f"profiler config: 'trackers.wandb.mode' must be one of {', '.join(WANDB_MODES)}"
                f", got {mode!r:.80}"
            )
        return self

    def any(self) -> bool:
        """Whether any tracker is on."""
        return any(getattr(self, f.name) is not None for f in dataclasses.fields(self))

    def to_dict(self) -> dict[str, Any]:
        """A plain copy of the trackers that are on (``from_value`` takes it back)."""
        return {k: dict(v) for k, v in dataclasses.asdict(self).items() if v is not None}

    def public(self) -> dict[str, Any]:
        """``to_dict`` with any ``user:password@`` in a tracking URI redacted."""
        out = self.to_dict()
        uri = (out.get("mlflow") or {}).get("tracking_uri")
        if uri:
            out["mlflow"]["tracking_uri"] = _USERINFO.sub("***@", uri)
        return out


def _plain(name: str, value: Any) -> dict[str, Any]:
    """One tracker's mapping as a dict of plain values; YAML ``null`` is refused (a tracker
    is turned off by leaving it out, never by a key with nothing under it)."""
    if not hasattr(value, "keys") or not hasattr(value, "__getitem__"):
        keys = ", ".join(FIELDS[name])
        raise ValueError(
            f"profiler config: 'trackers.{name}' must be a mapping ({keys}), got "
            f"{type(value).__name__}: {value!r:.80}; leave the key out to turn it off"
        )
    return {str(k): value[k] for k in list(value.keys())}
