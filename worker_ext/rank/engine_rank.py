"""EngineProfilerMixin: a rank for an actor that wraps an inference engine with a profiler of
its own (vLLM's ``LLM``, SGLang's ``Engine``: ``start_profile()`` / ``stop_profile()``).

The coordinator drives it with the same four RPCs as any rank (``coordinator.protocol.rank_rpc``)
and reads the same ``RankReply``. The engine records from the start of the window's first
recorded step to the end of its last (an engine profiler has no warm-up of ours), writes its own
trace, and this adapter moves that trace to ``window_.../<role>/rank<r>.pt.trace.json[.gz]``
and hands it to the node agent, which builds the summary from it (a chrome trace) as for a
torch rank. Any fault of the engine's profiler disables this rank's profiling and is reported;
it never reaches the engine's callers.

Where the engine writes: when its ``start_profile`` takes ``output_dir`` (SGLang), a private
directory per window; otherwise the actor's ``engine_trace_dir`` (vLLM: the directory it was
started with, ``VLLM_TORCH_PROFILER_DIR``), where the files new since the window started are
the window's.
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import tempfile
import threading
import time
from typing import Any

from coordinator.core.config import ProfilerConfig
from coordinator.core.schedule import Window
from coordinator.core.storage import is_remote
from coordinator.core.trace_layout import contained, window_dir
from coordinator.core.validate import role_problem
from coordinator.protocol.replies import ClosedWindow, Phase, RankReply, Reason, rank_reply
from worker_ext.agent.trace_jobs import TraceJob
from worker_ext.rank.agent_link import node_id
from worker_ext.rank.cpu_wait import Reading, per_step, run_delay_ns, waited_ns
from worker_ext.rank.hand_off import HandOff
from worker_ext.rank.mixin import ProfilerWorkerMixin
from worker_ext.rank.stack_dump import enable_stack_dump

log = logging.getLogger(__name__)
TRACE_SUFFIXES = (".json", ".json.gz")


class EngineRank:
    """One engine rank's windows: when to start and stop the engine's profiler, and what to do
    with the trace it wrote. Every command answers ``status()`` and never raises."""

    def __init__(
        self,
        engine: Any,
        rank: int,
        config: ProfilerConfig,
        role: str,
        report_to: dict[str, str] | None,
        run_directory: str | None,
        trace_dir: str | None,
        trace_wait_s: float,
    ) -> None:
        self.engine, self.rank, self.config, self.role = engine, int(rank), config, role
        self.run_directory = run_directory
        self.trace_dir, self.trace_wait_s = trace_dir, trace_wait_s
        self.selected = bool(config.enable and config.selects(self.rank, role))
        self.hand_off = HandOff(self.rank, None, report_to)
        self.fault: Reason | None = None
        self.note: str | None = None
        self.window: Window | None = None
        self.recording_from: int | None = None  # the first step the engine records
        self.waited_from: Reading | None = None  # run_delay_ns then (``cpu_wait``)
        self.out_dir: str | None = None  # where the engine writes this window
        self.seen: set[str] = set()  # trace files in a shared engine_trace_dir before the window
        self.closed: ClosedWindow | None = None
        self.windows_captured = 0
        self.last_trace_path: str | None = None
        self.stack_dump = enable_stack_dump()
        self.node_id = node_id()
        self._lock = threading.Lock()
        if self.selected:
            self._guarded("configure", self._check)
            self.hand_off.start()

    # ----------------------------------------------------------------- commands

    def start_window(self, window: Window, step: int) -> RankReply:
        return self._guarded("start_profile", self._start, window, int(step))

    def step(self, k: int) -> RankReply:
        return self._guarded("profile_step", self._step, int(k))

    def stop_window(self) -> RankReply:
        return self._guarded("stop_profile", self._stop_if_open)

    def wait_for_summaries(self, timeout_s: float) -> RankReply:
        self.hand_off.wait(timeout_s)
        return self.status()

    def status(self) -> RankReply:
        summaries, failures, pending = self.hand_off.drain()
        closed, self.closed = self.closed, None
        return rank_reply(
            rank=self.rank,
            node_id=self.node_id,
            state="not_selected" if not self.selected else "disabled" if self.fault else "ok",
            reason=self.fault,
            device="engine",
            note=self.note,
            phase=self.phase,
            window=self.window.index if self.window is not None else None,
            windows_captured=self.windows_captured,
            last_trace_path=self.last_trace_path,
            closed=closed,
            summaries=summaries,
            summary_failures=failures,
            summaries_pending=pending,
            agent=self.hand_off.info(),
            last_agent_error=self.hand_off.last_error,
            pid=os.getpid(),
            stack_dump=self.stack_dump,
        )

    @property
    def recording(self) -> bool:
        return self.recording_from is not None

    @property
    def phase(self) -> Phase:
        return "idle" if self.window is None else "recording" if self.recording else "warmup"

    # ------------------------------------------------------------------ inside

    def _guarded(self, where: str, fn: Any, *args: Any) -> RankReply:
        with self._lock:  # an async or threaded engine actor may call from several threads
            if self.selected and self.fault is None:
                try:
                    fn(*args)
                except Exception as exc:  # the engine's fault stays here
                    self._disable(where, exc)
            return self.status()

    def _disable(self, where: str, exc: BaseException) -> None:
        self.fault = {"where": where, "type": type(exc).__name__, "message": str(exc)[:2000]}
        log.warning("engine profiling disabled on rank %d (%s: %s)", self.rank, where, exc)
        if self.recording:
            self.recording_from = None
            try:
                _engine_call(self.engine, "stop_profile")  # once, after a fault while recording
            except Exception:
                log.debug("stop_profile after a fault raised", exc_info=True)
        self.window = None

    def _check(self) -> None:
        if self.run_directory is None:
            raise ValueError("no run directory was given")
        if is_remote(self.run_directory):
            raise ValueError("an engine rank writes to a local save_path only, not a URL")
        for name in ("start_profile", "stop_profile"):
            if not callable(getattr(self.engine, name, None)):
                raise TypeError(f"the engine {type(self.engine).__name__} has no {name}()")
        if not _takes_output_dir(self.engine) and not self.trace_dir:
            raise ValueError(
                "the engine's start_profile() takes no output_dir: set engine_trace_dir to "
                "the directory it writes to"
            )

    def _start(self, window: Window, step: int) -> None:
        if self.window is not None and self.window.index == window.index:
            return  # told twice
        self._stop_if_open()
        if step > window.last:
            raise ValueError(f"start_profile at step {step} after window {window.index} ended")
        self.window = window
        if step >= window.first:
            self._begin(step)

    def _step(self, k: int) -> None:
        w = self.window
        if w is None:
            return
        if not self.recording and k + 1 >= w.first:
            self._begin(k + 1)
        elif self.recording and k >= w.last:
            self._finish(k, partial=False)

    def _stop_if_open(self) -> None:
        if self.window is None:
            return
        if self.recording:
            self._finish(None, partial=True)
        else:
            self.window = None  # stopped in its warm-up: nothing was recorded

    def _begin(self, step: int) -> None:
        if _takes_output_dir(self.engine):
            self.out_dir = tempfile.mkdtemp(prefix=f"engine-rank{self.rank}-")
            _engine_call(self.engine, "start_profile", output_dir=self.out_dir)
        else:
            assert self.trace_dir is not None
            self.out_dir = self.trace_dir
            self.seen = set(_trace_files(self.trace_dir))
            _engine_call(self.engine, "start_profile")
        self.recording_from = step
        self.waited_from = run_delay_ns()

    def _finish(self, last: int | None, partial: bool) -> None:
        w, first = self.window, self.recording_from
        assert w is not None and first is not None
        self.window, self.recording_from = None, None
        waited = waited_ns(self.waited_from)
        _engine_call(self.engine, "stop_profile")
        steps = (first, last if last is not None else first)
        waited = per_step(waited, steps)
        path = self._place_trace(w, steps)
        self.closed = ClosedWindow(
            window=w.index, steps=list(steps), partial=partial, trace_path=path
        )
        self.windows_captured += 1
        self.last_trace_path = path
        self.hand_off.submit(self._job(w, steps, partial, path, waited))

    def _place_trace(self, w: Window, steps: tuple[int, int]) -> str:
        """Wait (bounded) for the engine's trace, move it into the window's role directory."""
        assert self.out_dir is not None and self.run_directory is not None
        deadline = time.monotonic() + self.trace_wait_s
        new: list[str] = []
        while True:
            new = [p for p in _trace_files(self.out_dir) if p not in self.seen]
            if new and _settled(new) or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if not new:
            raise RuntimeError(
                f"the engine wrote no trace into {self.out_dir} within {self.trace_wait_s:g} s"
            )
        rdir = contained(window_dir(self.run_directory, w.index, *steps, w.kind), self.role)
        os.makedirs(rdir, exist_ok=True)
        new.sort(key=lambda p: (-os.path.getsize(p), p))  # the largest is the rank's trace
        placed = ""
        for i, src in enumerate(new):
            ext = ".pt.trace.json.gz" if src.endswith(".gz") else ".pt.trace.json"
            name = f"rank{self.rank}{ext}" if i == 0 else f"rank{self.rank}-{i}{ext}"
            dst = contained(rdir, name)
            shutil.move(src, dst)
            placed = placed or dst
        if len(new) > 1:
            self.note = f"the engine wrote {len(new)} traces a window; the largest is summarised"
        if self.out_dir != self.trace_dir:
            shutil.rmtree(self.out_dir, ignore_errors=True)
        return placed

    def _job(
        self, w: Window, steps: tuple[int, int], partial: bool, path: str, waited: int | None
    ) -> TraceJob:
        export = self.config.export_type
        if path.endswith(".gz") or export == "stacks":  # already compressed; no Python stacks
            export = "chrome_trace"
        final = {"chrome_trace": path, "chrome_trace_gz": path + ".gz"}.get(export)
        return TraceJob(
            rank=self.rank,
            window=w.index,
            steps=steps,
            partial=partial,
            device="cuda" if "cuda" in self.config.activities else "cpu",
            top_k=self.config.top_k,
            with_flops=self.config.with_flops,
            collectives_cap=self.config.collectives_cap,
            export_type=export,
            raw_path=path,
            final_path=final,
            report_to=self.hand_off.report_to,
            cpu_wait_ns=waited,
        )


class EngineProfilerMixin(ProfilerWorkerMixin):
    """Inherit it in a Ray actor that holds an engine with ``start_profile()`` and
    ``stop_profile()`` to make that actor a rank of any role::

        @ray.remote
        class Generator(EngineProfilerMixin):
            def __init__(self):
                self.engine = sglang.Engine(model_path=...)   # or vllm.LLM(...)

    ``engine_attr`` names the attribute that holds the engine; ``engine_trace_dir`` is where
    an engine whose ``start_profile()`` takes no ``output_dir`` writes (vLLM's
    ``VLLM_TORCH_PROFILER_DIR``); ``engine_trace_wait_s`` bounds the wait for its trace after
    ``stop_profile()``. The other RPCs are the mixin's.
    """

    engine_attr = "engine"
    engine_trace_dir: str | None = None
    engine_trace_wait_s = 30.0

    def configure_profiler(
        self,
        rank: int,
        config: dict[str, Any] | ProfilerConfig,
        run_dir: str | None,
        warm_up: bool = True,
        report_to: dict[str, str] | None = None,
        role: str = "policy",
    ) -> RankReply:
        """Set this engine rank's global rank, config, run directory and role."""
        old = self._rank_profiler
        if old is not None and old.phase != "idle":
            old.stop_window()
        try:
            cfg = config if isinstance(config, ProfilerConfig) else ProfilerConfig.from_dict(config)
            if problem := role_problem(role):
                raise ValueError(problem)
        except Exception as exc:
            why = {"where": "configure", "type": type(exc).__name__, "message": str(exc)}
            return rank_reply(rank=int(rank), state="disabled", reason=why)
        engine = getattr(self, self.engine_attr, None)
        where = (run_dir, self.engine_trace_dir, float(self.engine_trace_wait_s))
        er = EngineRank(engine, rank, cfg, role, report_to, *where)
        self._rank_profiler = er
        return er.status()


def _engine_call(engine: Any, name: str, **kw: Any) -> None:
    """``engine.<name>(**kw)``, refusing an async engine's coroutine (never awaited here: these
    RPCs are plain calls on the actor's thread)."""
    result = getattr(engine, name)(**kw)
    if inspect.isawaitable(result):
        close = getattr(result, "close", None)
        if close is not None:
            close()  # (no "never awaited" warning)
        raise TypeError(
            f"the engine's {name}() is async: give the adapter an object whose "
            "start_profile()/stop_profile() are plain calls (wrapping the async engine)"
        )


def _takes_output_dir(engine: Any) -> bool:
    try:
        return "output_dir" in inspect.signature(engine.start_profile).parameters
    except (TypeError, ValueError):
        return False


def _trace_files(directory: str) -> list[str]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return [os.path.join(directory, n) for n in names if n.endswith(TRACE_SUFFIXES)]


def _settled(paths: list[str]) -> bool:
    """Every file non-empty and unchanged for a moment (the engine may still be writing)."""
    before = [os.path.getsize(p) for p in paths]
    time.sleep(0.1)
    return all(b > 0 for b in before) and before == [os.path.getsize(p) for p in paths]
