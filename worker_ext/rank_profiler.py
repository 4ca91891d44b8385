"""RankProfiler: drives torch.profiler for one rank, one window at a time, without ever crashing it.

Every guard from torch-profiler-facts.md lives here:
- ``stop()`` is called at most once per torch profiler object;
- nothing escapes ``on_trace_ready``;
- every torch call comes from the thread that first touched the profiler;
- at most one profiler runs in the process, and never on top of someone else's.
Any fault disables profiling on this rank for the rest of the run and is reported in
``status()``; it is never raised to the caller.

Closing a window costs the training process torch's ``stop()`` and the raw chrome trace export,
nothing else: the summary, compression, folded stacks and the push to the coordinator run in the
node's helper process (``worker_ext.node_agent``), which reads the trace from disk.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.profiler import ProfilerAction as TorchAction
from torch.profiler import ProfilerActivity

from coordinator.config import ProfilerConfig
from coordinator.replies import ClosedWindow, Phase, RankStatus, Reason
from coordinator.schedule import Window
from coordinator.storage import is_remote, join
from coordinator.trace_layout import contained, trace_path, window_dir
from worker_ext.hand_off import HandOff
from worker_ext.node_agent import TraceHelper
from worker_ext.trace_jobs import TraceJob

log = logging.getLogger(__name__)

_ACTIVE_LOCK = threading.Lock()
_ACTIVE: RankProfiler | None = None  # the one RankProfiler with a live torch profiler


@dataclass
class _Closing:
    """The window being closed, as the trace handler needs it."""

    window: Window
    steps: tuple[int, int] | None
    partial: bool
    trace_path: str | None = None


class RankProfiler:
    """Profiles one rank on commands that name the global step.

    ``begin_window(window, step)`` before training step ``step`` runs; ``step(k)`` after step k
    finished; ``end_window()`` to close an open window early (partial). Each returns
    ``status()``, which drains the encoded summaries that are ready.
    """

    def __init__(
        self,
        rank: int,
        config: ProfilerConfig,
        run_directory: str | None,
        *,
        warm_up: bool = True,
        refuse_reason: str | None = None,
        report_to: dict[str, str] | None = None,
        helper: TraceHelper | None = None,
    ) -> None:
        self.rank = int(rank)
        self.config = config
        # Where this rank writes: the run directory, or its staging copy on this node when the
        # run directory is a URL (the node agent uploads each finished trace there).
        self.remote_run_dir = run_directory if run_directory and is_remote(run_directory) else None
        self.run_directory = (
            staging_dir(config, self.remote_run_dir) if self.remote_run_dir else run_directory
        )
        self.node_id = _node_id()
        self.selected = bool(config.enable and config.selects(self.rank))
        self.report_to = report_to  # the coordinator the helper pushes summaries to
        self.hand_off = HandOff(self.rank, helper, report_to)
        self.windows_captured = 0
        self.windows_skipped = 0
        self.last_trace_path: str | None = None
        self.last_skip_reason: str | None = None
        self.fault: Reason | None = None
        self._owner_thread: int | None = None
        self._prof: Any = None
        self._window: Window | None = None
        self._recorded_first: int | None = None
        self._last_done: int | None = None
        self._closing: _Closing | None = None
        self._closed: ClosedWindow | None = None
        self._abandoned: list[Any] = []  # torch objects we must never touch again
        self.device, self.note = _pick_device(config)
        if not self.selected:
            return
        if refuse_reason:
            self._disable("configure", RuntimeError(refuse_reason))
            return
        if run_directory is None:
            self._disable("configure", ValueError("no run directory was given"))
            return
        if warm_up:
            self._guarded("warm_up", self._warm_up)
        self.hand_off.start()

    # ----------------------------------------------------------------- commands

    def begin_window(self, window: Window, step: int) -> RankStatus:
        """Open ``window``; training step ``step`` is the next one to run."""
        return self._guarded("begin_window", self._begin, window, int(step))

    def step(self, k: int) -> RankStatus:
        """Global step ``k`` has finished."""
        return self._guarded("step", self._step, int(k))

    def end_window(self) -> RankStatus:
        """Close the open window now as a partial window; a no-op when none is open."""
        return self._guarded("end_window", self._end)

    def wait_for_summaries(self, timeout_s: float) -> RankStatus:
        """Wait up to ``timeout_s`` for pending summaries, then return the status."""
        self.hand_off.wait(timeout_s)
        return self.status()

    @property
    def phase(self) -> Phase:
        if self._window is None or self._prof is None:
            return "idle"
        return "recording" if self._recorded_first is not None else "warmup"

    def status(self) -> RankStatus:
        """A small, msgpack- and JSON-friendly status; drains ready summaries."""
        summaries, failures, pending = self.hand_off.drain()
        closed, self._closed = self._closed, None
        state: Literal["ok", "disabled", "not_selected"] = (
            "not_selected" if not self.selected else "disabled" if self.fault else "ok"
        )
        return {
            "rank": self.rank,
            "node_id": self.node_id,
            "state": state,
            "reason": Reason(**self.fault) if self.fault else None,
            "device": self.device,
            "note": self.note,
            "phase": self.phase,
            "window": self._window.index if self._window is not None else None,
            "windows_captured": self.windows_captured,
            "windows_skipped": self.windows_skipped,
            "last_skip_reason": self.last_skip_reason,
            "last_trace_path": self.last_trace_path,
            "closed": closed,
            "summaries": summaries,
            "summary_failures": failures,
            "summary_pending": pending,
            "summary_helper": self.hand_off.info(),
            "last_helper_error": self.hand_off.last_error,
        }

    # ------------------------------------------------------------------ guards

    def _guarded(self, where: str, fn: Any, *args: Any) -> RankStatus:
        if not self.selected:
            return self.status()
        me = threading.get_ident()
        if self._owner_thread is None:
            self._owner_thread = me
        elif me != self._owner_thread:
            # torch.profiler segfaults when driven from two threads: refuse without touching it.
            self._disable(
                where,
                RuntimeError(
                    "profiler calls arrived on a second thread (a threaded actor?); "
                    "torch.profiler must be driven from one thread"
                ),
            )
            return self.status()
        if self.fault is None:
            try:
                fn(*args)
            except BaseException as exc:  # a profiler fault must never reach training
                self._disable(where, exc)
        if self.fault is not None:
            self._teardown()
        return self.status()

    def _disable(self, where: str, exc: BaseException) -> None:
        if self.fault is None:
            self.fault = {"where": where, "type": type(exc).__name__, "message": str(exc)[:2000]}
            log.warning(
                "profiling disabled on rank %d (%s: %s: %s)",
                self.rank,
                where,
                type(exc).__name__,
                exc,
            )
            log.debug("".join(traceback.format_exception(exc)))

    def _teardown(self) -> None:
        """After a fault: stop a live profiler once, writing nothing; never touch it again."""
        prof, self._prof = self._prof, None
        self._window = None
        self._recorded_first = None
        self._closing = None  # the trace handler then exports nothing
        if prof is None:
            _release(self)
            return
        self._abandoned.append(prof)
        if getattr(prof, "_rank_profiler_stopped", True):
            _release(self)
            return
        prof._rank_profiler_stopped = True
        try:
            prof.stop()
        except BaseException:
            log.debug("stop after a fault raised; the profiler is abandoned", exc_info=True)
        _release(self)

    # ------------------------------------------------------------ torch calls

    def _activities(self) -> list[ProfilerActivity]:
        acts = [ProfilerActivity.CPU]
        if self.device == "cuda":
            acts.append(ProfilerActivity.CUDA)
        return acts

    def _warm_up(self) -> None:
        """Pay Kineto's one-off initialisation now rather than in a window's first step."""
        if _other_profiler_reason(self) or not _claim(self):
            return  # never take over someone else's session just to warm up
        try:
            prof = torch.profiler.profile(activities=self._activities())
            self._abandoned.append(prof)  # in case start raises: never stop it
            prof.start()
            prof._rank_profiler_stopped = True
            prof.stop()
            self._abandoned.remove(prof)
        finally:
            _release(self)

    def _begin(self, window: Window, step: int) -> None:
        if self._prof is not None:  # a window is still open: close it before the next
            self._end()
        if step > window.last:
            raise ValueError(f"begin_window at step {step} after window {window.index} ended")
        busy = _other_profiler_reason(self)
        if busy:
            self.windows_skipped += 1
            self.last_skip_reason = f"window {window.index} skipped: {busy}"
            log.warning("rank %d: %s", self.rank, self.last_skip_reason)
            return
        begin = step

        def window_action(n: int) -> TorchAction:
            # torch asks for step 0 at construction; answer as for the first step we run.
            n = max(n, begin)
            return TorchAction.WARMUP if n < window.first else TorchAction.RECORD

        cfg = self.config
        prof = torch.profiler.profile(
            activities=self._activities(),
            schedule=window_action,
            on_trace_ready=self._on_trace_ready,
            record_shapes=cfg.record_shapes,
            profile_memory=cfg.profile_memory,
            with_stack=cfg.with_stack,
            with_flops=cfg.with_flops,
            with_modules=cfg.with_modules,
            # Folded stacks need per-event Python stacks, which torch keeps only in verbose mode.
            experimental_config=(
                torch.profiler._ExperimentalConfig(verbose=True)
                if cfg.export_type == "stacks"
                else None
            ),
        )
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            # distributedInfo carries the rank otherwise; HTA reads either.
            prof.preset_metadata_json("rank", str(self.rank))
        prof.step_num = step  # ProfilerStep#N markers carry the global step
        prof._rank_profiler_stopped = False
        if not _claim(self):
            raise RuntimeError("another RankProfiler in this process holds the profiler")
        self._abandoned.append(prof)  # if start raises, it is never stopped
        prof.start()
        self._abandoned.remove(prof)
        self._prof, self._window = prof, window
        self._recorded_first = step if step >= window.first else None
        self._last_done = None

    def _step(self, k: int) -> None:
        prof, w = self._prof, self._window
        if prof is None or w is None or k < prof.step_num:
            return  # no window open, or a stale step: nothing to do
        self._last_done = k
        if k >= w.last:
            self._close(partial=False)
            return
        prof.step_num = k  # a skipped step keeps the global numbering
        prof.step()
        if self._recorded_first is None and k + 1 >= w.first:
            self._recorded_first = k + 1

    def _end(self) -> None:
        if self._prof is not None:
            self._close(partial=True)

    def _close(self, partial: bool) -> None:
        prof, w = self._prof, self._window
        assert w is not None  # a profiler is open only with its window
        first, last = self._recorded_first, self._last_done
        steps = (first, last) if first is not None and last is not None and last >= first else None
        self._closing = _Closing(w, steps, partial)
        try:
            prof._rank_profiler_stopped = True
            prof.stop()  # runs _on_trace_ready while recording
        finally:
            self._prof = None
            self._window = None
            self._recorded_first = None
            _release(self)
        closing, self._closing = self._closing, None
        self._closed = ClosedWindow(
            window=w.index,
            steps=list(steps) if steps else None,
            partial=partial,
            trace_path=closing.trace_path if closing else None,
            summary_pending=self.hand_off.is_pending(w.index),
        )
        if steps is not None and self.fault is None:
            self.windows_captured += 1
            if closing and closing.trace_path:
                self.last_trace_path = closing.trace_path

    def _on_trace_ready(self, prof: Any) -> None:
        """Runs inside torch's step()/stop(): write the raw trace, hand it off. Never raises."""
        tmp = None
        try:
            closing = self._closing
            if closing is None or closing.steps is None or self.fault is not None:
                return
            w, (first, last) = closing.window, closing.steps
            export = self.config.export_type
            assert self.run_directory is not None
            if export == "none":  # summarised from a temporary trace, then deleted
                os.makedirs(self.run_directory, exist_ok=True)
                final = None
                raw = contained(self.run_directory, f".rank{self.rank}.window{w.index:04d}.json")
            else:
                wdir = window_dir(self.run_directory, w.index, first, last)
                os.makedirs(wdir, exist_ok=True)
                final = trace_path(wdir, self.rank, export)
                # The helper compresses or folds this plain trace, then deletes it.
                raw = trace_path(wdir, self.rank, "chrome_trace")
            upload = None
            if final is not None and self.remote_run_dir is not None:
                upload = join(self.remote_run_dir, os.path.basename(wdir), os.path.basename(final))
            tmp = raw + ".tmp"
            prof.export_chrome_trace(tmp)
            os.replace(tmp, raw)  # a reader never sees half a trace
            tmp = None
            closing.trace_path = upload or final
            self.hand_off.submit(
                TraceJob(
                    rank=self.rank,
                    window=w.index,
                    steps=(first, last),
                    partial=closing.partial,
                    device=self.device,
                    top_k=self.config.top_k,
                    with_flops=self.config.with_flops,
                    export_type=export,
                    raw_path=raw,
                    final_path=final,
                    report_to=self.report_to,
                    upload_to=upload,
                    storage_options=dict(self.config.storage_options),
                    keep_local=self.config.keep_local,
                )
            )
        except BaseException as exc:  # an exception escaping here segfaults the next stop()
            self._disable("export", exc)
            _remove_quietly(tmp)


STAGING_ENV = "RAY_PROFILER_STAGING"


def staging_dir(config: ProfilerConfig, run_url: str) -> str:
    """This node's local copy of a remote run directory: ``<staging>/<run name>``.

    ``<staging>`` is ``$RAY_PROFILER_STAGING`` on this node, else the config's
    ``staging_path``, else ``<tmp>/ray-profiler-staging``.
    """
    root = (
        os.environ.get(STAGING_ENV)
        or config.staging_path
        or os.path.join(tempfile.gettempdir(), "ray-profiler-staging")
    )
    name = run_url.rstrip("/").rsplit("/", 1)[-1]
    return contained(root, name) if os.path.isdir(root) else os.path.join(root, name)


def _node_id() -> str | None:
    """The Ray node this process runs on, or None outside Ray."""
    ray = sys.modules.get("ray")
    try:
        if ray is not None and ray.is_initialized():
            return str(ray.get_runtime_context().get_node_id())
    except Exception:
        return None
    return None


def _pick_device(config: ProfilerConfig) -> tuple[str, str | None]:
    if "cuda" not in config.activities:
        return "cpu", None
    try:
        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    if has_gpu:
        return "cuda", None
    return "cpu", "cuda requested but this rank has no GPU: recording cpu only"


def _claim(owner: RankProfiler) -> bool:
    global _ACTIVE
    with _ACTIVE_LOCK:
        if _ACTIVE is not None and _ACTIVE is not owner:
            return False
        _ACTIVE = owner
        return True


def _release(owner: RankProfiler) -> None:
    global _ACTIVE
    with _ACTIVE_LOCK:
        if _ACTIVE is owner:
            _ACTIVE = None


def _other_profiler_reason(owner: RankProfiler) -> str | None:
    with _ACTIVE_LOCK:
        if _ACTIVE is not None and _ACTIVE is not owner:
            return f"rank {_ACTIVE.rank}'s profiler is already running in this process"
    try:
        running = torch._C._autograd._profiler_enabled()
    except Exception:
        running = False
    if running:
        return "another torch.profiler session is already running in this process"
    return None


def _remove_quietly(path: str | None) -> None:
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)
