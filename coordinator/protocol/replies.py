"""Every reply that crosses Ray, declared once. Pure: no Ray, no torch.

The stack and stall replies live in ``coordinator.protocol.stack_replies`` and are re-exported
here. The coordinator's RPCs answer with these (``status()`` and ``kernel_summary()`` included), and
so do the rank RPCs of ``ProfilerWorkerMixin`` (``RankReply``). Every key is always present;
a value that does not apply is ``None``. A refused call says so one way: its boolean (``applied``,
``accepted``, ``cancelled``) is False and ``reason`` says why, in words a person can act on.

Names: a whole RPC answer ends in ``Reply``; a row inside one ends in ``Entry``; tables and
statistics are named for what they hold.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

from coordinator.protocol.collective_replies import LastArriver as LastArriver
from coordinator.protocol.finding_replies import StatusFindings as StatusFindings
from coordinator.protocol.memory_replies import MemoryStatusEntry as MemoryStatusEntry
from coordinator.protocol.stack_replies import StackDump as StackDump
from coordinator.protocol.stack_replies import StackEntry as StackEntry
from coordinator.protocol.stack_replies import StackGroup as StackGroup
from coordinator.protocol.stack_replies import StacksReply as StacksReply
from coordinator.protocol.stack_replies import StallEntry as StallEntry

Phase = Literal["idle", "warmup", "recording"]
"""Where the open window is: ``idle`` (no window open), ``warmup``, ``recording``."""

RankState = Literal["ok", "disabled", "lost", "unresponsive", "not_selected", "not_configured"]
"""A rank's state, as the rank reports it and as the coordinator keeps it:

- ``ok``: profiles when its windows come;
- ``disabled``: a profiling fault (``reason``) switched profiling off on this rank;
- ``lost``: its actor died (coordinator view only);
- ``unresponsive``: it did not answer within ``worker_timeout_s`` (coordinator view only);
- ``not_selected``: the config does not profile it;
- ``not_configured``: the rank has no profiler config (rank view only; the coordinator keeps
  such a rank as ``disabled``).
"""

RunLifecycle = Literal["configured", "running", "stopped", "abandoned"]
"""Where a run is: ``configured`` (no step yet), ``running``, ``stopped`` by its trainer, or
``abandoned`` (its trainer went away without ``stop``, and a fresh run replaced it)."""


class Reason(TypedDict):
    """Why a rank or a piece of its work failed."""

    where: str
    type: str
    message: str


class AgentError(TypedDict, total=False):
    """The last step of the agent's work on a trace that failed (``where`` says which: summary,
    publish, relay, compress, stacks, cleanup, upload, agent). ``relay``: the node's relay did
    not take its partial, which the node then pushed to the coordinator itself."""

    window: int | None
    where: str
    type: str
    message: str
    trace_path: str | None


class AgentEntry(TypedDict):
    """The agent that finishes this rank's traces: ``node_agent`` (in Ray) or ``local_process``
    (a spawned child, outside Ray), and its pid."""

    kind: str | None
    pid: int | None
    name: str | None  # the node agent's actor name (namespace ``profiler_agents``)


class OptimizerSteps(TypedDict, total=False):
    """A window's optimizer steps, where they are not its steps: a rank that counts global
    steps a driver reports (SkyRL's ``profile_step``) runs several optimizer steps per step."""

    optimizer_steps: list[int] | None  # [first, last] of the window, its first rank's


class ClosedWindow(OptimizerSteps):
    """On the reply that stopped a window (whether the rank's summary of it is still being
    built: ``RankReply.summaries_pending``)."""

    window: int
    steps: list[int] | None
    partial: bool
    trace_path: str | None


class RankReply(TypedDict):
    """What every worker RPC (``configure_profiler``, ``start_profile``, ``profile_step``,
    ``stop_profile``, ``dump_profiler_summary``) answers."""

    rank: int | None
    node_id: str | None
    state: RankState
    reason: Reason | None
    device: str | None
    note: str | None
    phase: Phase
    window: int | None
    windows_captured: int
    windows_skipped: int
    last_skip_reason: str | None
    last_trace_path: str | None
    closed: ClosedWindow | None
    summaries: list[bytes]
    summary_failures: list[AgentError]
    summaries_pending: list[int]  # the windows whose summary the rank's agent still builds
    agent: AgentEntry
    last_agent_error: AgentError | None
    pid: int | None
    stack_dump: StackDump | None  # how the node agent reads this rank's stack without py-spy


def rank_reply(**values: Any) -> RankReply:
    """A ``RankReply`` with every key: a rank that has done nothing yet, with ``values`` put
    in; KeyError for a key a ``RankReply`` does not have.

    >>> rank_reply(state="not_configured")["phase"]
    'idle'
    """
    reply: dict[str, Any] = {
        "rank": None,
        "node_id": None,
        "state": "ok",
        "reason": None,
        "device": None,
        "note": None,
        "phase": "idle",
        "window": None,
        "windows_captured": 0,
        "windows_skipped": 0,
        "last_skip_reason": None,
        "last_trace_path": None,
        "closed": None,
        "summaries": [],
        "summary_failures": [],
        "summaries_pending": [],
        "agent": {"kind": None, "pid": None, "name": None},
        "last_agent_error": None,
        "pid": None,
        "stack_dump": None,
    }
    unknown = set(values) - set(reply)
    if unknown:
        raise KeyError(f"not RankReply keys: {sorted(unknown)}")
    reply.update(values)
    return reply  # type: ignore[return-value]


class StepReply(TypedDict):
    """``start``, ``step`` and ``stop``. ``next_sync_step``: the first step whose report makes
    ranks act (the trainer waits for that report); ``None`` when nothing is planned."""

    applied: bool
    reason: str | None
    ignored: Literal["duplicate", "out_of_order"] | None
    run: str
    global_step: int | None
    phase: Phase
    window: int | None
    next_sync_step: int | None


class MissedRank(TypedDict):
    """A rank of a capture that will not record it: an SPMD rank that did not acknowledge the
    plan in time (``reason`` begins ``late:``) or is gone (``lost:``)."""

    trainer_id: str
    rank: int
    reason: str


class CaptureReply(TypedDict):
    """``request_capture``: the exact steps every selected rank records, or why not.
    ``missed``: the ranks (of SPMD trainers) that will not record them, with why; the window
    is partial for each."""

    accepted: bool
    reason: str | None
    run: str
    window: int | None
    steps: list[int] | None
    warmup_start: int | None
    ranks: list[int] | None
    missed: list[MissedRank]


class CancelReply(TypedDict):
    """``cancel_capture``: whether the capture was dropped, or why not."""

    cancelled: bool
    reason: str | None
    window: int


class RegisterReply(TypedDict):
    """``register``: the trainer's place in the run."""

    trainer_id: str
    advances_step: bool
    world_size: int
    selected_ranks: list[int]
    run: str
    run_dir: str | None


class RankAttachReply(TypedDict):
    """``attach_rank``: what an SPMD rank needs to follow the run's plan by itself."""

    run: str
    run_dir: str | None
    config: dict[str, Any]  # the run's config (``ProfilerConfig.to_dict``)
    report_to: dict[str, str]  # where the node agent sends this rank's summaries
    selected: bool  # the config profiles this rank
    world_size: int
    generation: int  # how many times this rank attached to the run: its process's generation


class RankStartReply(TypedDict):
    """``rank_start``: where an SPMD rank's plan begins, the same for every rank of a start."""

    run: str
    first_step: int
    index_base: int  # the index of the first window the rank's plan opens


class OpenRunReply(TypedDict):
    """``open_run``: the run a trainer attached to, and how its config compares."""

    run: str
    run_dir: str | None
    decision: Literal["join", "resume", "fresh"]
    config: dict[str, Any]
    mismatch: list[str]


class RunEntry(TypedDict):
    """One run of a coordinator, in ``status()["run"]`` and ``status()["previous_runs"]``."""

    name: str
    lifecycle: RunLifecycle
    run_dir: str | None
    created_at: float
    started_at: float | None
    ended_at: float | None
    ended_reason: str | None
    global_step: int | None
    stepping_trainer: str | None


class WindowTrace(TypedDict):
    """Where one rank's trace of a window is, as its node agent reported it."""

    path: str | None  # the trace's final place: its URL once uploaded, else a path on ``node``
    local_path: str | None  # the copy that stays on ``node`` (kept, or the upload failed)
    node: str | None  # the Ray node id of the node that wrote it
    error: dict[str, str] | None


WindowKind = Literal["scheduled", "capture", "auto"]
"""Where a window comes from: the config's schedule, an operator's capture, or an auto capture
of slow steps."""


class AutoTrigger(TypedDict):
    """Why an auto capture was taken: the run's steps had slowed down."""

    step: int  # the step whose report found the run slow
    ratio: float  # the recent step time over the baseline
    baseline_ms: float  # the run's rolling median step time
    recent_ms: float  # the step time measured at the trigger
    slow_steps: list[int]  # [first, last] of the slow steps, to a report's resolution (~0.1 s)
    region: str | None  # the part of the step that grew, when known


class RoleWindow(OptimizerSteps):
    """One trainer's (one role's) part of a window, in ``WindowEntry["roles"]``: its ranks and
    traces are its own, and its ops never mix into another role's table."""

    trainer_id: str
    role: str
    ranks: list[int]
    rank_count: int
    trace_dir: str | None  # ``window_.../<role>``: HTA opens it as it is
    traces: dict[int, WindowTrace]  # cut to the failed ones as ``WindowEntry["traces"]``
    traces_pending: list[int]
    summaries_pending: list[int]
    stragglers: list[int]
    launch_bound: list[int]  # CUDA ranks with a launch-bound step
    busy_ms_per_step: float | None  # self time of every op per recorded step: mean over ranks
    busy_ms_per_step_max: float | None  # ... and its largest rank
    last_arriver: str | None  # ``stragglers["last_arriver"]["reason"]``, with its rank
    step_ms: dict[int, float]  # each recorded step's time, the mean over its ranks
    regression: RegressionEntry | None  # this role's marks (None until judged)


class WindowEntry(TypedDict):
    """One window of a run, in ``status()["windows"]``. The per-rank fields describe the
    stepping trainer's ranks (the ``policy`` of an RL run); ``roles`` holds every trainer's,
    keyed by ``trainer_id``."""

    index: int
    kind: WindowKind
    planned: list[int]
    steps: list[int] | None
    kept: bool
    reason: str | None
    partial: bool
    ranks: list[int]
    rank_count: int  # the ranks that captured the window (``ranks`` may be cut: see complete)
    complete: bool  # False: each per-rank list holds its first 64 ranks, traces the failed ones
    trace_dir: str | None
    trace_dirs: dict[str, str]
    summaries_pending: list[int]  # the ranks whose summary has not arrived yet
    traces_pending: list[int]  # the ranks whose trace the node agent has not finished yet
    trace_errors: dict[int, dict[str, str]]
    traces: dict[int, WindowTrace]
    stragglers: list[int]
    last_arriver: str | None  # the rank the others waited for in collectives, and why
    launch_bound: list[int]  # CUDA ranks with a launch-bound step
    trigger: AutoTrigger | None  # for an ``auto`` window: why it was taken
    regression: RegressionEntry | None  # the stepping trainer's marks, once its summaries are in
    roles: dict[str, RoleWindow]  # trainer_id -> that trainer's part of the window


class TrainerEntry(TypedDict):
    """One registered trainer (a group of ranks of one role), in ``status()["trainers"]``."""

    trainer_id: str
    role: str
    world_size: int
    ranks: list[int]
    advances_step: bool
    run_dir: str | None
    spmd: bool  # its ranks step themselves (``RankSession``); ``ranks``: those attached


class AttachedEntry(TypedDict):
    """A rank attached by the setup hook (``worker_ext.attach``), with no code of ours in its
    job: where it runs and how it knew its rank."""

    job_id: str | None
    actor_class: str | None
    pid: int | None
    node_id: str | None
    source: str  # "torch.distributed", "ray.train" or "actor"
    optimizer: str  # the class of the optimizer whose steps are its steps


class AttachProblemEntry(TypedDict):
    """``status()["attach_problems"]``: a process of an attached job that is not profiled, or
    an attached rank's warning (its ``trainer_id`` and ``rank`` then set), newest last."""

    at: float  # epoch seconds
    problem: str
    pid: int | None
    node_id: str | None
    job_id: str | None
    actor_class: str | None
    trainer_id: str | None
    rank: int | None


class RankEntry(TypedDict):
    """One registered rank, in ``status()["ranks"]``."""

    trainer_id: str
    rank: int
    state: RankState
    reason: Any
    device: str | None
    note: str | None
    windows_captured: int
    last_trace_path: str | None
    agent: AgentEntry | None
    last_agent_error: AgentError | None
    node_id: str | None
    attached: AttachedEntry | None  # set for a rank attached by the setup hook


class WindowSteps(TypedDict):
    """A planned window: warm-up from ``warmup_start``, recording ``first``..``last``."""

    index: int
    warmup_start: int
    first: int
    last: int
    kind: str


class AutoCaptureEntry(TypedDict):
    """``status()["auto_capture"]``: whether slow steps are profiled by themselves now, and
    what the detector sees."""

    enabled: bool
    source: Literal["config", "operator"]  # who set ``enabled`` last
    captures: int  # auto captures planned in this run
    max_per_run: int
    baseline_ms: float | None  # the run's rolling median step time (None: not enough steps)
    recent_ms: float | None  # the last step time measured
    slow_steps: int  # consecutive slow steps now
    last_trigger: int | None  # the step of the last auto capture's trigger


class AutoCaptureReply(TypedDict):
    """``set_auto_capture``: whether the switch was applied, and the state after it."""

    applied: bool
    reason: str | None
    auto_capture: AutoCaptureEntry


class LoopEntry(TypedDict):
    """The coordinator's event loop: its longest stall (ms, and when, epoch seconds), the most
    CPU its thread spent in one stall, and the last stalls of 20 ms or more, as ``[epoch
    seconds, ms, ms of the loop thread's CPU]``."""

    max_stall_ms: float
    max_stall_at: float | None
    max_busy_ms: float
    recent_stalls: list[list[float]]
    gc_max_ms: dict[str, float]  # the longest pause of each generation's garbage collection


class ProcessEntry(TypedDict):
    """The coordinator's process: its pid, proof that it never loaded torch, its event loop."""

    pid: int
    torch_loaded: bool
    worker_handle_stubs: bool
    loop: LoopEntry


class CheckpointEntry(TypedDict):
    """The last checkpoint written: its size, how long it took, when, or why it failed; what
    the last restart could not read back of it."""

    bytes: int
    seconds: float
    at: float | None
    error: str | None
    restore_problems: list[str]  # one line each (empty: none, or never restarted)


class RecordEntry(TypedDict):
    """The current run's record in ``save_path`` (``docs/api.md#the-runs-record``):
    where it is, what it holds, and how its writes go (``error`` until a retry succeeds)."""

    dir: str | None  # None: no save_path, or ``record: false``
    windows: int  # windows recorded
    steps: int  # steps whose phase times are recorded
    files: int  # files written (every run's, since the coordinator started)
    bytes: int
    pending: int  # files queued, waiting for a write or its retry
    failures: int  # writes that failed (each retried)
    dropped: int  # files not queued: too many were waiting
    error: str | None  # the last write's failure, until one succeeds
    retry_in_s: float | None
    last_write_at: float | None


class PreviousRunEntry(TypedDict):
    """A run that ended, kept for reading: its windows and the config it ran with."""

    run: RunEntry
    config: dict[str, Any]
    windows: list[WindowEntry]


class StatusReply(TypedDict):
    """``status()``: JSON-serialisable."""

    name: str
    namespace: str
    run: RunEntry
    phase: Phase
    config: dict[str, Any]
    run_dir: str | None
    global_step: int | None
    current_window: WindowSteps | None
    next_window: WindowSteps | None
    windows: list[WindowEntry]
    trainers: list[TrainerEntry]
    ranks: list[RankEntry]  # every rank, or (ranks_complete False) the ranks not ok, bounded
    ranks_complete: bool  # False in a run of over 256 ranks, unless status(ranks="all")
    rank_counts: dict[str, int]  # ranks by state, every rank counted
    nodes: NodesEntry
    counters: dict[str, int]
    metrics: dict[str, Any]
    process: ProcessEntry
    previous_runs: list[PreviousRunEntry]
    restarts: int  # how often Ray restarted this coordinator (each time from its checkpoint)
    last_restart: float | None  # when it last did (epoch seconds)
    checkpoint: CheckpointEntry
    record: RecordEntry
    auto_capture: AutoCaptureEntry
    stalls: list[StallEntry]  # the watchdog's recent stalls, oldest first (bounded)
    attach_problems: list[AttachProblemEntry]  # attached processes not profiled (bounded)
    schedule_problems: list[str]  # what of the schedule the engine cannot serve (kineto_fit)
    memory: MemoryStatusEntry | None  # the leaks named (``memory()`` has every rank)
    findings: list[StatusFindings]  # the latest closed window's costliest, per trainer


NodePath = Literal["agent", "direct"]
"""How window commands reach a node's ranks: through its agent, or one call per rank."""


class NodeEntry(TypedDict):
    """One node in ``status()["nodes"]``: its agent, its path and why it is ``direct``."""

    node: str
    agent: str
    path: NodePath
    ranks: int  # ranks of the node in the last command through it
    commands: int  # commands its agent answered
    reason: Reason | None


class NodesEntry(TypedDict):
    """``status()["nodes"]``: how many nodes each path serves, and the nodes (every node, or
    when not complete only the ``direct`` ones, bounded)."""

    by_path: dict[str, int]
    listed: list[NodeEntry]
    complete: bool


class RanksPage(TypedDict):
    """``ranks(offset, limit, state, trainer_id)``: one page of the per-rank list."""

    total: int  # the ranks that match
    offset: int
    limit: int
    ranks: list[RankEntry]


class PingReply(TypedDict):
    """``ping``: the current run's name, how often this coordinator restarted, and whether the
    run is live (configured or running: node agents it used stay up)."""

    run: str
    restarts: int
    live: bool


class WaitWindowReply(TypedDict):
    """``wait_window``: a window once it is done (``done``), or as it stands when the wait ran
    out; ``window`` is None (with ``reason``) when the run ended without it or is not kept."""

    run: str | None
    done: bool
    window: WindowEntry | None
    lifecycle: RunLifecycle | None
    reason: str | None


class KernelStats(TypedDict):
    """One op or kernel across ranks (``kernel_summary()["kernels"]``)."""

    name: str
    total_us: float
    mean_us: float
    min_us: float
    max_us: float
    std_us: float
    max_rank: int
    count: int
    ranks_present: int
    share: float


class MemoryStats(TypedDict):
    """One allocating op across ranks (``kernel_summary()["memory"]["ops"]``)."""

    name: str
    total_bytes: float
    mean_bytes: float
    min_bytes: float
    max_bytes: float
    std_bytes: float
    max_rank: int
    count: int
    ranks_present: int
    share: float


class RankStraggler(TypedDict):
    """One rank against the median: its step time (on CUDA ranks each step's device span),
    compute time and communication time; ``launch_bound`` lists its launch-bound steps."""

    step_ms: float | None
    step_ratio: float | None
    compute_ms: float
    compute_ratio: float | None
    comm_ms: float | None
    comm_share: float | None
    flagged: bool
    launch_bound: list[int]


class Stragglers(TypedDict):
    threshold: float | None
    median_step_ms: float
    median_compute_ms: float
    ranks: dict[int, RankStraggler]
    flagged: list[int]
    launch_bound: list[int]  # the ranks with a launch-bound step
    last_arriver: LastArriver | None  # the rank the others waited for in collectives (issue 56)


class OpDetail(TypedDict):
    """What ``kernel_summary(by="op")`` adds to an op's row: its self CPU time over the ranks
    and its three largest kernels by device time (``[name, us]``, from each rank's five)."""

    cpu_us: float
    kernels: list[list[Any]]


class LaunchEntry(TypedDict):
    """A CUDA rank's launches in a window (HTA's launch statistics): the launch delay (the
    device start minus the launch call's end) as median and p95, the share of kernels that ran
    shorter than their launch call, and its launch-bound steps."""

    kernels: int
    delay_p50_us: float
    delay_p95_us: float
    short_share: float
    launch_bound: list[int]


class GpuEntry(TypedDict):
    """A CUDA rank's figures of the findings' GPU rules (issue 57; ``summary_codec.GpuRow``),
    each a mean a recorded step: the host's wait in device synchronizations, how many, and the
    ops that caused the most (``[name, wait_us, syncs]``); copies from pageable memory (device
    time, how many); fp32 GEMM kernels without TF32 and with it (a record from before
    ``fp32_conv_us``: its convolutions' too); the kernels of fp16/bf16 matmuls with a dim not
    a multiple of 8 (device time; how many such ops in the window, and a few of their shapes:
    ``aten::mm [2047, 64] [64, 512]``); fp32 convolution (cuDNN) kernels without TF32 and
    with it; the matmul ops recorded with their shapes (the ones ``matmul_alignment`` judges)."""

    sync_wait_us: float
    syncs: int
    sync_causes: list[list[Any]]
    pageable_us: float
    pageable_copies: int
    fp32_gemm_us: float
    tf32_gemm_us: float
    misaligned_mm_us: float
    misaligned_mm_ops: int
    misaligned_mm_shapes: list[str]
    fp32_conv_us: float
    tf32_conv_us: float
    mm_ops_shaped: int


class BreakdownTable(TypedDict):
    ranks: dict[int, dict[str, float]]
    mean: dict[str, float]


class MemoryTable(TypedDict):
    peak_bytes: dict[int, int]
    max_peak_bytes: int
    max_peak_rank: int
    peak_step: dict[int, int | None]  # the recorded step each rank's peak fell in
    allocated_bytes: dict[int, int | None]  # allocated in the window (frees not subtracted)
    freed_bytes: dict[int, int | None]
    ops: list[MemoryStats]


class KernelSummaryReply(OptimizerSteps):
    """``kernel_summary()``: one window's cross-rank tables."""

    run: str
    window: int | None
    steps: list[int]
    partial: bool
    closed: bool
    ranks: list[int]
    summaries_pending: list[int]
    bad_ranks: dict[int, str]
    device: str | None
    unit: str
    kernels: list[KernelStats]
    rank_totals: dict[int, float]
    dropped: dict[str, float]
    stragglers: Stragglers
    breakdown: BreakdownTable
    streams: dict[int, list[dict[str, float]]]
    memory: MemoryTable | None
    per_rank: dict[str, dict[int, float]] | None
    trainer_id: str | None
    role: str | None  # the trainer's role: a table never mixes two roles' ops
    by: str  # "kernel": device kernels (CUDA) or CPU ops; "op": CPU ops by device time
    ops: dict[str, OpDetail] | None  # with by="op": each listed op's CPU time and kernels
    launch: dict[int, LaunchEntry]  # CUDA ranks' launches
    unattributed_us: dict[int, float]  # CUDA: device time launched outside the window's steps
    device_steps: dict[int, list[list[float]]]  # CUDA: [step, busy_us, span_us] per step
    gpu: NotRequired[dict[int, GpuEntry]]  # CUDA: syncs, pageable copies, fp32 GEMMs
    rank_steps: dict[int, list[list[float]]] | None  # with per_rank: [step, ms] per rank


class PhaseStep(TypedDict):
    """One step's phase times: its wall time (the trainer's own work between two step reports)
    and each named region's, in ms; ``other_ms`` is the wall time minus the regions' sum, at
    least 0: the time in no region when no region nests in or overlaps another (a nested
    region's time is also in its parent's)."""

    step: int
    wall_ms: float
    regions: dict[str, float]
    other_ms: float


class PhaseRegion(TypedDict):
    """One region over the steps of a ``PhaseTimesReply``."""

    region: str
    steps: int  # steps that entered it
    total_ms: float
    mean_ms: float  # over every step listed
    max_ms: float
    share: float  # of the steps' wall time


class PhaseBucket(TypedDict):
    """Steps older than the exact ones, per ``BUCKET_STEPS`` steps: means and the slowest."""

    first: int
    last: int
    steps: int
    mean_wall_ms: float
    mean_ms: dict[str, float]
    slowest_step: int
    slowest_ms: float


class PhaseTimesReply(TypedDict):
    """``phase_times()``: the stepping trainer's phase times of recent steps, and coarser ones
    before them."""

    run: str
    trainer_id: str | None
    steps: list[PhaseStep]
    regions: list[PhaseRegion]
    slowest: list[PhaseStep]
    buckets: list[PhaseBucket]
    steps_seen: int
    exact_steps: int
    ignored: int


class StepPoint(TypedDict):
    """A span of steps in a ``StepSeriesReply``: their mean step time and each region's mean
    (ms, over the steps the span holds), and its slowest step."""

    first: int
    last: int
    steps: int  # the steps reported in it (a gap in the reports leaves fewer than its width)
    mean_ms: float
    max_ms: float
    max_step: int
    regions: dict[str, float]


class StepSeriesReply(TypedDict):
    """``step_series()``: the stepping trainer's step time over the run, in at most ``points``
    spans of ``width`` steps each (``coordinator/core/step_series.py``)."""

    run: str
    trainer_id: str | None
    steps_seen: int
    width: int
    regions: list[str]
    points: list[StepPoint]


class WindowFigures(TypedDict):
    """One settled window's figures for the trainer's tracker (``coordinator/core/
    tracker_figures.py``): every role's, logged at the window's last recorded step."""

    window: int
    kind: str
    step: int
    metrics: dict[str, float]
    findings: list[StatusFindings]  # each trainer's costliest (the tracker's text)


class TrackerFiguresReply(TypedDict):
    """``tracker_figures(after)``: the settled windows after window ``after``, in order; it
    stops before the first window whose summaries are still coming, so none is skipped."""

    run: str
    windows: list[WindowFigures]


class KernelChange(TypedDict):
    """One kernel in a ``KernelDiffReply``: its per-step self time (per rank, us) in each
    window, the change and the ratio (None for a new or vanished kernel)."""

    name: str
    status: Literal["changed", "new", "vanished"]
    a_us: float
    b_us: float
    change_us: float
    ratio: float | None


class BreakdownShift(TypedDict):
    """One category of the breakdown (compute, comm, memcpy, other) per step, in each window."""

    category: str
    a_us: float
    b_us: float
    a_share: float
    b_share: float


class KernelDiffReply(TypedDict):
    """``kernel_diff(a, b)``: window ``b`` against window ``a``, ordered by absolute change."""

    a: dict[str, Any]  # run, window, steps, ranks
    b: dict[str, Any]
    kernels: list[KernelChange]
    new: list[str]
    vanished: list[str]
    total_us: list[float]  # every kernel's per-step time, summed: [a, b]
    breakdown: list[BreakdownShift]
    step_ms: list[float | None]  # the median rank's step time: [a, b]
    step_ratio: float | None
    device: str | None


class RegressionKernel(TypedDict):
    """A kernel marked slower (``coordinator/core/marks.py`` says how it is judged)."""

    name: str
    us: float  # its per-step self time per rank in this window
    reference_us: float  # ... the median of the reference windows'
    expected_us: float  # ... what the reference predicts for this window (see ``scaled``)
    ratio: float  # us / expected_us
    bar: float  # the ratio the reference's spread asked for (median + 4 spreads)
    step_share: float  # (us - expected_us) / the step time
    scaled: bool  # compared scaled by its window (True), or as it is (its time was steadier)


class RegressionEntry(TypedDict):
    """A window's regression marks for one trainer, against the run's own earlier windows
    (``status()``: the window's ``regression`` and each role's)."""

    baseline: int | None  # where the reference starts: the pinned or first complete window
    baseline_run: str
    trainer_id: str
    reference: list[int]  # the windows judged against (most recent last)
    judged: bool  # False: fewer than 8 reference windows yet, nothing is marked
    threshold: float  # the least ratio marked (``regression_threshold``)
    kernels: list[RegressionKernel]  # marked: beyond the bar here and in a window beside it
    suspects: list[RegressionKernel]  # beyond the bar here (the largest rise first, <= 10)
    step_ms: list[float | None]  # [the reference's median, this window]
    step_ratio: float | None
    step_bar: float | None  # the ratio the reference's spread asked for
    step_regressed: bool  # marked: beyond the bar here and in a window beside it
    step_suspect: bool  # beyond the bar here


class BaselineReply(TypedDict):
    """``pin_baseline(window)``: the run's baseline for regression marks now."""

    run: str
    baseline: int | None
    pinned: bool  # False: the run's first complete scheduled window (None before one)
