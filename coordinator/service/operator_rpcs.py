"""The coordinator's RPCs for an operator diagnosing a run: collectives across ranks, stacks,
phase times, window diffs and the regression baseline. ``ProfilerCoordinator`` inherits them;
each hands the call to its part of the actor (``stacks``, ``readers``, ``diffs``)."""

from __future__ import annotations

from coordinator.core.collectives import SHOWN
from coordinator.core.step_series import DEFAULT_POINTS
from coordinator.core.tracker_figures import (
    TOP_KERNELS,
    finding_figures,
    settled_after,
    window_figures,
)
from coordinator.core.validate import is_int, trainer_id_problem
from coordinator.protocol.collective_replies import WindowCollectivesReply
from coordinator.protocol.finding_replies import FindingsReply, StatusFindings
from coordinator.protocol.memory_replies import MemoryReply, SnapshotReply
from coordinator.protocol.replies import (
    BaselineReply,
    KernelDiffReply,
    PhaseTimesReply,
    StacksReply,
    StepSeriesReply,
    TrackerFiguresReply,
    WindowFigures,
)
from coordinator.service import advise_reads
from coordinator.service.diffs import Diffs
from coordinator.service.memory_watch import MemoryWatcher
from coordinator.service.readers import Readers
from coordinator.service.stacks import STACK_TIMEOUT_S, StackCalls
from coordinator.service.status_findings import bounded


class OperatorRPCs:
    """Mixed into the coordinator actor, which sets the three parts below."""

    _stacks: StackCalls
    _readers: Readers
    _diffs: Diffs
    _memory: MemoryWatcher

    async def collectives(
        self,
        window: int | None = None,
        trainer_id: str | None = None,
        run: str | None = None,
        role: str | None = None,
        shown: int = SHOWN,
    ) -> WindowCollectivesReply:
        """One window's collectives matched across its ranks: who arrived last at each, how
        long each rank waited, the transfer apart from the waiting, bus bandwidth, and each
        rank's clock offset (issue 56; docs/collectives.md).

        Args:
            window: the window's index; None means the latest closed window.
            trainer_id: whose ranks; None means the stepping trainer's.
            run: an earlier run of this coordinator (``status()["previous_runs"]``).
            role: whose ranks, by role (``rollout``): the one trainer with that role.
            shown: the most collectives listed (the largest skews); every one is counted.

        Example::

            c = ray.get(h.collectives.remote())
            [(r["rank"], r["arrived_last"], r["wait_us"]) for r in c["ranks"]]
        """
        return await self._readers.collectives(window, trainer_id, run, role, shown)

    async def advise(
        self,
        window: int | None = None,
        trainer_id: str | None = None,
        run: str | None = None,
        role: str | None = None,
    ) -> FindingsReply:
        """One window's findings across ranks, in words: each rule's ranks, what it costs a
        step, the figures it used and one sentence of advice, the costliest first (issue 57;
        docs/advise.md). The arguments are ``collectives()``'s.

        Example::

            a = ray.get(h.advise.remote())
            [(f["rule"], f["ranks"], f["cost_ms_per_step"]) for f in a["findings"]]
        """
        return await advise_reads.advise(self._readers, window, trainer_id, run, role)

    async def stacks(
        self,
        native: bool = False,
        ranks: list[int] | None = None,
        trainer_id: str | None = None,
        method: str = "auto",
        threads: bool = False,
        timeout_s: float = STACK_TIMEOUT_S,
    ) -> StacksReply:
        """Every registered rank's stack (every role) and each trainer's driver's, read at the
        same moment on every node by its agent, grouped by identical stack (docs/replies.md).

        ``native``: C/C++ frames too; ``ranks``: only these, with every thread; ``method``:
        ``auto`` (py-spy, else faulthandler), ``py-spy`` or ``faulthandler``; ``timeout_s``:
        per process (0..120). Returns a ``StacksReply``: ``groups`` (smallest first),
        ``culprit`` (one line), ``unreadable`` (with why), ``entries``, ``lines``.
        ``ValueError``: a wrong argument, a ``trainer_id`` not registered, or ``ranks`` that no
        trainer in scope registered (the message lists the registered ones).

        Example::

            st = ray.get(h.stacks.remote())
            print("\\n".join(st["lines"]))
            # rank 2 (1): slow_loader <- load_batch <- train  <- likely culprit
            # ranks 0-1, 3 (3): all_reduce <- _update <- sft_step <- train
        """
        return await self._stacks.stacks(native, ranks, trainer_id, method, threads, timeout_s)

    async def phase_times(
        self, last: int = 100, run: str | None = None, buckets: int = 100
    ) -> PhaseTimesReply:
        """The stepping trainer's per-step phase times (``hooks.region``): the ``last`` steps
        (0..10000) with their regions, each region's mean and share, the slowest steps, and
        ``buckets`` of 100 older steps each; ``run``: an earlier run. A ``PhaseTimesReply``.

        Example::

            pt = ray.get(h.phase_times.remote(last=50))
            [(r["region"], r["mean_ms"], r["share"]) for r in pt["regions"]]
        """
        return await self._readers.phase_times(last, run, buckets)

    async def step_series(
        self, points: int = DEFAULT_POINTS, run: str | None = None
    ) -> StepSeriesReply:
        """The stepping trainer's step time over the whole run, for a chart: at most ``points``
        (1..5000) spans of equal width, each its mean step time, its regions' means and its
        slowest step (from what ``phase_times`` keeps: every step of the last 10,000, and 100-step
        buckets before them); ``run``: an earlier run. A ``StepSeriesReply``.

        Example::

            s = ray.get(h.step_series.remote(points=500))
            [(p["first"], p["last"], p["mean_ms"], p["max_ms"]) for p in s["points"]]
        """
        return await self._readers.step_series(points, run)

    async def tracker_figures(self, after: int = -1) -> TrackerFiguresReply:
        """The figures of the current run's settled windows after window ``after`` (-1: from
        the first), for the trainer's tracker: each window's index, kind, last recorded step
        and ``metrics`` (every role's step time, breakdown shares, top kernels' shares,
        stragglers, marks and each rule's cost a step: ``core/tracker_figures.py``), and
        ``findings`` (each trainer's costliest, as ``status()`` carries them, for the
        tracker's text; made once a window, ``status_findings.py``). In window order; it
        stops before the first closed window whose summaries are still coming. The hooks ask
        for them now and then, never on the step path. A ``TrackerFiguresReply``.

        Example::

            for w in ray.get(h.tracker_figures.remote(after=-1))["windows"]:
                print(w["window"], w["step"], w["metrics"]["profiler/step_ms_median"])
        """
        if not is_int(after) or not -1 <= after < 2**62:
            raise ValueError(f"after must be a window index or -1, got {after!r:.80}")
        run = self._readers.shell.run
        await self._diffs.mark(run)  # the settled windows' marks, made once
        out: list[WindowFigures] = []
        for rec in settled_after(run.state.closed_windows(), after):
            index, steps = rec.window.index, rec.steps or (0, 0)
            metrics: dict[str, float] = {}
            found: list[StatusFindings] = []
            for tid in sorted(rec.aggregates):
                ks = await self._readers.kernel_summary(index, TOP_KERNELS, tid, False, run.name)
                metrics |= window_figures(ks, getattr(rec, "marks", {}).get(tid))
                if self._readers.findings is not None:  # (the rules on the reads thread, once)
                    reply = await self._readers.findings.window(run, rec, tid)
                    metrics |= finding_figures(reply)
                    found.append(bounded(reply))
            out.append(
                {"window": index, "kind": rec.window.kind, "step": steps[1], "metrics": metrics,
                 "findings": found}
            )  # fmt: skip
        return {"run": run.name, "windows": out}

    async def kernel_diff(
        self,
        a: int,
        b: int,
        run_a: str | None = None,
        run_b: str | None = None,
        trainer_id: str | None = None,
        top_k: int = 50,
    ) -> KernelDiffReply:
        """Window ``b`` against window ``a`` (of this run, or of the runs ``run_a``/``run_b``):
        each kernel's per-step self time per rank in both, the change and the ratio, new and
        vanished kernels, the breakdown's shift and the step time; the ``top_k`` largest
        changes first. ValueError for an unknown window or one without summaries.

        Example::

            d = ray.get(h.kernel_diff.remote(0, 7))
            [(k["name"], k["a_us"], k["b_us"], k["ratio"]) for k in d["kernels"][:5]]
        """
        return await self._diffs.kernel_diff(a, b, run_a, run_b, trainer_id, top_k)

    async def memory(self, series: bool = False, trainer_id: str | None = None) -> MemoryReply:
        """Every rank's memory over the run, sampled by its node agent about once a second
        (``memory.sample_s``): resident (``rss_bytes``), unique and GPU memory now, the peaks,
        and ``growth`` (bytes a minute and since when) for a rank marked as leaking; a rank
        that grows while the others of its role stay flat is a ``culprit`` (one line each in
        ``culprits``). ``series``: each rank's ``(t, rss)`` over the run (at most 600 points),
        and ``windows``: when each window ran, for a chart. A ``MemoryReply``.

        Example::

            m = ray.get(h.memory.remote())
            [(r["rank"], r["rss_bytes"], r["growth"]) for r in m["ranks"]], m["culprits"]
        """
        if not isinstance(series, bool):
            raise ValueError(f"series must be a bool, got {series!r:.80}")
        if trainer_id is not None and (problem := trainer_id_problem(trainer_id)):
            raise ValueError(problem)
        return await self._memory.reply(series, trainer_id)

    async def memory_snapshot(
        self, ranks: list[int] | None = None, trainer_id: str | None = None
    ) -> SnapshotReply:
        """Ask the run's CUDA ranks (``ranks`` of ``trainer_id``; None: all) for a CUDA memory
        snapshot now (``memory_snapshot.on`` must hold ``demand``). Each asked rank writes
        ``<run dir>/memory/demand-<n>/<role>/rank<R>.memory.pickle`` and its note then shows in
        ``memory()["snapshots"]``; a rank not asked says why. A ``SnapshotReply``."""
        if ranks is not None and (
            not isinstance(ranks, list)
            or len(ranks) > 100_000
            or any(isinstance(r, bool) or not isinstance(r, int) for r in ranks)
        ):
            raise ValueError(f"ranks must be None or a list of ints, got {ranks!r:.80}")
        if trainer_id is not None and (problem := trainer_id_problem(trainer_id)):
            raise ValueError(problem)
        return await self._memory.snapshot(ranks, trainer_id)

    async def pin_baseline(self, window: int | None) -> BaselineReply:
        """The window every later one is compared with for regression marks (None: back to
        the run's first complete scheduled window); the windows are marked again."""
        return await self._diffs.pin_baseline(window)
