"""ProfilerCoordinator: the named, detached Ray actor that owns the schedule and the global step.

A thin shell around the pure core, put together from four parts that share one
``CoordinatorShell`` (the current run, the lock, the checkpoint): ``RunCalls`` (the trainer's
calls), ``Captures``, ``AgentReports`` (what node agents push) and ``Readers``. Each RPC below
says what it promises and hands the call to its part. It never imports torch and never raises
a rank's fault to a trainer. A refused call is answered, never raised: its boolean is False and
``reason`` says why.
"""

from __future__ import annotations

from typing import Any

import ray

from coordinator.core.validate import is_number
from coordinator.protocol.replies import (
    AutoCaptureReply,
    CancelReply,
    CaptureReply,
    KernelSummaryReply,
    OpenRunReply,
    PingReply,
    RanksPage,
    RecordEntry,
    RegisterReply,
    StatusReply,
    StepReply,
    WaitWindowReply,
)
from coordinator.service.advise_reads import keep_findings
from coordinator.service.agent_reports import AgentReports
from coordinator.service.captures import CAPTURE_REPORT_TIMEOUT_S, Captures
from coordinator.service.diffs import Diffs
from coordinator.service.memory_watch import MemoryWatcher
from coordinator.service.operator_rpcs import OperatorRPCs
from coordinator.service.readers import Readers, WaitUntil
from coordinator.service.run_recorder import RunRecorder
from coordinator.service.runs import RunCalls
from coordinator.service.shell import CoordinatorShell
from coordinator.service.spmd_ranks import SpmdRanks, SpmdRPCs
from coordinator.service.stacks import StackCalls
from coordinator.service.stall_watchdog import StallWatchdog


class _Coordinator(OperatorRPCs, SpmdRPCs):
    """The actor's implementation; use ``get_or_create_coordinator`` to make one."""

    def __init__(self, config: dict[str, Any], name: str, namespace: str) -> None:
        self._shell = CoordinatorShell(config, name, namespace)
        self._captures = Captures(self._shell)
        self._runs = RunCalls(self._shell, self._captures)
        self._reports = AgentReports(self._shell)
        self._readers = keep_findings(Readers(self._shell))  # (status()["findings"])
        self._stacks = StackCalls(self._shell)
        self._diffs = Diffs(self._shell, self._readers)
        self._watchdog = StallWatchdog(self._shell, self._stacks, self._runs.stop)
        self._recorder = RunRecorder(self._shell, self._diffs.mark)
        self._shell.record_soon = self._recorder.soon
        self._shell.record_entry = self._recorder.entry
        self._memory = MemoryWatcher(self._shell)
        self._shell.memory_entry = self._memory.entry
        parts = (self._watchdog, self._recorder, self._memory)
        self._spmd = SpmdRanks(self._shell, self._runs, lambda: [p.start() for p in parts])

    # ------------------------------------------------------------ the trainer's calls

    async def open_run(self, config: dict[str, Any], trainer_id: str | None = None) -> OpenRunReply:
        """Attach to this coordinator: join or resume its run, or begin a fresh one.

        A run that stopped cleanly (or never had a trainer) gives way to a fresh run with
        ``config``; the stepping trainer re-attaching (a restarted driver) resumes its run; a
        run that is still active keeps its config, and another config is a ValueError.
        """
        return await self._runs.open_run(config, trainer_id)

    async def register(
        self,
        trainer_id: str,
        workers: list[Any] | dict[int, Any],
        role: str = "policy",
        advances_step: bool | None = None,
        driver: dict[str, Any] | None = None,
    ) -> RegisterReply:
        """Register a trainer's workers (a list in rank order, or {rank: handle}).

        The first trainer advances the global step unless another registers with
        ``advances_step=True``. Re-registering a ``trainer_id`` replaces its handles and keeps
        the global step and the window history. ``driver`` (``pid``, ``node_id``, ``dump``;
        the hooks send it) lets ``stacks()`` read the trainer's driver too. Raises ValueError
        for a bad registration.
        """
        self._watchdog.start()
        self._recorder.start()
        self._memory.start()
        return await self._runs.register(trainer_id, workers, role, advances_step, driver)

    async def start(
        self, trainer_id: str, first_step: int = 0, throttled: bool = False
    ) -> StepReply:
        """Before the loop: the next step to run is ``first_step`` (the loaded step on resume).

        ``throttled``: the trainer waits only for the reports of the steps it is told to
        (``next_sync_step`` and on), as ``StepClient`` does; otherwise it waits for every one.
        A start after the run stopped begins a fresh run with the same config and trainers.
        """
        return await self._runs.start(trainer_id, first_step, throttled)

    async def step(
        self, trainer_id: str, k: int, waiting: bool = True, phases: Any = None, walls: Any = None
    ) -> StepReply:
        """Global step ``k`` has finished. Returns once the ranks that act are ready for k+1.

        ``waiting``: the trainer waits for this answer before it runs step k+1 (``StepClient``
        sends reports of idle steps without waiting, and says so). ``phases``: the phase
        records (``[step, wall_s, {region: seconds}]``) of the steps since the last report, then
        ``walls``: ``(first_step, [wall_s, ...])``, later steps with no region (rank 0 of SPMD
        ranks); malformed ones are refused (``refused_phases``) and the step still counts.
        """
        self._watchdog.start()  # (a no-op once running; after a restart, its first start)
        self._recorder.start()
        self._memory.start()
        return await self._runs.step(trainer_id, k, waiting, phases, walls)

    async def stop(self, trainer_id: str) -> StepReply:
        """After the loop: stop an open window (partial), end the captures that never opened,
        collect the summaries still pending, and end the run. Safe to call twice, without
        start, and after a failure."""
        return await self._runs.stop(trainer_id)

    async def flush_record(self, timeout_s: float = 30.0) -> RecordEntry:
        """Bring the runs' records in ``save_path`` up to date now and wait, at most
        ``timeout_s`` (0..600), until every queued write is done; returns
        ``status()["record"]``. Call it before a cluster that lives for one job goes away
        (its windows' summaries settle after ``stop``: wait for them first, ``wait_window``)."""
        if not is_number(timeout_s) or not 0 <= timeout_s <= 600:
            raise ValueError(f"timeout_s must be a number in 0..600, got {timeout_s!r:.80}")
        await self._recorder.flush(float(timeout_s))
        return self._recorder.entry()

    # ------------------------------------------------------------ captures

    async def request_capture(
        self,
        active: int = 1,
        warmup: int = 1,
        ranks: list[int] | None = None,
        start_step: int | None = None,
        wait_s: float = CAPTURE_REPORT_TIMEOUT_S,
    ) -> CaptureReply:
        """Profile ``active`` steps of the running trainer, exactly.

        To promise the steps, the coordinator must know where the trainer is: if the trainer
        will wait for its next report's answer, the capture is planned at once; otherwise this
        waits (at most ``wait_s``) for the trainer's next report, which it tells to wait.

        Args:
            active: steps to record (1..``max_capture_steps``).
            warmup: steps the profiler runs before recording, not recorded.
            ranks: global ranks to profile; None means the ranks the config selects. Ranks the
                config does not select are configured for this capture only.
            start_step: the first recorded step; None means as soon as possible.
            wait_s: how long to wait for the trainer's next report (0 < wait_s <= 3600).

        Returns:
            A ``CaptureReply``: ``accepted``, the capture's ``window`` index, the ``steps``
            every selected rank records (``[first, last]``) and its ``ranks``; or
            ``accepted=False`` and the ``reason`` (no trainer running, unknown or disabled
            ranks, an overlap with another window, no report within ``wait_s``).

        Example::

            h = ray.get_actor("profiler", namespace="profiler")
            cap = ray.get(h.request_capture.remote(active=3, warmup=1))
            # {"accepted": True, "window": 4, "steps": [1201, 1203], "ranks": [0, 1], ...}
            ray.get(h.wait_window.remote(cap["window"], run=cap["run"]))
        """
        return await self._captures.request_capture(active, warmup, ranks, start_step, wait_s)

    async def cancel_capture(self, window: int) -> CancelReply:
        """Drop a requested capture that has not started yet."""
        return await self._captures.cancel_capture(window)

    async def set_auto_capture(self, enable: bool) -> AutoCaptureReply:
        """An operator switches auto captures (slow steps profiled by themselves) on or off
        for the current run, whatever its config says (``status()["auto_capture"]["source"]``
        then says ``operator``). Switching off drops an auto capture not planned yet."""
        return await self._captures.set_auto_capture(enable)

    # ------------------------------------------------------------ what node agents report

    async def ingest_summary(
        self, trainer_id: str, rank: int, blob: bytes, run: str | None = None
    ) -> bool:
        """A rank's summary, pushed by its node agent as soon as it is built.

        True when the coordinator has it, or never will want it (the agent then drops it).
        """
        return await self._reports.ingest_summary(trainer_id, rank, blob, run)

    async def ingest_partial(self, trainer_id: str, blob: bytes, run: str | None = None) -> bool:
        """A node partial: the summaries of one node's ranks for one window, pushed by its
        agent. True when the coordinator has it or never will want it; False when refused
        (each rank then sends its own summary)."""
        return await self._reports.ingest_partial(trainer_id, blob, run)

    async def summary_failed(
        self, trainer_id: str, rank: int, window: int, reason: Any, run: str | None = None
    ) -> bool:
        """A rank's node agent could not build its summary of ``window`` (or died): say why."""
        return await self._reports.summary_failed(trainer_id, rank, window, reason, run)

    async def trace_stored(
        self,
        trainer_id: str,
        rank: int,
        window: int,
        path: object,
        error: Any = None,
        run: str | None = None,
        local_path: object = None,
        node: object = None,
    ) -> bool:
        """The node agent finished a rank's trace of ``window``: its final ``path``, or why not."""
        return await self._reports.trace_stored(
            trainer_id, rank, window, path, error, run, local_path, node
        )

    async def traces_stored(
        self, trainer_id: str, reports: list[dict[str, Any]], run: str | None = None
    ) -> list[bool]:
        """Several ranks' ``trace_stored`` at once, as a node agent batches its node's: each
        report a dict with ``rank``, ``window``, ``path`` and optionally ``error``,
        ``local_path`` and ``node``, judged by itself; one bool per report."""
        return await self._reports.traces_stored(trainer_id, reports, run)

    # ------------------------------------------------------------ readers

    async def status(self, ranks: str = "summary") -> StatusReply:
        """Everything about the current run, and the runs kept before it; JSON-serialisable.

        Args:
            ranks: ``"summary"`` (the default): in a run of over 256 ranks, the ranks are
                counted by state (``rank_counts``) and only those not ``ok`` are listed
                (bounded), and each window's per-rank lists are cut (``complete: False``);
                ``"all"``: every rank and every window in full (``ranks()`` pages them).

        Returns:
            A ``StatusReply``: the run and its ``lifecycle``, the window ``phase``, the global
            step, the current and next window, every closed window (``windows``: steps kept
            or why not, summaries and traces pending, where the traces are, stragglers), the
            trainers, the ranks' ``state`` (with the ``reason`` of a disabled rank), the nodes
            and their paths, the counters, the checkpoint and ``previous_runs``.

        Example::

            ray.init(address="auto", namespace="profiler")
            st = ray.get(ray.get_actor("profiler").status.remote())
            st["run"]["lifecycle"], st["global_step"], [w["index"] for w in st["windows"]]
        """
        await self._diffs.mark(self._shell.run)  # regression marks of windows newly settled
        return await self._readers.status(ranks)

    async def ranks(
        self,
        offset: int = 0,
        limit: int = 1000,
        state: str | None = None,
        trainer_id: str | None = None,
    ) -> RanksPage:
        """One page of the per-rank list (``status()`` entries), in (trainer, rank) order.

        Args:
            offset: ranks to skip; limit: at most this many (1..10000).
            state: only ranks in this state (``ok``, ``disabled``, ``lost``, ``unresponsive``,
                ``not_selected``); trainer_id: only this trainer's ranks.
        """
        return await self._readers.ranks(offset, limit, state, trainer_id)

    async def kernel_summary(
        self,
        window: int | None = None,
        top_k: int = 20,
        trainer_id: str | None = None,
        per_rank: bool = False,
        run: str | None = None,
        role: str | None = None,
        by: str = "kernel",
    ) -> KernelSummaryReply:
        """The cross-rank kernel table of one window, of one trainer (one role).

        Args:
            window: the window's index; None means the latest closed window.
            top_k: kernels to list, by total self time over ranks (0..100000).
            trainer_id: whose ranks; None means the stepping trainer's.
            per_rank: add each listed kernel's self time on every rank (recent windows only;
                ``detail_windows`` in the config).
            run: an earlier run of this coordinator (``status()["previous_runs"]``).
            role: whose ranks, by role (``rollout``): the one trainer with that role.
            by: ``kernel`` (device kernels on CUDA ranks, CPU ops on CPU ranks) or ``op``
                (CUDA: each CPU op's device time, CPU time, calls and largest kernels, in
                ``ops``; on CPU ranks the same table as ``kernel``).

        Returns:
            A ``KernelSummaryReply``: ``kernels`` (total, mean, min, max, std, the slowest
            rank, count, share), ``rank_totals``, ``stragglers``, ``breakdown`` (compute,
            comm, memcpy, other per rank), ``streams``, ``memory``, and the ranks whose
            summary is still pending (``summaries_pending``) or unusable (``bad_ranks``).

        Raises:
            ValueError: an argument of the wrong type or range, an unknown ``run``, or a
                ``window`` the history no longer keeps (the message lists what it keeps).

        Example::

            ks = ray.get(h.kernel_summary.remote(top_k=10))
            [(k["name"], k["total_us"], k["max_rank"]) for k in ks["kernels"]]
        """
        return await self._readers.kernel_summary(
            window, top_k, trainer_id, per_rank, run, role, by
        )

    async def wait_window(
        self,
        window: int,
        run: str | None = None,
        until: WaitUntil = "summaries",
        timeout_s: float = 60.0,
    ) -> WaitWindowReply:
        """Wait until ``window`` has closed with every summary in (``until="summaries"``) or
        every trace finished too (``until="traces"``), at most ``timeout_s``; no polling.

        Returns ``done`` with the window's entry; or, when the wait ran out, the entry as it
        stands (None if it has not closed); or ``window=None`` and a ``reason`` when the run
        ended without it or does not keep it.
        """
        return await self._readers.wait_window(window, run, until, timeout_s)

    async def ping(self) -> PingReply:
        """Cheap liveness check: the current run's name and how often this actor restarted."""
        return await self._readers.ping()

    async def get_config(self) -> dict[str, Any]:
        """The current run's config, credentials redacted."""
        return await self._readers.get_config()


# Ray restarts it after a crash (same name, same handle); it picks its state up from the
# checkpoint. Calls in flight when it died fail; later ones wait for the restart.
# Every node agent pushes its partial when a window closes: at 10,000 ranks, 1,250 calls at once.
# Ray's default of 1,000 concurrent calls would queue a step report behind them in Ray, where
# nothing can let it pass; with room for all, they queue in the fold queue, which lets it pass.
MAX_CONCURRENT_CALLS = 20_000
ProfilerCoordinator = ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=MAX_CONCURRENT_CALLS)(
    _Coordinator
)
