"""The trackers a trainer's figures go to: TensorBoard, MLflow, W&B (each an optional extra of
the trainer's process), or the trainer's own ``log(metrics, step)`` callable, as SkyRL's and
verl's tracking wrappers have. Built from the config's ``trackers`` at ``attach``; fed by
``coordinator/client/tracker_feed.py``. A tracker that cannot be set up, or fails later, is
reported once and left out: the others, and the training, go on.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any

from coordinator.core.trackers_config import Trackers

log = logging.getLogger(__name__)
Log = Callable[[dict[str, float], int], None]
STEP_METRIC = "profiler/global_step"
MAX_WAITING = 1000
"""Rows the trainer's own W&B run holds for its next commits (``_OwnRun``)."""
"""W&B: the profiler's figures are plotted against this, not W&B's own step (a window's
figures arrive a few steps after its last step, which W&B's step has passed)."""


class Fanout:
    """Several trackers as one ``log(metrics, step)``; one that raises is dropped, with a
    warning, and the others go on. ``close()`` closes what this process opened."""

    def __init__(self, sinks: dict[str, Log], closers: list[Callable[[], None]]) -> None:
        self.sinks, self.closers = sinks, closers

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        self._each(lambda sink: sink(metrics, step))

    def tick(self) -> None:
        """Each step: the trackers that wait for the trainer's own commits go on."""
        self._each(lambda sink: getattr(sink, "tick", lambda: None)())

    def text(self, tag: str, text: str, step: int) -> None:
        """A window's findings as text, to the trackers that take text (TensorBoard, MLflow,
        the trainer's own ``log`` when it has a ``text(tag, text, step)``); the others get
        its figures only."""
        self._each(lambda sink: getattr(sink, "text", lambda *_: None)(tag, text, step))

    def _each(self, call: Callable[[Log], None]) -> None:
        """``call`` on each tracker; one that raises is dropped, the others go on."""
        for name, sink in list(self.sinks.items()):
            try:
                call(sink)
            except Exception as exc:
                log.warning("profiler: tracker %s failed (%s: %s); no more is logged to it",
                            name, type(exc).__name__, exc)  # fmt: skip
                del self.sinks[name]

    def close(self) -> None:
        for close in self.closers:
            try:
                close()
            except Exception as exc:
                log.warning("profiler: closing a tracker failed: %s", exc)
        self.closers = []


def make_tracker(trackers: Trackers, run_name: str, own: Log | None = None) -> Fanout | None:
    """The trackers the config names, and ``own``, as one ``Fanout``; None when there are
    none. A tracker whose package is missing, or that cannot start, is reported and left out."""
    sinks: dict[str, Log] = {}
    closers: list[Callable[[], None]] = []
    if own is not None:
        if not callable(own):
            raise ValueError(f"tracker must be a log(metrics, step) callable, got {own!r:.80}")
        sinks["tracker"] = own
    for name, opener in (("tensorboard", _tensorboard), ("mlflow", _mlflow), ("wandb", _wandb)):
        spec = getattr(trackers, name)
        if spec is None:
            continue
        try:
            sink, close = opener(spec, run_name)
        except Exception as exc:  # (ImportError: the extra is not installed)
            log.warning("profiler: tracker %s left out: %s: %s", name, type(exc).__name__, exc)
            continue
        sinks[name] = sink
        if close is not None:
            closers.append(close)
    return Fanout(sinks, closers) if sinks else None


def _tensorboard(spec: dict[str, Any], run_name: str) -> tuple[Log, Callable[[], None]]:
    """Scalars in ``log_dir``'s event files (``torch.utils.tensorboard``; needs tensorboard),
    and the findings as text (its Text tab)."""
    from torch.utils.tensorboard import SummaryWriter

    sink = _TensorBoard(SummaryWriter(log_dir=spec["log_dir"]))
    return sink, sink.writer.close


class _TensorBoard:
    """A ``SummaryWriter`` as a sink: ``add_scalar`` each figure, ``add_text`` the findings."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, step)
        self.writer.flush()


def _mlflow(spec: dict[str, Any], run_name: str) -> tuple[Log, Callable[[], None] | None]:
    """Metrics of the active MLflow run, or of a run this process starts (``experiment``,
    ``tracking_uri``: MLflow's own defaults when not given)."""
    import mlflow
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    if spec.get("tracking_uri"):
        mlflow.set_tracking_uri(spec["tracking_uri"])
    active = mlflow.active_run()
    if active is None:
        if spec.get("experiment"):
            mlflow.set_experiment(spec["experiment"])
        active = mlflow.start_run(run_name=run_name)
        close: Callable[[], None] | None = mlflow.end_run
    else:
        close = None  # the trainer's own run: it ends it
    client, run_id = MlflowClient(), active.info.run_id

    class Sink:
        """Metrics by ``log_batch``; the findings as a text artifact per window."""

        def __call__(self, metrics: dict[str, float], step: int) -> None:
            now = int(time.time() * 1000)
            batch = [Metric(k, v, now, step) for k, v in metrics.items()]
            client.log_batch(run_id, metrics=batch)

        def text(self, tag: str, text: str, step: int) -> None:
            client.log_text(run_id, text, f"{tag}/step_{step:09d}.md")

    return Sink(), close


def _wandb(spec: dict[str, Any], run_name: str) -> tuple[Log, Callable[[], None] | None]:
    """The trainer's W&B run when there is one (``_OwnRun``), else a run this process starts
    (``project``, ``mode``: online, offline or disabled). The figures are plotted against
    ``profiler/global_step``."""
    import wandb

    if wandb.run is not None:
        own = _OwnRun(wandb.run)
        return own, own.close
    kw = {k: spec[k] for k in ("project", "mode") if spec.get(k)}
    run = wandb.init(name=run_name, **kw)
    _step_metric(run)

    def sink(metrics: dict[str, float], step: int) -> None:
        run.log({**metrics, STEP_METRIC: step})

    return sink, run.finish


def _step_metric(run: Any) -> None:
    run.define_metric(STEP_METRIC)
    run.define_metric("profiler/*", step_metric=STEP_METRIC)


class _OwnRun:
    """The figures in the trainer's own W&B run: each row rides on the trainer's next commit
    (``commit=False``), one row per commit (two would merge into one), so the run's step moves
    only with the trainer's. At most ``MAX_WAITING`` rows wait (a trainer that commits less
    often than rows come): past it the oldest goes, counted in ``dropped`` and said once. Rows
    still waiting at ``close`` are committed as rows of their own: each of those advances the
    W&B run's step by one."""

    def __init__(self, run: Any) -> None:
        self.run, self.at, self.dropped = run, None, 0
        self.waiting = collections.deque[dict[str, float]](maxlen=MAX_WAITING)
        _step_metric(run)

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        if len(self.waiting) == MAX_WAITING:
            self.dropped += 1
            if self.dropped == 1:
                log.warning(
                    "profiler: %d tracker rows wait for the trainer's next W&B commit; the "
                    "oldest are dropped from now on (the trainer commits less often than the "
                    "profiler's rows come)",
                    MAX_WAITING,
                )
        self.waiting.append({**metrics, STEP_METRIC: step})
        self.tick()

    def tick(self) -> None:
        """One waiting row, when the trainer committed since the last one (each step)."""
        if self.waiting and self.run.step != self.at:
            self.at = self.run.step
            self.run.log(self.waiting.popleft(), commit=False)

    def close(self) -> None:
        while self.waiting:
            self.run.log(self.waiting.popleft())
