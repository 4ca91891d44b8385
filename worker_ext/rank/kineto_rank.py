"""``engine: kineto``: a rank whose windows libkineto records on its own threads, on the config
the node agent hands it as its daemon (``worker_ext.agent.kineto_traces``).

The training thread's part of a window is small: at its start, a ``TraceJob`` carrying the
config goes to the agent; on each recorded step a ``ProfilerStep#N`` range (the reader's step
markers, on the global step); at its end, the rest of libkineto's iterations counted at once
(``_kineto_step``), so that libkineto stops where the window ends. No ``stop()``, no export, no
free: libkineto collects and writes the trace on its own threads, and the agent reads it.

libkineto counts iterations by the optimizer step hook torch registers with
``KINETO_USE_DAEMON`` (``KinetoStepTracker``): its count is the tracker's less one, plus the
iterations this rank counted itself. A config for iteration ``S`` starts recording at the
optimizer step that brings the count to ``S``; so the window's config asks for the count at the
end of the step before its first, from where the count stands when the window is started and
how many optimizer steps a global step has taken lately. libkineto takes an iteration config
only after the process's first optimizer step: before it, the config waits.

libkineto takes a config only while it neither records nor writes, and asks once a second: so
at a scheduled window's end the rank posts the next scheduled window's config itself
(``_post_ahead``), which libkineto takes at its first poll after this trace is written. A
window whose config libkineto never got by its end is taken back and lost, with why and the gap
the schedule needs (``lost_why``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from typing import Any

import torch
from torch.autograd import profiler as autograd_profiler

from coordinator.core.config import ProfilerConfig
from coordinator.core.schedule import Schedule, Window
from coordinator.protocol.atomic_file import write_atomic
from coordinator.protocol.replies import ClosedWindow
from worker_ext.agent.kineto_ipc import (
    DIR_ENV,
    POLL_S,
    PROBLEM_ENV,
    client_bound,
    config_taken,
    config_text,
    post_config,
    take_back,
    withdraw_config,
)
from worker_ext.agent.kineto_traces import KinetoRequest, cancel_path, ended_path, written_path
from worker_ext.agent.trace_jobs import TraceJob, cpu_wait_path
from worker_ext.rank.cpu_wait import per_step, run_delay_ns, waited_ns
from worker_ext.rank.rank_profiler import RankProfiler, may_start
from worker_ext.rank.torch_session import TraceTarget, role_name, trace_job

log = logging.getLogger(__name__)
CPU_ACTIVITIES = "cpu_op,user_annotation,cpu_instant_event,python_function"
CUDA_ACTIVITIES = (
    ",gpu_user_annotation,gpu_memcpy,gpu_memset,kernel,external_correlation,cuda_runtime,"
    "cuda_driver,overhead"
)


def window_options(
    config: ProfilerConfig, device: str, log_file: str, start: int, iterations: int
) -> dict[str, object]:
    """libkineto's config for a window: where, from which iteration and for how many, what to
    record (CUDA activities on a GPU rank: CUPTI does the rest inside libkineto)."""
    return {
        "ACTIVITIES_LOG_FILE": log_file,
        "PROFILE_START_ITERATION": start,
        "ACTIVITIES_ITERATIONS": iterations,
        "ACTIVITIES_WARMUP_ITERATIONS": 0,
        "ACTIVITY_TYPES": CPU_ACTIVITIES + (CUDA_ACTIVITIES if device == "cuda" else ""),
        "PROFILE_REPORT_INPUT_SHAPES": config.record_shapes,
        "PROFILE_PROFILE_MEMORY": config.profile_memory,
        "PROFILE_WITH_STACK": config.with_stack,
        "PROFILE_WITH_FLOPS": config.with_flops,
        "PROFILE_WITH_MODULES": config.with_modules,
    }


def profiler_class(config: ProfilerConfig) -> type[RankProfiler]:
    """The rank profiler for the config's engine."""
    return KinetoRankProfiler if config.engine == "kineto" else RankProfiler


def environment_problem() -> str | None:
    """Why libkineto's on-demand tracing is off in this process, or None."""
    refused = os.environ.get(PROBLEM_ENV)
    if refused:  # (the setup hook found the directory unsafe and turned it off)
        return f"engine 'kineto': {refused}"
    if os.environ.get("KINETO_USE_DAEMON") != "1" or not os.environ.get("KINETO_IPC_SOCKET_DIR"):
        return (
            "engine 'kineto' needs KINETO_USE_DAEMON=1 and KINETO_IPC_SOCKET_DIR in the rank's "
            "environment before torch is imported: start it with "
            "runtime_env={'env_vars': worker_ext.kineto_env()}"
        )
    directory = os.environ["KINETO_IPC_SOCKET_DIR"]
    if client_bound(directory) is False:  # (else every window would wait for nothing)
        return (
            f"engine 'kineto': libkineto has no socket in {directory}: the directory did not "
            "exist on this node when torch was imported in this process, and libkineto binds "
            "only then; start the rank with runtime_env={'env_vars': worker_ext.kineto_env()} "
            "(its setup hook makes the directory on each node), or make it on this node first"
        )
    return None


_SESSIONS = [0]  # torch.profiler sessions started in this process (``watch_sessions``)


def watch_sessions() -> None:
    """Count every torch.profiler session this process starts from now on: torch calls its
    module's ``_run_on_profiler_start`` at each start (``torch.profiler.profile``, the autograd
    profiler, ITT). One starting during a kineto window, or before libkineto wrote it, drops
    libkineto's trace; the count says so even when it starts and stops between two steps."""
    original = getattr(autograd_profiler, "_run_on_profiler_start", None)
    if original is None or getattr(original, "_ray_profiler_counts", False):
        return

    def counted() -> None:
        _SESSIONS[0] += 1
        original()

    counted._ray_profiler_counts = True  # type: ignore[attr-defined]
    autograd_profiler._run_on_profiler_start = counted


def kineto_directory() -> str:
    """The daemon directory this process's libkineto talks to."""
    return os.environ.get(DIR_ENV) or os.environ["KINETO_IPC_SOCKET_DIR"]


def libkineto_count(injected: int) -> int:
    """libkineto's iteration count: the optimizer-step tracker's less one, plus ``injected``."""
    return int(autograd_profiler.KinetoStepTracker.current_step()) - 1 + injected


def log_file_path(where: str, role: str, rank: int, tag: str) -> str:
    """libkineto's file for a window of this process, which the agent's markers (``.cancel``,
    ``.ended``) are named after: by role, rank and process too, as the ranks 0 of two roles
    (policy, critic) share a directory (export ``none``; a window posted ahead)."""
    return os.path.join(where, f".kineto.{role_name(role)}.rank{rank}.{os.getpid()}.{tag}.json")


@dataclasses.dataclass
class _Run:
    """The open window's libkineto side."""

    job: TraceJob
    log_file: str
    start: int | None = None  # the iteration its config names, once handed to the agent
    iterations: int = 0
    marker: Any = None  # the open ProfilerStep#N range
    submitted: bool = False
    posted: bool = False  # its config was posted ahead, by the rank (``_Ahead``)
    started_at: float = 0.0  # wall clock at the window's start
    behind: bool = False  # libkineto still wrote the trace before it, at its start


@dataclasses.dataclass(frozen=True)
class _Ahead:
    """The next scheduled window's config, posted as soon as the window before it ended:
    libkineto takes it once that window's trace is written, and waits for its start."""

    first: int
    last: int
    log_file: str
    start: int
    iterations: int


@dataclasses.dataclass(frozen=True)
class _Ended:
    """The last window whose trace libkineto took on: when it ended, and its file."""

    index: int
    at: float  # wall clock
    log_file: str


def lost_why(w: Window, run: _Run, prev: _Ended | None, step_s: float | None) -> str:
    """Why libkineto never got window ``w``'s config (``prev``: the window it last wrote, if
    any; ``step_s``: a step's time lately), and the gap the schedule needs."""
    step = f"{step_s:.2f} s" if step_s is not None else "a step"
    now = time.time()
    if run.behind and prev is not None:
        need = now - prev.at + POLL_S
        return (
            f"lost: window {w.index}'s config never reached libkineto before the window "
            f"ended: libkineto was still writing window {prev.index}'s trace when it "
            f"started, takes one config at a time and asks for one every {POLL_S} s; "
            f"engine 'kineto' needs at least about {need:.1f} s between a window's last step "
            f"and the next one's first (wait + warmup steps of {step} each)"
        )
    return (
        f"lost: window {w.index}'s config never reached libkineto before the window ended "
        f"({now - run.started_at:.1f} s after its start): libkineto asks for one every "
        f"{POLL_S:g} s; engine 'kineto' needs a window's warm-up (steps of {step} each) to "
        f"last at least {POLL_S:g} s"
    )


def trace_metadata(rank: int, role: str) -> str:
    """The trace's ``distributedInfo`` and ``rank``, as torch writes them."""
    info: dict[str, Any] = {"backend": "none", "rank": rank, "role": role}
    with contextlib.suppress(Exception):
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            info = {
                "backend": str(torch.distributed.get_backend()),
                "rank": int(torch.distributed.get_rank()),
                "world_size": int(torch.distributed.get_world_size()),
                "role": role,
            }
    return f'"distributedInfo": {json.dumps(info)}, "rank": {int(rank)}'


def kineto_request(run: _Run, config: str, metadata: str) -> KinetoRequest:
    """The agent's part of ``run``'s job: libkineto's config, and where it writes."""
    return KinetoRequest(
        pid=os.getpid(),
        config=config,
        log_file=run.log_file,
        directory=kineto_directory(),
        metadata=metadata,
        posted=run.posted,
    )


def never_counted_why(index: int) -> str:
    """Why window ``index`` ended before its job went to the agent."""
    stepped = int(autograd_profiler.KinetoStepTracker.current_step()) > 0
    return f"window {index} ended before libkineto counted an iteration: " + (
        "its steps were too few to measure" if stepped else "this process steps no optimizer"
    )


def hand_cpu_wait(log_file: str, cpu_wait: int | None) -> None:
    """The window's steps' wait for a CPU (ns; None: not measured) written beside libkineto's
    trace, for the agent's summary (``trace_jobs.cpu_wait_path``); a failed write loses only it."""
    if cpu_wait is not None:
        with contextlib.suppress(OSError):
            write_atomic(cpu_wait_path(log_file), str(cpu_wait).encode("ascii"))


class KinetoRankProfiler(RankProfiler):
    """A ``RankProfiler`` whose windows libkineto records (see the module docstring)."""

    injected = 0  # iterations this rank counted itself (libkineto's count runs ahead by them)
    per_step = 1  # optimizer steps per global step, as last seen
    _seen: tuple[int, int] | None = None  # (global step done, the tracker's count then)
    _measured = False  # per_step seen on two steps, not assumed
    _writing: dict[int, str] | None = None  # ended windows whose trace libkineto still writes
    _ahead: _Ahead | None = None
    _ended: _Ended | None = None
    _step_s: float | None = None  # wall time of a global step, lately
    _stepped_at: tuple[int, float] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        watch_sessions()
        self._sessions = _SESSIONS[0]
        super().__init__(*args, **kwargs)
        if self.selected and self.fault is None and environment_problem() is None:
            self.hand_off.serve_kineto(kineto_directory())

    def _warm_up(self) -> None:
        """Nothing to warm up (libkineto starts itself); refuse a process without the daemon."""
        problem = environment_problem()
        if problem:
            raise RuntimeError(problem)

    def _start(self, window: Window, step: int) -> None:
        if not may_start(self, window, step):
            return
        self._warm_up()
        assert self.run_directory is not None
        target = TraceTarget(
            self.rank, self.device, self.run_directory, self.remote_run_dir, self.role
        )
        job = trace_job(self.config, target, window, (window.first, window.last), False, None)
        job = dataclasses.replace(job, report_to=self.report_to)
        where = os.path.dirname(job.raw_path)
        log_file = log_file_path(where, self.role, self.rank, str(job.window))
        prev = self._ended
        behind = prev is not None and os.path.exists(ended_path(prev.log_file))
        run = _Run(job, log_file, started_at=time.time(), behind=behind)
        run = self._adopt_ahead(run, window, step)
        self._prof, self._window, self._last_done = run, window, None
        self._recorded_first = step if step >= window.first else None
        self._waited_from = run_delay_ns() if step >= window.first else None
        self._observe(step - 1)
        self._submit_when_counting(run, window, step)
        if step >= window.first:
            self._open_marker(run, step)

    def _submit_when_counting(self, run: _Run, window: Window, step: int) -> None:
        """Hand the window's config to the agent once libkineto counts iterations."""
        now = libkineto_count(self.injected)
        if run.submitted or now < 0 or not self._measured:
            # Before the first optimizer step libkineto would take it as a duration; before
            # two steps were seen, how far the count goes in a step is not known.
            return
        if not run.posted:
            run.start, run.iterations = self._iterations(window, step)
        self._hand_over(run)

    def _hand_over(self, run: _Run) -> None:
        """The window's job to the agent, which posts its config (unless posted ahead or
        cancelled already) and waits for libkineto's trace, or reports why it is lost."""
        config = self._config(run.log_file, run.start or 0, run.iterations)
        request = kineto_request(run, config, trace_metadata(self.rank, self.role))
        run.submitted = True
        self.hand_off.submit(dataclasses.replace(run.job, kineto=request))

    def _iterations(self, window: Window, step: int) -> tuple[int, int]:
        """libkineto's start iteration for ``window`` when ``step`` is the next to run, and how
        many it records (the window's end counts the rest at once)."""
        start = libkineto_count(self.injected) + max(0, window.first - step) * self.per_step
        return start, 2 * (window.last - window.first + 3) * self.per_step

    def _config(self, log_file: str, start: int, iterations: int) -> str:
        return config_text(window_options(self.config, self.device, log_file, start, iterations))

    def _post_ahead(self, w: Window, done: int) -> None:
        """Global step ``done`` ended the config's scheduled window ``w``: post the next one's
        config now, so that libkineto takes it as soon as this window's trace is written (it
        takes none while it records or writes), with its start iteration still ahead."""
        sched = Schedule(self.config)
        this = sched.first_window_from(w.first)
        if w.kind != "scheduled" or this is None or (this.first, this.last) != (w.first, w.last):
            return  # (a capture, or a plan shifted from the config's: no next window known)
        nxt = sched.first_window_from(done + 1)
        if nxt is None or nxt.first <= done + 1 or not self._measured or self.fault is not None:
            return
        where = self.run_directory or os.path.dirname(kineto_directory())
        log_file = log_file_path(where, self.role, self.rank, f"ahead.{nxt.first}-{nxt.last}")
        start, iterations = self._iterations(nxt, done + 1)
        try:
            post_config(kineto_directory(), os.getpid(), self._config(log_file, start, iterations))
        except OSError as exc:
            log.warning("rank %d: a kineto config not posted ahead: %s", self.rank, exc)
            return
        self._ahead = _Ahead(nxt.first, nxt.last, log_file, start, iterations)

    def _adopt_ahead(self, run: _Run, window: Window, step: int) -> _Run:
        """``run`` with the config posted ahead for its steps, if any (posted anew, with its start
        counted from here, unless libkineto took it already); any other taken back."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return run
        directory, pid = kineto_directory(), os.getpid()
        queued = take_back(directory, pid, ahead.log_file)
        if (ahead.first, ahead.last) != (window.first, window.last):
            return run  # (a capture came first: that config, if libkineto took it, is lost)
        run = dataclasses.replace(run, log_file=ahead.log_file, posted=True)
        run.start, run.iterations = ahead.start, ahead.iterations
        if queued:
            run.start, run.iterations = self._iterations(window, step)
            post_config(directory, pid, self._config(run.log_file, run.start, run.iterations))
        return run

    def _step(self, k: int) -> None:
        self._observe(k)
        self._time_step(k)
        other = _SESSIONS[0] != self._sessions or torch._C._autograd._profiler_enabled()
        self._sessions = _SESSIONS[0]
        self._watch_writing(other)
        run, w = self._prof, self._window
        if not isinstance(run, _Run) or w is None or k < (self._last_done or -1):
            return
        self._last_done = k
        self._close_marker(run)
        if other:
            why = (
                f"a torch.profiler of the process's own started during the kineto window "
                f"{w.index}: libkineto runs one session and dropped the window's"
            )
            self._cancel(run, why)
            self._end(partial=True)
            return
        self._submit_when_counting(run, w, k + 1)
        if k >= w.last:
            self._end(partial=False)
            self._post_ahead(w, k)  # (a window stopped early ends a run: nothing ahead)
            return
        if k + 1 >= w.first:
            if self._recorded_first is None:
                self._recorded_first, self._waited_from = k + 1, run_delay_ns()
            self._open_marker(run, k + 1)

    def _observe(self, k: int) -> None:
        """Global step ``k`` is done: how many optimizer steps a global step takes."""
        count = int(autograd_profiler.KinetoStepTracker.current_step())
        if self._seen is not None and k <= self._seen[0]:
            return  # a stale or repeated step says nothing
        if self._seen is not None and count > self._seen[1]:
            self.per_step = max(1, round((count - self._seen[1]) / (k - self._seen[0])))
            self._measured = True
        self._seen = (k, count)

    def _time_step(self, k: int) -> None:
        """How long a global step takes, from two steps in a row (the lost window's reason)."""
        now = time.monotonic()
        if self._stepped_at is not None and k == self._stepped_at[0] + 1:
            self._step_s = now - self._stepped_at[1]
        self._stepped_at = (k, now)

    def _watch_writing(self, other_profiler: bool) -> None:
        """A torch.profiler started before libkineto wrote an ended window's trace drops it:
        say so to the agent, which stops waiting for it."""
        writing = self._writing or {}
        for index, log_file in list(writing.items()):
            # (the agent removes the end marker right after it copied libkineto's file)
            done = not os.path.exists(ended_path(log_file)) or os.path.exists(
                written_path(log_file, os.getpid())
            )
            if done or not self.hand_off.is_pending(index):
                del writing[index]
            elif other_profiler:
                del writing[index]
                why = (
                    f"a torch.profiler started in this process before libkineto wrote window "
                    f"{index}'s trace: libkineto runs one session and dropped it"
                )
                self._cancel_file(log_file, why)

    def finish(self, timeout_s: float) -> None:
        """Up to ``timeout_s`` until libkineto wrote every ended window's trace: it writes them
        from this process, on a thread that wakes once a second, so a process that ends
        sooner (a Ray Train worker, a few steps after its last window) loses them."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:  # (the loop ended before it: never sent later; one libkineto
            withdraw_config(kineto_directory(), os.getpid(), ahead.log_file)  # took waits)
        deadline = time.monotonic() + timeout_s
        self._watch_writing(False)
        if self._writing and timeout_s > 0:
            log.info("rank %d: waiting up to %.0f s for libkineto to write windows %s",
                     self.rank, timeout_s, sorted(self._writing))  # fmt: skip
        while True:
            self._watch_writing(False)
            if not self._writing or time.monotonic() > deadline:
                break
            time.sleep(0.05)  # (libkineto writes a file, it signals nothing)
        if self._writing:
            log.warning("rank %d: libkineto had not written windows %s after %.0f s",
                        self.rank, sorted(self._writing), timeout_s)  # fmt: skip

    def _stop_if_open(self) -> None:
        if isinstance(self._prof, _Run):
            self._end(partial=True)

    def _end(self, partial: bool) -> None:
        """Close the window: libkineto's remaining iterations counted now, so it stops here."""
        run, w = self._prof, self._window
        assert isinstance(run, _Run) and w is not None
        self._close_marker(run)
        self._prof, self._window = None, None
        first, last = self._recorded_first, self._last_done
        self._recorded_first = None
        steps = (first, last) if first is not None and last is not None and last >= first else None
        if not run.submitted:
            self._never_handed(run, w, steps is not None)
        elif not self._taken(run):
            self._cancel(run, lost_why(w, run, self._ended, self._step_s))
        else:
            self._let_libkineto_write(w, run, per_step(waited_ns(self._waited_from), steps))
        self._closed = ClosedWindow(
            window=w.index,
            steps=list(steps) if steps else None,
            partial=partial,
            trace_path=run.job.upload_to or run.job.final_path,
        )
        if steps is not None and self.fault is None:
            self.windows_captured += 1
            self.last_trace_path = run.job.upload_to or run.job.final_path

    def _never_handed(self, run: _Run, w: Window, recorded: bool) -> None:
        """The window ended before its job went to the agent: its trace is lost, and when it
        recorded steps (the coordinator then waits for the trace) the agent is handed the job,
        cancelled, so that it reports the loss and why, and the window settles."""
        why = never_counted_why(w.index)
        if run.posted:
            take_back(kineto_directory(), os.getpid(), run.log_file)
        self._cancel(run, why)
        if recorded and self.fault is None:
            self._cancel_file(run.log_file, why)  # (first: the agent then posts no config)
            self._hand_over(run)

    def _taken(self, run: _Run) -> bool:
        """Whether libkineto was sent the window's config: else it is taken back here, for good
        (the daemon claims a config before it sends it, so one of the two wins)."""
        directory, pid = kineto_directory(), os.getpid()
        if take_back(directory, pid, run.log_file):
            return False
        return config_taken(directory, pid, run.log_file)

    def _let_libkineto_write(self, w: Window, run: _Run, cpu_wait: int | None) -> None:
        """libkineto's remaining iterations counted now, so it stops here and writes (the steps'
        CPU wait handed first); the end marked for the agent (it then knows a dropped config)."""
        hand_cpu_wait(run.log_file, cpu_wait)
        now = libkineto_count(self.injected)
        # A config that came late starts where it came (or at the next step, if none came
        # since): counting its whole length again ends it in either case, the training done.
        rest = max((run.start or 0) + run.iterations - now, run.iterations + 1)
        for _ in range(rest):
            autograd_profiler._kineto_step()
        self.injected += rest
        self._writing = {**(self._writing or {}), w.index: run.log_file}
        self._ended = _Ended(w.index, time.time(), run.log_file)
        with contextlib.suppress(OSError):
            write_atomic(ended_path(run.log_file), b"")

    def _cancel(self, run: _Run, why: str) -> None:
        """Tell the agent this window's trace will not come, and why."""
        self.last_skip_reason = why
        log.warning("rank %d: %s", self.rank, why)
        if run.submitted:  # (else the agent never heard of it)
            self._cancel_file(run.log_file, why)

    def _cancel_file(self, log_file: str, why: str) -> None:
        self.last_skip_reason = why
        with contextlib.suppress(OSError):
            write_atomic(cancel_path(log_file), why.encode("utf-8"))

    def _open_marker(self, run: _Run, step: int) -> None:
        run.marker = autograd_profiler.record_function(f"ProfilerStep#{step}")
        run.marker.__enter__()

    def _close_marker(self, run: _Run) -> None:
        marker, run.marker = run.marker, None
        if marker is not None:
            marker.__exit__(None, None, None)

    def _teardown(self) -> None:
        """After a fault: the open window's trace will not come."""
        run = self._prof
        if isinstance(run, _Run):
            self._close_marker(run)
            self._cancel(run, f"profiling was disabled on rank {self.rank}: {self.fault}")
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            with contextlib.suppress(Exception):
                take_back(kineto_directory(), os.getpid(), ahead.log_file)
        self._prof = None
        super()._teardown()
