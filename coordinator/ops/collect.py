"""Collect a window's traces from every node into one directory: HTA, Perfetto, TensorBoard.

For clusters whose ``save_path`` is node-local, each rank's trace of a window stays on the node
that wrote it. ``collect_window`` asks the coordinator where each one is, then pulls it from
that node's agent through Ray in chunks (bounded memory: one chunk at a time, whatever the
file's size), or downloads it when it was uploaded to a URL ``save_path``. The destination gets
one file per rank (each trace names its rank), and may itself be an fsspec URL.

A run's record (``RecordedCoordinator``, ``--from``) serves a finished run the same way, with no
cluster: its traces are read where the record says they are in ``save_path`` (a directory or
a bucket), and one that is not there is named with its window and rank. A record is data:
a trace is read only from under the record's own run directory (``record_paths``), never
through a link that leaves it; a path it names elsewhere is a missing trace, said why.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass, field
from typing import IO, Any, TypedDict

from coordinator.core.record_paths import in_run, run_dir_of
from coordinator.core.storage import REDACTED, filesystem, is_remote, join, local_path
from coordinator.protocol.atomic_file import atomic_path

CHUNK_BYTES = 4 << 20
CHUNK_TIMEOUT_S = 30.0


class CollectResult(TypedDict):
    """What ``collect_window`` gathered, and what it could not."""

    run: str
    window: int
    dest: str
    files: dict[int, str]  # rank -> the file written under dest
    missing: dict[int, str]  # rank -> why its trace could not be collected
    bytes: int


def collect_window(
    coordinator: Any,
    window: int,
    dest: str,
    run: str | None = None,
    storage_options: dict[str, Any] | None = None,
    wait_s: float = 60.0,
    role: str | None = None,
    ranks: list[int] | None = None,
) -> CollectResult:
    """Pull every rank's trace of ``window`` (of one role) into ``dest``: one file per rank,
    each naming its rank inside, as HTA, Perfetto and TensorBoard want them.

    Each trace comes from the node that wrote it, through that node's agent, a chunk at a time
    (bounded memory whatever its size), or is downloaded when it was uploaded.

    Args:
        coordinator: the coordinator's handle (``connect()``).
        window: the window's index (``status()["windows"][i]["index"]``).
        dest: a local directory or an fsspec URL.
        run: an earlier run of the coordinator; None means the current one.
        storage_options: for a URL ``dest`` and for downloading an uploaded window; by
            default the run's own, without its credentials (the usual environment variables
            and roles supply them).
        wait_s: how long to wait for traces the agents are still finishing.
        role: whose traces (``rollout``); None: the stepping trainer's (the policy).
        ranks: only these ranks' traces (None: every rank's).

    Returns:
        A ``CollectResult``: ``files`` (rank -> the file written), ``missing`` (rank -> why: its
        node has gone, its trace cannot be read, or it was still being finished), ``bytes``.

    Raises:
        ValueError: an unknown run, a window that is not closed or not kept, a run that
            keeps no traces (``export_type: none``), a role or rank the window does not have.

    Example::

        res = collect_window(connect(address="auto"), 3, "./window3")
        # then: TraceAnalysis(trace_dir="./window3")
    """
    src = window_entry(coordinator, window, run, wait_s)
    options = dict(storage_options) if storage_options is not None else src.options
    part = _role_part(src.entry, role)
    out = CollectResult(run=src.run, window=window, dest=dest, files={}, missing={}, bytes=0)
    traces = located_traces(part, wanted_ranks(part, ranks, window), wait_s, out["missing"])
    for rank, t in sorted(traces.items()):
        try:
            if src.recorded:
                name, written = _copy_file(stored_trace(t, options, src), dest, options, src)
            else:
                name, written = _collect_one(t, dest, options)
        except TraceMissing as exc:
            out["missing"][rank] = str(exc)
            continue
        out["files"][rank] = name
        out["bytes"] += written
    return out


def located_traces(
    part: dict[str, Any], wanted: set[int], wait_s: float, missing: dict[int, str]
) -> dict[int, dict[str, Any]]:
    """Where each wanted rank's trace is; those without one go to ``missing``, with why."""
    traces = {int(r): t for r, t in part["traces"].items() if int(r) in wanted}
    never = {r: "its node agent never reported where the trace is" for r in wanted}
    missing.update({r: why for r, why in never.items() if r not in traces})
    for r in part["traces_pending"]:
        if r in wanted:
            missing[r] = f"its trace was still being finished after {wait_s:g} s"
    return traces


def wanted_ranks(part: dict[str, Any], ranks: list[int] | None, window: int) -> set[int]:
    """The ranks asked for, each one the window's (else ValueError)."""
    wanted = set(part["ranks"] if ranks is None else ranks)
    if not wanted <= set(part["ranks"]):
        raise ValueError(
            f"window {window} has no rank {sorted(wanted - set(part['ranks']))[0]}: "
            f"its ranks are {part['ranks']}"
        )
    return wanted


class TraceMissing(Exception):
    """A rank's trace that cannot be had; the message says why."""


def _role_part(entry: dict[str, Any], role: str | None) -> dict[str, Any]:
    """The window entry's part for ``role`` (its own per-rank fields when None)."""
    if role is None:
        return entry
    parts = [p for p in entry.get("roles", {}).values() if p["role"] == role]
    if len(parts) != 1:
        have = sorted({p["role"] for p in entry.get("roles", {}).values()})
        why = "several trainers have it" if parts else f"its roles are {have}"
        raise ValueError(f"window {entry['index']} has no single role {role!r}: {why}")
    return dict(parts[0])


@dataclass
class WindowSource:
    """A window's status entry, and where its traces are read from."""

    entry: dict[str, Any]
    run: str
    options: dict[str, Any]  # the run's storage options, without its credentials
    recorded: bool = False  # a run's record: every trace read here from save_path
    nodes: dict[str, str] = field(default_factory=dict)  # (a record's) node id -> its name
    run_dir: str = ""  # (a record's) its run directory, where it is read from: traces in it
    recorded_run_dir: str | None = None  # (a record's) the run directory it says it was in


def window_entry(coordinator: Any, window: int, run: str | None, wait_s: float) -> WindowSource:
    """The status entry of ``window``, once no rank's trace is pending (or ``wait_s`` ran out);
    the coordinator wakes the wait when the window changes. From a record: as recorded."""
    from coordinator.ops.recorded import RecordedCoordinator

    if isinstance(coordinator, RecordedCoordinator):
        return _recorded_entry(coordinator, window, run)
    import ray

    st = ray.get(coordinator.status.remote())
    runs = [{"run": st["run"], "windows": st["windows"], "config": st["config"]}]
    runs += st["previous_runs"]
    mine = next((r for r in runs if run is None or r["run"]["name"] == run), None)
    if mine is None:
        raise ValueError(
            f"no run {run!r}: the coordinator keeps {[r['run']['name'] for r in runs]}"
        )
    name = mine["run"]["name"]
    if mine["config"].get("export_type") == "none":
        raise ValueError(f"run {name} keeps no traces (export_type: none)")
    ref = coordinator.wait_window.remote(window, run=name, until="traces", timeout_s=wait_s)
    got = ray.get(ref, timeout=wait_s + 30)
    if got["window"] is None:
        kept = [w["index"] for w in mine["windows"]]
        raise ValueError(f"no closed window {window} in run {name}: {kept}")
    return WindowSource(dict(got["window"]), name, _options(mine["config"]))


def _options(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.get("storage_options", {}).items() if v != REDACTED}


def _recorded_entry(h: Any, window: int, run: str | None) -> WindowSource:
    """A window of a run's record (``RecordedCoordinator``), every rank listed."""
    rec = h.rec
    name = rec.run.name
    if run is not None and run != name:
        raise ValueError(f"no run {run!r}: the record at {rec.url} is run {name}'s")
    config = dict(rec.file.config)
    if config.get("export_type") == "none":
        raise ValueError(f"run {name} keeps no traces (export_type: none)")
    w = rec.run.state.windows.get(window)
    if w is None or not w.closed:
        kept = [i for i, r in rec.run.state.windows.items() if r.closed]
        raise ValueError(f"no closed window {window} in run {name}: {kept}")
    entry = dict(w.to_dict(complete=True))
    return WindowSource(entry, name, _options(config), recorded=True, nodes=dict(rec.file.nodes),
                        run_dir=run_dir_of(rec.url), recorded_run_dir=rec.run.run_dir)  # fmt: skip


def stored_trace(t: dict[str, Any], options: dict[str, Any], src: WindowSource) -> str:
    """Where a recorded rank's trace is now, under the record's run directory (``in_run``):
    its upload, else the file it was written as, the first that is there; ``TraceMissing``
    naming both when neither is (never uploaded, deleted, or named outside the run)."""
    named = list(dict.fromkeys(str(p) for p in (t["path"], t["local_path"]) if p))
    if not named:
        raise TraceMissing(f"no trace: {(t['error'] or {}).get('message', 'nothing was written')}")
    tried = [p for p in (in_run(n, src.run_dir, src.recorded_run_dir) for n in named) if p]
    if not tried:
        raise TraceMissing(
            f"the record names its trace {' and '.join(named)!r:.300}, outside the run's "
            f"directory {src.run_dir}: not read (a record is data, never a path to trust)"
        )
    why = "not there"
    for found in tried:
        try:
            if not is_remote(found):
                return _inside(found, src.run_dir)
            fs, path = filesystem(found, options)
            if fs.exists(path):
                return found
        except FileNotFoundError:
            continue
        except Exception as exc:  # (a bucket that cannot be reached: said, the rest go on)
            why = f"cannot be looked at: {type(exc).__name__}: {exc}"[:300]
    raise TraceMissing(f"its trace is not in save_path ({why}): {' nor '.join(tried)}")


def _inside(path: str, run_dir: str) -> str:
    """``path`` with its links resolved, when that is a file in ``run_dir``; FileNotFoundError
    when there is none, ``TraceMissing`` when a link leads out of it."""
    real, root = os.path.realpath(path), os.path.realpath(local_path(run_dir))
    if not os.path.isfile(real):
        raise FileNotFoundError(path)
    if not real.startswith(root.rstrip("/") + "/"):
        raise TraceMissing(f"{path} is a link out of the run's directory {run_dir}: not read")
    return real


def open_inside(path: str, run_dir: str) -> IO[bytes]:
    """The regular file ``path``, opened, checked after the open (so no link swapped in
    meanwhile is followed out of ``run_dir``); ``TraceMissing`` when it is not in it."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    f = os.fdopen(fd, "rb")
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
        root = os.path.realpath(local_path(run_dir)).rstrip("/") + "/"
        if not opened.startswith(root) or not stat.S_ISREG(os.fstat(fd).st_mode):
            raise TraceMissing(f"{path} is not a file in the run's directory {run_dir}: not read")
    except BaseException:
        f.close()
        raise
    return f


def _copy_file(
    src: str, dest: str, options: dict[str, Any], record: WindowSource | None = None
) -> tuple[str, int]:
    """Copy the trace at ``src`` (a path or a URL) into ``dest``; its path and bytes there
    (``record``: a record's local trace, opened only inside its run directory)."""
    target = join(dest, src.rstrip("/").rsplit("/", 1)[-1])
    try:
        if record is not None and not is_remote(src):
            fin = open_inside(src, record.run_dir)
        else:
            fs, path = filesystem(src, options)
            fin = fs.open(path, "rb")
        with fin, _writer(target, options) as fout:
            return target, _copy(lambda n: fin.read(n), fout)
    except TraceMissing:
        raise
    except Exception as exc:
        raise TraceMissing(f"cannot copy {src}: {type(exc).__name__}: {exc}") from None


def _collect_one(t: dict[str, Any], dest: str, options: dict[str, Any]) -> tuple[str, int]:
    """Copy one rank's trace to ``dest`` (its upload, else through its node's agent); the
    destination path and the bytes written."""
    import ray

    src, uploaded = trace_source(t)
    if not src:
        raise TraceMissing(f"no trace: {(t['error'] or {}).get('message', 'nothing was written')}")
    if uploaded:
        return _copy_file(src, dest, options)
    target = join(dest, src.rstrip("/").rsplit("/", 1)[-1])
    node = t["node"]
    if not node:
        raise TraceMissing(f"the node that wrote {src} is unknown")
    agent, gone = node_agent(ray, node)
    if agent is None:
        raise TraceMissing(f"{gone}; its trace {src} went with it")
    try:
        with _writer(target, options) as fout:
            offset = 0

            def read(n: int) -> bytes:
                nonlocal offset
                chunk: bytes = ray.get(
                    agent.read_trace_chunk.remote(src, offset, n), timeout=CHUNK_TIMEOUT_S
                )
                offset += len(chunk)
                return chunk

            return target, _copy(read, fout)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        raise TraceMissing(
            f"node {node[:12]} is gone or does not answer (its trace {src} was not copied)"
        ) from None
    except Exception as exc:
        raise TraceMissing(
            f"cannot read {src} on node {node[:12]}: {type(exc).__name__}: {exc}"
        ) from None


def trace_source(t: dict[str, Any]) -> tuple[str | None, bool]:
    """Where a rank's trace (its ``traces`` entry in ``status()``) is read from, and whether
    that is its uploaded copy (a URL) rather than the node-local file."""
    uploaded = t["path"] is not None and is_remote(t["path"]) and not t["error"]
    return (t["path"] if uploaded else (t["local_path"] or t["path"])), uploaded


def node_agent(ray: Any, node: str) -> tuple[Any, str]:
    """The node agent of ``node``, or None and why (the node, or its agent, has gone)."""
    from coordinator.protocol.names import AGENT_NAMESPACE, agent_name

    if not _node_alive(ray, node):
        return None, f"node {node[:12]} is gone"
    try:
        return ray.get_actor(agent_name(node), namespace=AGENT_NAMESPACE), ""
    except ValueError:
        return None, f"node {node[:12]} is gone (its node agent cannot be reached)"


def _node_alive(ray: Any, node: str) -> bool:
    """Whether Ray knows the node with this id and has not marked it dead."""
    try:
        return any(n.get("NodeID") == node and n.get("Alive") for n in ray.nodes())
    except Exception:
        return True  # cannot tell: try the node agent


def _copy(read: Any, fout: IO[bytes]) -> int:
    total = 0
    while chunk := read(CHUNK_BYTES):
        fout.write(chunk)
        total += len(chunk)
    return total


@contextlib.contextmanager
def _writer(target: str, options: dict[str, Any]) -> Any:
    """A file opened for writing at ``target``; a local one appears only once complete."""
    if is_remote(target):
        fs, path = filesystem(target, options)
        with fs.open(path, "wb") as f:
            yield f
        return
    target = local_path(target)
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    with atomic_path(target) as part, open(part, "wb") as f:
        yield f
