"""``python -m coordinator`` / ``ray-profiler``: read and steer a running coordinator.

    ray-profiler status
    ray-profiler ranks --state lost
    ray-profiler top --window 3 --k 20
    ray-profiler capture --active 3 --warmup 1 --ranks 0 1 --wait
    ray-profiler cancel 4
    ray-profiler auto on
    ray-profiler stragglers
    ray-profiler collectives --window 3
    ray-profiler stacks
    ray-profiler memory
    ray-profiler phases --last 200
    ray-profiler diff 0 7
    ray-profiler watch --interval 2

Tables for people; ``--json`` for scripts. The global options (``--address``, ``--namespace``,
``--name``, ``--json``) go before or after the command. Exit status: 0 ok, 1 error (one line on
stderr), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from coordinator.ops.tables import (
    render_auto,
    render_diff,
    render_phases,
    render_ranks,
    render_stacks,
    render_stalls,
    render_status,
    render_stragglers,
    render_top,
    render_windows,
)
from coordinator.service.record_store import SAVE_PATH_ENV

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
_EXAMPLES = {
    "status": (
        "ray-profiler status --address auto\n  ray-profiler status --json | jq .windows\n"
        "  ray-profiler status --all   # every rank of a run of over 256 ranks"
    ),
    "ranks": "ray-profiler ranks --state unresponsive\n  ray-profiler ranks --offset 1000",
    "windows": (
        "ray-profiler windows\n  ray-profiler windows --from s3://bucket/profiles/job-0412 --json"
    ),
    "top": (
        "ray-profiler top --window 3 --k 20\n  ray-profiler top --role rollout\n"
        "  ray-profiler top --by op   # CUDA: device time by the op that launched it\n"
        "  ray-profiler top --run run_20261201-120000"
    ),
    "capture": (
        "ray-profiler capture --active 3 --warmup 1 --wait\n"
        "  ray-profiler capture --active 2 --start-step 5000 --ranks 0 1"
    ),
    "cancel": "ray-profiler cancel 8",
    "auto": "ray-profiler auto on\n  ray-profiler auto off\n  ray-profiler auto --json",
    "stragglers": "ray-profiler stragglers --window 3",
    "collectives": (
        "ray-profiler collectives   # the latest window: who arrived last, who waited, clocks\n"
        "  ray-profiler collectives --window 3 --role policy --json | jq .ranks\n"
        "  ray-profiler collectives --from s3://bucket/profiles/job-0412 --window 3"
    ),
    "advise": (
        "ray-profiler advise   # the latest window's findings, the costliest first\n"
        "  ray-profiler advise --window 3 --json | jq '.findings[] | {rule, ranks}'\n"
        "  ray-profiler advise --from s3://bucket/profiles/job-0412 --window 3"
    ),
    "summarise": (
        "ray-profiler summarise ./window_0003_steps_100-102/policy   # every rank's trace\n"
        "  ray-profiler summarise rank0.json.gz rank1.json.gz --steps 551-552 --by op --json\n"
        "  ray-profiler summarise s3://bucket/profiles/job-0412 --window 3   # a finished run's\n"
        "  ray-profiler summarise ./traces --collectives --json   # collectives across ranks\n"
        "  ray-profiler summarise ./traces --advise   # the findings across ranks"
    ),
    "diff": (
        "ray-profiler diff 0 7            # window 7 against window 0 of the run\n"
        "  ray-profiler diff 3 3 --run-a run_20261201-120000 --k 40 --json\n"
        "  ray-profiler diff s3://bucket/profiles/job-0405:3 job-0412:3   # across jobs"
    ),
    "phases": (
        "ray-profiler phases --last 200\n  ray-profiler phases --run run_20261201-120000 --json"
    ),
    "stacks": (
        "ray-profiler stacks\n"
        "  stacks of 5/5 processes at 05:24:46, read in 0.26 s (auto)\n"
        "  likely culprit: rank 2 in slow_loader (while 3 ranks of sft wait in a collective)\n"
        "\n"
        "  rank 2 (1): slow_loader <- load_batch <- train  <- likely culprit\n"
        "  ranks 0-1, 3 (3): all_reduce <- _update <- sft_step <- train\n"
        "  sft driver (1): call <- run <- main <- test_a_hung_rank_is_named_on_demand_... \n"
        "  (tests/test_stalls.py: 4 gloo ranks, rank 2 stuck; the driver there is pytest)\n"
        "\n"
        "  ray-profiler stacks --rank 2          # every thread of rank 2, frame by frame\n"
        "  ray-profiler stacks --native --json   # C/C++ frames too, as JSON"
    ),
    "memory": (
        "ray-profiler memory\n"
        "  leak: policy rank 1 grows 181.3 MiB/min since 18:40:02; the other ranks ... flat\n"
        "  ray-profiler memory --json        # every rank: rss_bytes, peak_rss_bytes, growth\n"
        "  ray-profiler memory --snapshot    # CUDA ranks: a memory snapshot each, now"
    ),
    "watch": "ray-profiler watch --interval 2\n  ray-profiler watch --count 10 > status.log",
    "serve": (
        "ray-profiler serve   # http://127.0.0.1:8270/, a token for changes printed once\n"
        "  ray-profiler serve --from s3://bucket/profiles/job-0412   # a record, read-only\n"
        "  RAY_PROFILER_TOKEN=... ray-profiler serve --host 0.0.0.0 --port 8270"
    ),
    "collect": (
        "ray-profiler collect --window 3 --to ./window3   # then: tensorboard, Perfetto, HTA\n"
        "  ray-profiler collect --window 3 --merge w3.json.gz --min-us 5   # every rank, one file\n"
        "  ray-profiler collect --window 3 --run job --to s3://bucket/collected/w3\n"
        "  ray-profiler collect --from s3://bucket/profiles/job-0412 --window 3 --merge w3.json.gz"
    ),
}


class CliError(Exception):
    """A failure to report as one line."""


def _global_options(parser: argparse.ArgumentParser, top: bool) -> None:
    """The options every command takes, before or after the command's name.

    On the subcommands they default to ``SUPPRESS``, so a value given before the command is
    not overwritten by the subcommand's default.
    """

    def default(value: Any) -> Any:
        return value if top else argparse.SUPPRESS

    parser.add_argument(
        "--address",
        default=default(os.environ.get("RAY_ADDRESS") or "auto"),
        help="Ray cluster address, HOST:PORT or auto (default: $RAY_ADDRESS, else auto)",
    )
    parser.add_argument(
        "--namespace", default=default("profiler"), help="the coordinator's namespace"
    )
    parser.add_argument("--name", default=default("profiler"), help="the coordinator's name")
    parser.add_argument(
        "--json", action="store_true", default=default(False), help="print JSON, not tables"
    )
    parser.add_argument(
        "--from",
        dest="from_",
        metavar="PATH_OR_URL",
        default=default(None),
        help="read a run's record (its directory, its record/, a URL, or a run's name under "
        f"${SAVE_PATH_ENV}), not a coordinator: no cluster needed",
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; exits with status 2 (usage) on a bad one, as argparse does."""
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """Every command and flag (``docs/reference.md`` is generated from it)."""
    ap = argparse.ArgumentParser(
        prog="ray-profiler",
        description=__doc__.split("\n\n")[0],
        epilog="exit status: 0 ok, 1 error, 2 usage. Run 'ray-profiler COMMAND --help' for "
        "a command's options and an example.",
    )
    _global_options(ap, top=True)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=help,
            description=help,
            epilog=f"example:\n  {_EXAMPLES[name]}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _global_options(p, top=False)
        return p

    _reading_commands(command)
    _offline_commands(command)
    _steering_commands(command)
    return ap


Command = Any  # (name, help) -> argparse.ArgumentParser


def _memory_args(mem: argparse.ArgumentParser) -> None:
    mem.add_argument("--trainer", default=None, help="one trainer's ranks")
    mem.add_argument(
        "--snapshot", action="store_true", help="CUDA ranks write a memory snapshot now"
    )
    mem.add_argument("--rank", type=int, nargs="+", default=None, help="--snapshot: only these")
    mem.add_argument("--wait", type=float, default=60.0, help="--snapshot: seconds to wait")


def _reading_commands(command: Command) -> None:
    """The commands that only read the coordinator."""
    status = command("status", "run, window phase, step, windows, ranks, counters")
    status.add_argument(
        "--all", action="store_true", help="every rank (a run of over 256 ranks lists the not-ok)"
    )
    command("windows", "every closed window: steps, ranks, stragglers, marks, traces")
    ranks = command("ranks", "a page of the per-rank list, filtered by state")
    ranks.add_argument("--state", default=None, help="ok, disabled, lost, unresponsive, ...")
    ranks.add_argument("--trainer", default=None, help="one trainer's ranks")
    ranks.add_argument("--offset", type=int, default=0, help="ranks to skip (paging)")
    ranks.add_argument("--limit", type=int, default=100, help="ranks on the page")
    top = command("top", "cross-rank top kernels of a window")
    top.add_argument("--window", type=int, default=None, help="default: the latest closed")
    top.add_argument("--k", type=int, default=20, help="kernels to list")
    top.add_argument("--run", default=None, help="an earlier run (status shows previous_runs)")
    top.add_argument("--role", default=None, help="whose ranks: rollout, ... (default: policy)")
    top.add_argument("--trainer", default=None, help="whose ranks, by trainer id")
    _add_by(top)
    _collectives_args(command("collectives", "a window's collectives matched across its ranks"))
    _advise_args(command("advise", "a window's findings across ranks: rule, ranks, cost a step"))


def _advise_args(adv: argparse.ArgumentParser) -> None:
    adv.add_argument("--window", type=int, default=None, help="default: the latest closed")
    adv.add_argument("--role", default=None, help="whose ranks: rollout, ... (default: policy)")
    adv.add_argument("--trainer", default=None, help="whose ranks, by trainer id")
    adv.add_argument("--run", default=None, help="an earlier run (status shows previous_runs)")


def _collectives_args(coll: argparse.ArgumentParser) -> None:
    coll.add_argument("--window", type=int, default=None, help="default: the latest closed")
    coll.add_argument("--role", default=None, help="whose ranks: rollout, ... (default: policy)")
    coll.add_argument("--trainer", default=None, help="whose ranks, by trainer id")
    coll.add_argument("--run", default=None, help="an earlier run (status shows previous_runs)")
    coll.add_argument(
        "--shown", type=int, default=500, help="collectives to list, the largest skews (500)"
    )


def _add_by(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--by",
        choices=("kernel", "op"),
        default="kernel",
        help="kernel (default) or op: CUDA ranks' device time by the CPU op that launched it",
    )


def _offline_commands(command: Command) -> None:
    """The commands that read traces from disk, with no cluster."""
    summ = command("summarise", "the cross-rank tables of traces on disk (no Ray needed)")
    summ.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="trace files or directories; with --window, one run (its name, directory or URL)",
    )
    summ.add_argument(
        "--window",
        type=int,
        default=None,
        help="a window of the run PATH names: its traces, read from save_path",
    )
    summ.add_argument("--role", default=None, help="with --window: whose traces (default policy)")
    summ.add_argument("--steps", default=None, help="the window's steps, A-B (default: markers)")
    summ.add_argument("--k", type=int, default=20, help="rows to list (default 20)")
    _add_by(summ)
    summ.add_argument(
        "--collectives",
        action="store_true",
        help="the collectives matched across the traces' ranks, not the kernel table",
    )
    summ.add_argument(
        "--advise", action="store_true", help="the window's findings, not the kernel table"
    )


def _capture_args(cap: argparse.ArgumentParser) -> None:
    cap.add_argument("--active", type=int, required=True, help="steps to record")
    cap.add_argument("--warmup", type=int, default=1, help="warm-up steps before them")
    cap.add_argument(
        "--ranks",
        type=int,
        nargs="+",
        default=None,
        help="global ranks (default: those the config selects)",
    )
    cap.add_argument(
        "--start-step",
        type=int,
        default=None,
        help="the first recorded step (default: as soon as possible)",
    )
    cap.add_argument("--wait", action="store_true", help="wait for the window, print its kernels")
    cap.add_argument("--timeout", type=float, default=600.0, help="seconds --wait waits")
    cap.add_argument("--k", type=int, default=20, help="--wait: kernels to list")


def _collect_args(coll: argparse.ArgumentParser) -> None:
    coll.add_argument("--window", type=int, required=True, help="the window's number")
    coll.add_argument("--to", default=None, help="a local directory or an fsspec URL")
    coll.add_argument("--run", default=None, help="an earlier run (default: the current one)")
    coll.add_argument("--wait", type=float, default=60.0, help="seconds to wait for traces")
    coll.add_argument(
        "--role", default=None, help="whose traces: rollout, ... (default: policy; --merge: all)"
    )
    coll.add_argument(
        "--merge", default=None, metavar="OUT", help="one Chrome trace, every rank a process"
    )
    coll.add_argument("--ranks", type=int, nargs="+", default=None, help="only these ranks")
    coll.add_argument("--min-us", type=float, default=0.0, help="--merge: leave out shorter events")
    coll.add_argument(
        "--max-events", type=int, default=None, help="--merge: at most this many per rank"
    )


def _steering_commands(command: Command) -> None:
    """The commands that change what the coordinator does, and the long-running ones."""
    _capture_args(command("capture", "profile the next steps of the running job"))
    cancel = command("cancel", "drop a capture that has not started")
    cancel.add_argument("window", type=int, help="the capture's window, as capture printed it")
    diff = command("diff", "what changed from window A to window B: kernels, breakdown, step")
    diff.add_argument("a", help="WINDOW, or RUN:WINDOW (a run's name, directory or record URL)")
    diff.add_argument("b", help="WINDOW, or RUN:WINDOW")
    diff.add_argument("--run-a", default=None, help="A's run (default: the current one)")
    diff.add_argument("--run-b", default=None, help="B's run (default: the current one)")
    diff.add_argument("--k", type=int, default=30, help="kernels listed (largest change first)")
    phases = command("phases", "per-step phase times: each region's share, the slowest steps")
    phases.add_argument(
        "--last", type=int, default=100, help="steps to list (default 100, at most 10000)"
    )
    phases.add_argument("--run", default=None, help="an earlier run (status shows previous_runs)")
    stacks = command("stacks", "every rank's stack now, grouped; the likely culprit of a hang")
    stacks.add_argument("--rank", type=int, nargs="+", default=None, help="raw stacks of these")
    stacks.add_argument("--trainer", default=None, help="one trainer's ranks")
    stacks.add_argument("--native", action="store_true", help="C/C++ frames too (py-spy)")
    stacks.add_argument(
        "--method",
        choices=["auto", "py-spy", "faulthandler"],
        default="auto",
        help="how each process is read (auto: py-spy, else faulthandler)",
    )
    stacks.add_argument("--timeout", type=float, default=10.0, help="seconds per process")
    _memory_args(command("memory", "every rank's memory now, its peak and growth; leaks named"))
    strag = command("stragglers", "ranks slower than the median in a window")
    strag.add_argument("--window", type=int, default=None, help="default: the latest closed")
    _collect_args(command("collect", "copy a window's traces into one directory, or merge them"))
    auto = command("auto", "profile slow steps by themselves: switch it on or off, or show it")
    auto.add_argument("switch", nargs="?", choices=["on", "off"], help="default: show")
    serve = command("serve", "web pages and a JSON API for this coordinator (token for changes)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    serve.add_argument("--port", type=int, default=8270, help="port to bind")
    watch = command("watch", "the step time over the run and the status, refreshed")
    watch.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    watch.add_argument("--count", type=int, default=0, help="stop after N refreshes (0: never)")
    chart_help = "leave out the step time over the run (its windows and stalls)"
    watch.add_argument("--no-chart", dest="chart", action="store_false", help=chart_help)


def connect(address: str, namespace: str, name: str) -> Any:
    """A coordinator handle, or CliError with one line that says what is missing."""
    from coordinator.client.connect import connect as connect_to

    try:
        return connect_to(name, namespace, address=address)
    except (ConnectionError, ValueError) as exc:
        raise CliError(str(exc)) from None


def source(args: argparse.Namespace) -> Any:
    """What the command reads: the run's record (``--from``), else the live coordinator."""
    if not args.from_:
        return connect(args.address, args.namespace, args.name)
    from coordinator.ops.recorded import RecordedCoordinator, locate, open_record

    try:
        return RecordedCoordinator(open_record(locate(args.from_)))
    except (ValueError, OSError) as exc:
        raise CliError(str(exc).strip().splitlines()[-1]) from None


def call(handle: Any, method: str, *args: Any, get_timeout: float = 60, **kwargs: Any) -> Any:
    from coordinator.ops.recorded import ReadOnly, RecordedCoordinator
    from coordinator.ops.recorded import call as call_recorded

    if isinstance(handle, RecordedCoordinator):
        try:
            return call_recorded(handle, method, *args, **kwargs)
        except (ValueError, ReadOnly) as exc:
            raise CliError(str(exc).strip().splitlines()[-1]) from None
    import ray

    try:
        return ray.get(getattr(handle, method).remote(*args, **kwargs), timeout=get_timeout)
    except ray.exceptions.RayActorError as exc:
        raise CliError(f"the coordinator died: {exc}") from None
    except ray.exceptions.GetTimeoutError:
        raise CliError(
            f"the coordinator did not answer {method} within {get_timeout:g} s"
        ) from None
    except ValueError as exc:  # e.g. an unknown window
        raise CliError(str(exc).strip().splitlines()[-1]) from None


# ------------------------------------------------------------------ commands


def run(args: argparse.Namespace) -> int:
    if args.command == "summarise":
        return summarise_command(args)
    named = args.command == "diff" and all(":" in x for x in (args.a, args.b))
    h = None if named and not args.from_ else source(args)  # (two runs named: maybe records)
    if args.command == "serve":
        return serve(h, args)
    text = read(h, args)
    if text is not None:
        print(text)
    elif args.command == "cancel":
        res = call(h, "cancel_capture", args.window)
        if args.json:
            print(json.dumps(res))
        elif res["cancelled"]:
            print(f"capture {args.window} cancelled")
        else:
            raise CliError(f"cannot cancel window {args.window}: {res['reason']}")
    elif args.command == "capture":
        return capture(h, args)
    elif args.command == "auto":
        return auto(h, args)
    elif args.command == "watch":
        watch(h, args)
    elif args.command == "collect":
        return collect(h, args)
    return EXIT_OK


def read(h: Any, args: argparse.Namespace) -> str | None:
    """What a reading command prints (JSON with ``--json``), or None for another command."""
    a, dump = args, json.dumps
    if a.command == "status":
        st = call(h, "status", ranks="all" if a.all else "summary")
        return dump(st) if a.json else render_status(st)
    if a.command == "ranks":
        page = call(h, "ranks", a.offset, a.limit, a.state, a.trainer)
        return dump(page) if a.json else render_ranks(page)
    if a.command == "top":
        ks = call(h, "kernel_summary", a.window, a.k, a.trainer, False, a.run, a.role, a.by)
        return dump(ks) if a.json else render_top(ks)
    if a.command == "stragglers":
        ks = call(h, "kernel_summary", window=a.window, top_k=0)
        return (
            dump(ks["stragglers"] | {"window": ks["window"]}) if a.json else render_stragglers(ks)
        )
    if a.command == "collectives":
        from coordinator.ops.collective_table import render_collectives

        if not 0 <= a.shown <= 100_000:
            raise CliError(f"--shown must be in 0..100000, got {a.shown}")
        co = call(h, "collectives", a.window, a.trainer, a.run, a.role, a.shown)
        return dump(co) if a.json else render_collectives(co)
    if a.command == "advise":
        from coordinator.ops.finding_table import render_findings

        fr = call(h, "advise", a.window, a.trainer, a.run, a.role)
        return dump(fr) if a.json else render_findings(fr)
    if a.command == "windows":
        windows = call(h, "status")["windows"]
        return dump(windows) if a.json else render_windows(windows, last=None)
    if a.command == "diff":
        d = diff(h, a)
        return dump(d) if a.json else render_diff(d)
    if a.command == "phases":
        pt = call(h, "phase_times", last=a.last, run=a.run)
        return dump(pt) if a.json else render_phases(pt)
    if a.command == "memory":
        return memory_command(h, a)
    if a.command == "stacks" and a.from_:  # a record: the stalls it kept, with their stacks
        stalls = call(h, "stalls")
        return dump(stalls) if a.json else render_stalls(stalls)
    if a.command == "stacks":
        st = call(
            h, "stacks", a.native, a.rank, a.trainer,
            a.method,  # positional: ``call`` has its own ``method``
            False, a.timeout, get_timeout=2 * a.timeout + 60,
        )  # fmt: skip
        return dump(st) if a.json else render_stacks(st)
    return None


def memory_command(h: Any, a: argparse.Namespace) -> str:
    """``memory``: the table (or JSON); ``--snapshot``: ask, then wait for the files."""
    from coordinator.ops.memory_table import render_memory, render_snapshot

    if not a.snapshot:
        m = call(h, "memory", False, a.trainer)
        return json.dumps(m) if a.json else render_memory(m)
    asked = call(h, "memory_snapshot", a.rank, a.trainer)
    want = {(r["trainer_id"], r["rank"]) for r in asked["ranks"] if r["asked"]}
    deadline = time.monotonic() + max(0.0, a.wait)
    written: list[Any] = []
    while True:
        notes = call(h, "memory")["snapshots"]
        written = [s for s in notes if s["on"] == "demand" and f"demand-{asked['request']:03d}/"
                   in str(s["path"]) and (s["trainer_id"], s["rank"]) in want]  # fmt: skip
        if len(written) >= len(want) or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    if a.json:
        return json.dumps({"asked": asked, "written": written})
    text = render_snapshot(asked, written)
    if len(written) < len(want) or any(s["error"] for s in written):
        raise CliError(text)
    return text


def diff(h: Any, args: argparse.Namespace) -> Any:
    """``diff A B``: windows of the current run (``--run-a``/``--run-b``: of another kept
    one), or ``RUN:WINDOW`` sides of any run, live or recorded (``cross_diff``)."""
    from coordinator.ops.cross_diff import diff_across, parse_side

    a, b = (_refusing(parse_side, x) for x in (args.a, args.b))
    for side, run, flag in ((a, args.run_a, "--run-a"), (b, args.run_b, "--run-b")):
        if side.run is not None and run is not None:
            raise CliError(f"a side names its run twice: {flag} {run} and {side.run}:")
    if a.run is None and b.run is None:
        return call(h, "kernel_diff", a.window, b.window, args.run_a, args.run_b, None, args.k)
    sides = [
        f"{s.run or run}:{s.window}" if (s.run or run) else str(s.window)
        for s, run in ((a, args.run_a), (b, args.run_b))
    ]
    save_path = os.environ.get(SAVE_PATH_ENV)
    live = None
    if h is None:  # no coordinator asked for: a run is first looked for where it runs
        h = _maybe_connect(args)
    if h is not None:
        save_path = save_path or call(h, "status")["config"].get("save_path")

        def live(method: str, *x: Any, **kw: Any) -> Any:
            return call(h, method, *x, **kw)

    return _refusing(diff_across, sides[0], sides[1], args.k, live, save_path)


def _maybe_connect(args: argparse.Namespace) -> Any:
    """The coordinator when one answers, else None (a diff of two records needs none)."""
    try:
        return connect(args.address, args.namespace, args.name)
    except CliError:
        return None


def serve(h: Any, args: argparse.Namespace) -> int:
    """Serve the web pages and the JSON API until interrupted."""
    from coordinator.ops.web.auth import TOKEN_ENV
    from coordinator.ops.web.server import serve as serve_web

    token = os.environ.get(TOKEN_ENV) or None
    link = None
    if args.from_:  # a record: read-only
        from coordinator.ops.web.record_link import RecordLink

        link = RecordLink(h)
    serve_web(h, args.name, args.namespace, args.host, args.port, token, link=link)
    return EXIT_OK


def auto(h: Any, args: argparse.Namespace) -> int:
    """Show auto capture, or switch it on or off for the running job (an operator's change)."""
    if args.switch is None:
        state = call(h, "status")["auto_capture"]
    else:
        res = call(h, "set_auto_capture", args.switch == "on")
        if not res["applied"]:
            raise CliError(f"auto capture not switched {args.switch}: {res['reason']}")
        state = res["auto_capture"]
    print(json.dumps(state) if args.json else render_auto(state))
    return EXIT_OK


def collect(h: Any, args: argparse.Namespace) -> int:
    """Copy a window's traces into one directory, or merge them into one trace (``--merge``);
    exit 1 when some rank's trace is missing."""
    from coordinator.ops.collect import collect_window

    if args.merge:
        return merge(h, args)
    if not args.to:
        raise CliError("collect needs --to DIR (or --merge OUT.json.gz)")
    res = _refusing(
        collect_window, h, args.window, args.to, run=args.run, wait_s=args.wait,
        role=args.role, ranks=args.ranks,
    )  # fmt: skip
    lines = [
        f"window {res['window']} of run {res['run']}: {len(res['files'])} traces, "
        f"{res['bytes'] / 2**20:.1f} MB -> {res['dest']}"
    ] + [f"  rank {rank}: {path}" for rank, path in res["files"].items()]
    missing = {f"rank {r}": why for r, why in sorted(res["missing"].items())}
    return _report(args, res, lines, missing)


def merge(h: Any, args: argparse.Namespace) -> int:
    """``collect --merge``: every rank of a window in one Chrome trace, for Perfetto."""
    from coordinator.ops.timeline import merge_window

    res = _refusing(
        merge_window, h, args.window, args.merge, run=args.run,
        roles=[args.role] if args.role else None, ranks=args.ranks, min_us=args.min_us,
        max_events=args.max_events, wait_s=args.wait, keep=args.to,
    )  # fmt: skip
    left = sum(r["below_min_us"] + r["over_max_events"] for r in res["ranks"])
    spread = max(res["step_start_spread_us"].values(), default=0.0)
    lines = [
        f"window {res['window']} of run {res['run']}: {len(res['ranks'])} ranks, "
        f"{res['events']} events ({left} left out), {res['bytes'] / 2**20:.1f} MB -> "
        f"{res['out']}; steps start within {spread / 1000:.2f} ms across ranks"
    ] + [f"  rank {r['rank']} · {r['role']} · {r['node']}: {r['kept']} of {r['events']}"
         for r in res["ranks"]]  # fmt: skip
    return _report(args, res, lines, res["missing"])


def _refusing(fn: Any, *a: Any, **kw: Any) -> Any:
    """``fn(*a, **kw)``, its ValueError a one-line CliError."""
    try:
        return fn(*a, **kw)
    except ValueError as exc:
        raise CliError(str(exc).strip().splitlines()[-1]) from None


def _report(args: argparse.Namespace, res: Any, lines: list[str], missing: dict[str, str]) -> int:
    """Print ``res`` (``--json``) or ``lines``; exit 1 naming what is ``missing``."""
    print(json.dumps(res) if args.json else "\n".join(lines))
    if missing:
        raise CliError("missing: " + "; ".join(f"{k}: {why}" for k, why in missing.items()))
    return EXIT_OK


def watch(h: Any, args: argparse.Namespace) -> None:
    """Refresh the status every ``interval`` s. On a terminal the view is redrawn in place
    (cursor home, clear below: the scrollback keeps what was there); into a pipe or a file,
    each refresh is appended as plain text, without escape codes."""
    tty = sys.stdout.isatty()
    n = 0
    while True:
        st = call(h, "status")
        text = render_status(st)
        if args.chart and not args.json:
            text = "\n".join([*_chart_lines(h, st), "", text])
        if args.json:
            print(json.dumps(st), flush=True)
        elif tty:
            print("\033[H\033[J" + time.strftime("%H:%M:%S  ") + text, flush=True)
        else:
            print(f"--- {time.strftime('%H:%M:%S')}\n{text}\n", flush=True)
        n += 1
        if args.count and n >= args.count:
            break
        time.sleep(args.interval)


def _chart_lines(h: Any, st: Any) -> list[str]:
    """The step time over the run as text, as wide as the terminal (``watch``)."""
    from coordinator.ops.run_chart import render_chart, run_chart

    width = max(20, shutil.get_terminal_size((100, 24)).columns - 12)
    return render_chart(run_chart(call(h, "step_series", points=width * 4), st), width=width)


def capture(h: Any, args: argparse.Namespace) -> int:
    res = call(
        h,
        "request_capture",
        active=args.active,
        warmup=args.warmup,
        ranks=args.ranks,
        start_step=args.start_step,
    )
    if not res["accepted"]:
        raise CliError(f"capture refused: {res['reason']}")
    assert res["window"] is not None and res["steps"] is not None
    missed = [] if args.json else res.get("missed") or []  # (SPMD ranks: late or lost)
    for m in missed:
        print(f"  rank {m['rank']} will not record it: {m['reason']}", file=sys.stderr)
    if not args.wait:
        print(
            json.dumps(res)
            if args.json
            else f"capture accepted: window {res['window']}, steps {res['steps'][0]}-"
            f"{res['steps'][1]}, ranks {res['ranks']}"
        )
        return 0
    if not args.json:
        print(
            f"capture accepted: window {res['window']}, steps {res['steps'][0]}-"
            f"{res['steps'][1]}, ranks {res['ranks']}; waiting for it to close...",
            flush=True,
        )
    entry = wait_for_window(h, res["run"], res["window"], args.timeout)
    if entry["steps"] is None:
        raise CliError(f"capture {res['window']} recorded nothing: {entry['reason']}")
    ks = call(h, "kernel_summary", window=res["window"], top_k=args.k, run=res["run"])
    print(json.dumps(ks) if args.json else render_top(ks), flush=True)
    if not entry["kept"]:
        raise CliError(
            f"capture {res['window']} did not record the steps promised: {entry['reason']}"
        )
    return EXIT_OK


def wait_for_window(h: Any, run: str, window: int, timeout: float) -> dict[str, Any]:
    """The status entry of ``window`` of ``run`` once it closed with its summaries in, or once
    the run ended without it (an entry whose ``reason`` says why); CliError on timeout."""
    # The coordinator wakes the call when the window changes: nothing polls.
    got = call(h, "wait_window", window, run=run, timeout_s=timeout, get_timeout=timeout + 60)
    if got["done"]:
        return dict(got["window"])
    if got["window"] is None and got["reason"]:
        return {"index": window, "steps": None, "kept": False, "reason": got["reason"]}
    step = call(h, "status")["global_step"]
    raise CliError(f"window {window} did not close within {timeout:g} s (global step {step})")


def summarise_command(args: argparse.Namespace) -> int:
    """``ray-profiler summarise``: no cluster; a file that is not a trace is exit status 2.
    With ``--window``, a finished run's window, its traces read from ``save_path``: exit 1
    naming each rank whose trace is not there, after the table of the others."""
    from coordinator.ops.collective_table import render_collectives
    from coordinator.ops.finding_table import render_findings
    from coordinator.ops.offline import (
        TraceInputError,
        advise_reply,
        collectives_reply,
        parse_steps,
        summarise_traces,
    )

    with tempfile.TemporaryDirectory(prefix="ray-profiler-summarise-") as work:
        try:
            steps = parse_steps(args.steps) if args.steps is not None else None
            if not 0 <= args.k <= 100_000:
                raise ValueError(f"--k must be in 0..100000, got {args.k}")
            paths, missing = _window_traces(args, work) if args.window is not None else (
                args.paths, {}
            )  # fmt: skip
            done = summarise_traces(paths, steps, args.k, args.by)
        except (TraceInputError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    reply: Any = done.table
    render: Any = render_top
    if args.advise:
        reply, render = advise_reply(done), render_findings
    elif args.collectives:
        reply, render = collectives_reply(done), render_collectives
    if args.json:
        print(json.dumps(reply))
    else:
        for note in done.notes:
            print(f"note: {note}")
        files = ", ".join(f"rank {r} {p}" for r, p in done.files.items())
        print(f"{len(done.files)} trace(s): {files}")
        print(render(reply))
    if missing:
        said = "; ".join(f"window {args.window} rank {r}: {why}" for r, why in missing.items())
        print(f"error: missing: {said}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


def _window_traces(args: argparse.Namespace, work: str) -> tuple[list[str], dict[int, str]]:
    """``summarise RUN --window N``: the window's traces copied from ``save_path`` into
    ``work``, and rank -> why for those that are not there; ValueError for an unknown run or
    window, or a window none of whose traces is there."""
    from coordinator.ops.collect import collect_window
    from coordinator.ops.recorded import RecordedCoordinator, locate, open_record

    if len(args.paths) != 1:
        raise ValueError(f"--window takes one run (its name, directory or URL), got {args.paths}")
    h = RecordedCoordinator(open_record(locate(args.paths[0])))
    res = collect_window(h, args.window, work, role=args.role)
    if not res["files"]:
        raise ValueError(f"window {args.window}: no trace is in save_path: {res['missing']}")
    return list(res["files"].values()), dict(res["missing"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if argv is None and args.command == "summarise":
        # From the command line: its output written, the process holds nothing that needs the
        # interpreter's teardown (16 ms with numpy loaded, more than reading a small trace).
        code = summarise_command(args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    try:
        return run(args)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
