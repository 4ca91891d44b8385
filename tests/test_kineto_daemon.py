"""The kineto daemon's protocol, its late-reply rules and the agent's wait for a trace, with
real Unix sockets and files (no torch: the clients here speak libkineto's protocol)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
import struct
import subprocess
import tempfile
import time

import pytest

from coordinator.protocol.atomic_file import write_atomic
from coordinator.protocol.summary_codec import (
    KernelRow,
    RankSummary,
    decode_summary,
    encode_summary,
)
from worker_ext.agent import kineto_ipc as ipc
from worker_ext.agent.kineto_daemon import Daemon
from worker_ext.agent.kineto_traces import (
    KinetoRequest,
    await_trace,
    cancel_path,
    ended_path,
    settle_steps,
    written_path,
)


@pytest.fixture
def short():
    """A directory short enough for socket paths in it (a pytest tmp_path is not)."""
    d = tempfile.mkdtemp(prefix="kt-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def kdir(short):
    return ipc.prepare_dir(os.path.join(short, "k"))


class Client:
    """A libkineto client: its own socket in the directory, asking the daemon for configs."""

    def __init__(self, directory: str, name: str = "dynoconfigclient-test") -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.addr = os.path.join(directory, name)
        self.sock.bind(self.addr)
        self.sock.settimeout(0.3)
        self.daemon = os.path.join(directory, ipc.SOCKET_NAME)

    def ask(self, pid: int, types: int = 3) -> None:
        self.sock.sendto(ipc.request([pid, 1], types), self.daemon)

    def answer(self) -> str | None:
        try:
            msg = ipc.decode(self.sock.recv(1 << 16))
        except TimeoutError:
            return None
        assert msg.kind == "req"
        return msg.body.decode()

    def close(self) -> None:
        self.sock.close()


def test_messages_round_trip_and_malformed_ones_are_refused():
    req = ipc.request([42, 7, 1], types=3, job_id=9)
    msg = ipc.decode(req)
    assert msg.kind == "req" and len(req) == 40 + 16 + 12
    assert ipc.parse_request(msg.body) == ipc.ConfigRequest(3, 9, (42, 7, 1))
    assert ipc.decode(ipc.reply("A=1\n")) == ipc.Message("req", b"A=1\n")
    with pytest.raises(ValueError, match="shorter than the 40-byte header"):
        ipc.decode(b"x" * 10)
    with pytest.raises(ValueError, match="header says 5 bytes"):
        ipc.decode(struct.pack("=Q32s", 5, b"req") + b"ab")
    with pytest.raises(ValueError, match="with 0 pids"):
        ipc.parse_request(struct.pack("=iiq", 3, 0, 0))
    with pytest.raises(ValueError, match="with 99 pids"):
        ipc.parse_request(struct.pack("=iiq", 3, 99, 0))


def test_config_text_refuses_what_would_break_its_lines():
    assert ipc.config_text({"A_B": 1, "C": True}) == "A_B=1\nC=true\n"
    with pytest.raises(ValueError, match="not a libkineto option"):
        ipc.config_text({"A": "1\nPROFILE_START_ITERATION=0"})
    with pytest.raises(ValueError, match="not a libkineto option"):
        ipc.config_text({"a=b": 1})


def test_the_directory_is_private_and_the_environment_names_it(short):
    env = ipc.kineto_env(os.path.join(short, "k"))
    d = env["KINETO_IPC_SOCKET_DIR"]
    assert env["KINETO_USE_DAEMON"] == "1" and env[ipc.DIR_ENV] == d
    assert env[ipc.RAY_SETUP_HOOK_ENV] == "worker_ext.attach.kineto_setup"
    assert ipc.RAY_SETUP_HOOK_ENV not in ipc.kineto_env(d, setup_hook=False)
    assert os.stat(d).st_mode & 0o777 == 0o700
    with open(env["KINETO_CONFIG"]) as f:
        assert f.read() == "ON_DEMAND_CONFIG_UPDATE_INTERVAL_SECS=1\n"
    open_dir = os.path.join(short, "open")
    os.mkdir(open_dir)
    os.chmod(open_dir, 0o777)
    with pytest.raises(PermissionError, match="open to others"):
        ipc.prepare_dir(open_dir)
    with pytest.raises(ValueError, match="too long for libkineto's sockets"):
        ipc.prepare_dir("/tmp/" + "x" * 60)


@pytest.mark.parametrize(
    ("job_hook", "named", "warned"),
    [
        (None, True, False),  # no job hook (or no Ray): the variable names ours
        ("worker_ext.attach.kineto_setup", True, False),  # (the same hook)
        ("worker_ext.attach.setup", False, False),  # the attach hook makes the directory
        ("acme.hooks.setup", False, True),  # another: it must call kineto_setup() itself
    ],
)
def test_kineto_env_never_replaces_the_job_s_own_setup_hook(
    short, monkeypatch, caplog, job_hook, named, warned
):
    # (the real job's runtime_env: tests/test_kineto_ray.py; here the reader is injected)
    assert ipc.job_setup_hook() is None  # (no Ray initialized in this process)
    monkeypatch.setattr(ipc, "job_setup_hook", lambda: job_hook)
    with caplog.at_level("WARNING", logger=ipc.__name__):
        env = ipc.kineto_env(os.path.join(short, "k"))
    assert (ipc.RAY_SETUP_HOOK_ENV in env) is named
    said = [r.getMessage() for r in caplog.records if r.name == ipc.__name__]
    assert len(said) == int(warned), said
    if warned:
        assert "acme.hooks.setup" in said[0] and "kineto_setup()" in said[0], said
    assert env["KINETO_USE_DAEMON"] == "1" and os.path.isdir(env["KINETO_IPC_SOCKET_DIR"])


def test_the_default_directory_is_checked_from_the_user_s_node_directory_down(short, monkeypatch):
    root = os.path.join(short, "node")
    monkeypatch.setenv("RAY_PROFILER_NODE_DIR", root)
    monkeypatch.delenv(ipc.DIR_ENV, raising=False)
    d = ipc.kineto_dir()
    assert d == os.path.join(root, "kineto")
    os.mkdir(root)
    os.chmod(root, 0o777)  # made first, open to all: whoever can write it can swap kineto/
    with pytest.raises(PermissionError, match=f"{root} has mode 0777, open to others"):
        ipc.kineto_env()
    assert not os.path.exists(d)
    os.chmod(root, 0o700)
    assert ipc.kineto_env()["KINETO_IPC_SOCKET_DIR"] == d
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_directory_of_another_user_is_refused(short, monkeypatch):
    nobody = 65534
    theirs = os.path.join(short, "theirs")
    os.mkdir(theirs, 0o700)
    os.chown(theirs, nobody, nobody)
    with pytest.raises(PermissionError, match=f"belongs to uid {nobody}"):
        ipc.prepare_dir(theirs)
    root = os.path.join(short, "node")
    os.mkdir(root, 0o700)
    os.chown(root, nobody, nobody)  # the user's node directory, made by another user
    monkeypatch.setenv("RAY_PROFILER_NODE_DIR", root)
    monkeypatch.delenv(ipc.DIR_ENV, raising=False)
    with pytest.raises(PermissionError, match=f"belongs to uid {nobody}"):
        ipc.prepare_dir(ipc.kineto_dir())


def test_a_process_whose_directory_is_refused_turns_libkineto_s_daemon_mode_off(short):
    d = os.path.join(short, "k")
    env = {"KINETO_USE_DAEMON": "1", "KINETO_IPC_SOCKET_DIR": d,
           "KINETO_CONFIG": os.path.join(d, "client.conf"), ipc.DIR_ENV: d}  # fmt: skip
    assert ipc.prepare_process(env) is None  # made, private
    assert env["KINETO_USE_DAEMON"] == "1" and os.path.isdir(env["KINETO_IPC_SOCKET_DIR"])
    os.chmod(d, 0o777)
    why = ipc.prepare_process(env)
    assert why is not None and "open to others" in why
    # nothing left for libkineto pointing into the refused directory (KINETO_CONFIG is the
    # base config it reads when it starts), the reason kept for the rank to say
    assert env == {ipc.DIR_ENV: d, ipc.PROBLEM_ENV: why}
    assert ipc.prepare_process({}) is None  # (not a kineto process: nothing to do)


def test_the_daemon_never_answers_a_first_request_and_hands_a_config_once(kdir):
    daemon, client = Daemon(kdir), Client(kdir)
    try:
        ipc.post_config(kdir, 4242, "PROFILE_START_ITERATION=5\n")
        client.ask(4242)
        daemon.serve_once()
        assert client.answer() is None  # a new client's first request: no reply at all
        client.ask(4242)
        daemon.serve_once()
        assert client.answer() == "PROFILE_START_ITERATION=5\n"
        assert os.path.exists(ipc.request_path(kdir, 4242, "sent"))
        assert not os.path.exists(ipc.request_path(kdir, 4242))
        client.ask(4242)
        daemon.serve_once()
        assert client.answer() == ""  # nothing more to do
        client.ask(777)  # another process behind the same client address: nothing for it
        daemon.serve_once()
        assert client.answer() == ""
    finally:
        client.close()
        daemon.close()


def test_a_request_that_waited_too_long_gets_no_reply_and_its_config_waits(kdir):
    daemon, client = Daemon(kdir), Client(kdir)
    try:
        client.ask(1)
        daemon.serve_once()  # (the first request)
        ipc.post_config(kdir, 1, "X=1\n")
        client.ask(1)
        time.sleep(0.15)  # the client stopped waiting after about 90 ms
        daemon.serve_once()
        assert client.answer() is None
        assert os.path.exists(ipc.request_path(kdir, 1))  # still queued
        client.ask(1)
        daemon.serve_once()
        assert client.answer() == "X=1\n"
    finally:
        client.close()
        daemon.close()


def test_garbage_and_registrations_are_handled(kdir):
    daemon, client = Daemon(kdir), Client(kdir)
    try:
        client.sock.sendto(b"garbage", client.daemon)
        daemon.serve_once()
        client.sock.sendto(ipc.encode("ctxt", struct.pack("=iiq", 0, 5, 0)), client.daemon)
        daemon.serve_once()
        msg = ipc.decode(client.sock.recv(100))
        assert msg.kind == "ctxt" and struct.unpack("=i", msg.body) == (1,)
    finally:
        client.close()
        daemon.close()


def _request(kdir: str, tmp_path, pid: int) -> KinetoRequest:
    d = kdir
    return KinetoRequest(
        pid=pid,
        config=ipc.config_text({"ACTIVITIES_LOG_FILE": str(tmp_path / ".kineto.0.rank3.json")}),
        log_file=str(tmp_path / ".kineto.0.rank3.json"),
        directory=d,
        metadata='"distributedInfo": {"rank": 3}, "rank": 3',
        timeout_s=5,
    )


def test_the_agent_writes_the_trace_with_its_metadata_once_libkineto_renamed_it(tmp_path, kdir):
    req = _request(kdir, tmp_path, os.getpid())
    out = written_path(req.log_file, req.pid)
    assert out.endswith(f".kineto.0.rank3_{os.getpid()}.json")
    ticks = []

    def sleep(_s: float) -> None:
        ticks.append(1)
        if len(ticks) == 3:
            with open(out, "w") as f:
                json.dump({"schemaVersion": 1, "traceEvents": [{"ph": "X", "name": "a"}]}, f)

    raw = str(tmp_path / "rank3.pt.trace.json")
    assert await_trace(req, raw, sleep=sleep, serve=len) is None
    with open(raw) as f:
        doc = json.load(f)
    assert doc["rank"] == 3 and doc["distributedInfo"] == {"rank": 3}
    assert doc["traceEvents"] == [{"ph": "X", "name": "a"}]
    assert not os.path.exists(out) and ipc.withdraw_config(req.directory, req.pid) is False


@pytest.mark.parametrize("plant", ["fifo", "link"])
def test_a_pipe_or_link_at_the_cancel_name_is_never_read(tmp_path, kdir, plant):
    """Another user's pipe (an open that would hang) or link at a window's cancel file: not
    read as the rank's reason, and the agent's poll goes on at once."""
    import threading

    from worker_ext.agent import kineto_traces

    req = _request(kdir, tmp_path, os.getpid())
    target = tmp_path / "elsewhere"
    target.write_text("a reason planted by another user")
    if plant == "fifo":
        os.mkfifo(cancel_path(req.log_file))
    else:
        os.symlink(target, cancel_path(req.log_file))
    got: list = []
    t = threading.Thread(
        target=lambda: got.append(kineto_traces._why_not_yet(req, False)), daemon=True
    )
    t.start()
    t.join(10.0)
    assert not t.is_alive() and got, "the poll hung on the planted file"
    assert got[0] is None or "planted" not in got[0], got


def test_a_trace_that_will_not_come_says_why_and_leaves_nothing(tmp_path, kdir):
    req = _request(kdir, tmp_path, os.getpid())
    tmp = written_path(req.log_file, req.pid) + ".tmp"
    open(tmp, "w").close()  # libkineto's, left by a cancelled session
    with open(cancel_path(req.log_file), "w") as f:
        f.write("a torch.profiler of the process's own started")
    why = await_trace(req, str(tmp_path / "raw.json"), sleep=lambda s: None, serve=len)
    assert why is not None and why["where"] == "summary"
    assert "kineto: a torch.profiler of the process's own started" in why["message"]
    assert not os.path.exists(tmp) and not os.path.exists(cancel_path(req.log_file))
    assert not os.path.exists(ipc.request_path(req.directory, req.pid))  # withdrawn

    gone = _request(kdir, tmp_path, 2**22 + 12345)  # no such process
    why = await_trace(gone, str(tmp_path / "raw.json"), sleep=lambda s: None, serve=len)
    assert why is not None and "exited before libkineto wrote the trace" in why["message"]
    assert "config never sent" in why["message"]

    clock = iter(range(0, 100, 10))
    late = _request(kdir, tmp_path, os.getpid())
    why = await_trace(
        late, str(tmp_path / "raw.json"), clock=lambda: next(clock), sleep=id, serve=len
    )
    assert why is not None and "no trace from libkineto within 5 s" in why["message"]


def _summary(steps: list[int]) -> bytes:
    return encode_summary(
        RankSummary(
            rank=0,
            window=2,
            steps=(8, 10),
            partial=False,
            device="cpu",
            kernels=[KernelRow("aten::mm", 5.0, 1, 0)],
            step_us=[(s, 10.0) for s in steps],
        )
    )


def test_the_recorded_steps_are_the_markers_in_the_trace():
    blob = _summary([8, 9, 10])
    assert settle_steps(blob, (8, 10)) == (blob, None)
    fixed, why = settle_steps(_summary([10]), (8, 10))
    s = decode_summary(fixed)
    assert s.steps == (10, 10) and s.partial
    assert why is not None and why["where"] == "kineto"
    assert "recorded steps 10-10 of the planned 8-10" in why["message"]
    assert "after the window's first step" in why["message"]
    none, why = settle_steps(_summary([]), (8, 10))
    assert why is not None and "no step of the planned 8-10" in why["message"]
    assert decode_summary(none).partial


def test_a_gpu_rank_s_config_asks_for_cuda_activities(tmp_path):
    from coordinator.core.config import ProfilerConfig
    from worker_ext.rank.kineto_rank import window_options

    cfg = ProfilerConfig.from_dict(
        {
            "enable": True,
            "ranks": "all",
            "engine": "kineto",
            "save_path": str(tmp_path),
            "record_shapes": True,
        }  # fmt: skip
    )
    gpu = ipc.config_text(window_options(cfg, "cuda", "/r/x.json", 41, 12)).splitlines()
    cpu = ipc.config_text(window_options(cfg, "cpu", "/r/x.json", 41, 12)).splitlines()
    kinds = {line.split("=", 1)[0]: line.split("=", 1)[1] for line in gpu}
    assert {"kernel", "cuda_runtime", "gpu_memcpy", "cpu_op"} <= set(
        kinds["ACTIVITY_TYPES"].split(",")
    )
    assert kinds["PROFILE_START_ITERATION"] == "41" and kinds["ACTIVITIES_ITERATIONS"] == "12"
    assert kinds["PROFILE_REPORT_INPUT_SHAPES"] == "true"
    cpu_kinds = dict(line.split("=", 1) for line in cpu)["ACTIVITY_TYPES"].split(",")
    assert "kernel" not in cpu_kinds and "cpu_op" in cpu_kinds


def _socket_file(directory: str, name: str) -> str:
    """A client's socket file left behind: bound, then the client gone (libkineto never
    removes its own)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = os.path.join(directory, name)
    s.bind(path)
    s.close()
    return path


def test_the_daemon_sweeps_left_sockets_on_its_clock_while_clients_keep_polling(kdir):
    daemon, client = Daemon(kdir, sweep_s=1.0), Client(kdir, "dynoconfigclient-live")
    left = _socket_file(kdir, "dynoconfigclient-gone")
    other = _socket_file(kdir, "not-a-client")
    try:
        start = time.monotonic()
        while os.path.exists(left) and time.monotonic() - start < 10:
            client.ask(1)  # never half a second of silence
            daemon.serve_once()
            client.answer()
        assert not os.path.exists(left), "a daemon polled without a pause never swept"
        assert os.path.exists(client.addr) and os.path.exists(other)  # heard from; not a client
    finally:
        client.close()
        daemon.close()


def test_the_sweep_never_removes_a_live_client_s_socket_however_long_it_stays_silent(kdir):
    daemon = Daemon(kdir, sweep_s=0.2)
    silent = Client(kdir, "dynoconfigclient-silent")  # bound; never asks (stopped for minutes,
    gone = _socket_file(kdir, "dynoconfigclient-gone")  # or torch imported just before a sweep)
    old = time.time() - 3600
    for path in (silent.addr, gone):
        os.utime(path, (old, old))  # both far older than the sweep period
    try:
        start = time.monotonic()
        while os.path.exists(gone) and time.monotonic() - start < 10:
            daemon.serve_once()  # (each waits 0.5 s for a datagram: a sweep each time)
        assert not os.path.exists(gone), "a socket file no process binds was never swept"
        for _ in range(3):
            daemon.serve_once()
        assert os.path.exists(silent.addr), "a live client's socket was swept"
        for _ in range(2):  # it still gets its replies (the first request is never answered)
            silent.ask(1)
            daemon.serve_once()
        assert silent.answer() == ""
    finally:
        silent.close()
        daemon.close()


@pytest.mark.subprocess
def test_the_sweep_removes_the_queued_files_of_processes_that_are_gone_only(kdir):
    # A config posted ahead by a process whose loop then ended (or that died) is never sent
    # to a later process given the same pid.
    gone = subprocess.Popen(["true"])
    gone.wait()
    daemon = Daemon(kdir, sweep_s=0.2)
    try:
        for pid in (gone.pid, os.getpid()):
            ipc.post_config(kdir, pid, "X=1\n")
            write_atomic(ipc.request_path(kdir, pid, "sent"), b"Y=1\n")
        start = time.monotonic()
        while os.path.exists(ipc.request_path(kdir, gone.pid)) and time.monotonic() - start < 10:
            daemon.serve_once()  # (each waits 0.5 s for a datagram: a sweep each time)
        left = sorted(os.listdir(os.path.join(kdir, "requests")))
        assert left == [f"{os.getpid()}.conf", f"{os.getpid()}.sent"], left
    finally:
        daemon.close()


def test_a_reply_that_went_out_late_makes_the_daemon_skip_the_next_request(kdir, monkeypatch):
    from worker_ext.agent import kineto_daemon

    daemon, client = Daemon(kdir), Client(kdir)
    try:
        client.ask(1)
        daemon.serve_once()  # (the first request)
        ipc.post_config(kdir, 1, "X=1\n")

        def slow_reply(config: str) -> bytes:  # the fault: the daemon stalls before sending
            time.sleep(kineto_daemon.LATE_S + 0.03)
            return ipc.reply(config)

        monkeypatch.setattr(kineto_daemon, "reply", slow_reply)
        client.ask(1)
        daemon.serve_once()
        assert client.answer() == "X=1\n"  # sent, but late: the client may have stopped waiting
        monkeypatch.setattr(kineto_daemon, "reply", ipc.reply)
        client.ask(1)
        daemon.serve_once()
        assert client.answer() is None  # skipped: a late reply would be read in its place
        client.ask(1)
        daemon.serve_once()
        assert client.answer() == ""
    finally:
        client.close()
        daemon.close()


def test_a_registered_gpu_client_s_first_request_is_answered(kdir):
    daemon, client = Daemon(kdir), Client(kdir)
    try:
        client.sock.sendto(ipc.encode("ctxt", struct.pack("=iiq", 0, 5, 0)), client.daemon)
        daemon.serve_once()
        msg = ipc.decode(client.sock.recv(100))
        assert msg.kind == "ctxt" and struct.unpack("=i", msg.body) == (1,)
        ipc.post_config(kdir, 5, "Y=2\n")
        client.ask(5)  # its first request: the registration was its first message
        daemon.serve_once()
        assert client.answer() == "Y=2\n"
    finally:
        client.close()
        daemon.close()


@pytest.mark.subprocess
def test_ensure_daemon_serves_once_per_directory_and_stop_daemons_leaves_nothing(kdir):
    from worker_ext.agent.kineto_daemon import ensure_daemon, stop_daemons

    pid = ensure_daemon(kdir)
    client = Client(kdir)
    try:
        assert ensure_daemon(kdir) == pid  # running: the same one
        ipc.post_config(kdir, 7, "Z=3\n")
        got, deadline = None, time.monotonic() + 60
        while got != "Z=3\n" and time.monotonic() < deadline:
            with contextlib.suppress(OSError):  # (until it has bound its socket)
                client.ask(7)
            got = client.answer()
        assert got == "Z=3\n"
        assert os.path.exists(os.path.join(kdir, "daemon.lock"))
    finally:
        client.close()
        os.unlink(client.addr)
        stop_daemons()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    left = sorted(os.listdir(kdir))
    assert left == ["client.conf", "requests"], left  # its socket and the lock file: removed
    assert os.listdir(os.path.join(kdir, "requests")) == ["7.sent"]  # (the agent's to remove)
    assert ensure_daemon(kdir) != pid  # stopped: a new one
    stop_daemons()


def test_the_agent_removes_what_was_sent_and_forgets_the_process_s_lock(tmp_path, kdir):
    from worker_ext.agent import kineto_traces

    req = _request(kdir, tmp_path, os.getpid())
    sent = ipc.request_path(kdir, req.pid, "sent")

    def sleep(_s: float) -> None:  # the daemon sends the config, libkineto writes the trace
        if os.path.exists(req.log_file + ".done"):
            return
        open(req.log_file + ".done", "w").close()
        with open(sent, "w") as f:
            f.write(req.config)
        with open(written_path(req.log_file, req.pid), "w") as f:
            f.write('{"traceEvents": []}')

    assert await_trace(req, str(tmp_path / "raw.json"), sleep=sleep, serve=len) is None
    assert os.listdir(os.path.join(kdir, "requests")) == []
    assert req.pid not in kineto_traces._LOCKS


def test_a_window_s_config_is_taken_only_by_its_own_sent_file(kdir):
    first = ipc.config_text({"ACTIVITIES_LOG_FILE": "/r/.kineto.0.rank0.json", "A": 1})
    with open(ipc.request_path(kdir, 9, "sent"), "w") as f:
        f.write(first)
    assert ipc.config_taken(kdir, 9, "/r/.kineto.0.rank0.json")
    assert not ipc.config_taken(kdir, 9, "/r/.kineto.1.rank0.json")  # the window before's
    assert not ipc.config_taken(kdir, 10, "/r/.kineto.0.rank0.json")


def test_a_busy_client_gets_no_config_until_it_says_it_can_take_one(kdir):
    """libkineto drops a config that comes while it records or writes ("profiler busy"): a
    request without the ACTIVITIES bit leaves it queued, for the first request with it."""
    daemon, client = Daemon(kdir), Client(kdir)
    try:
        client.ask(5)
        daemon.serve_once()  # (the first request)
        ipc.post_config(kdir, 5, "Y=2\n")
        client.ask(5, types=1)  # recording or writing: events only
        daemon.serve_once()
        assert client.answer() == ""
        assert os.path.exists(ipc.request_path(kdir, 5))  # still queued, not claimed
        client.ask(5, types=ipc.ACTIVITIES)
        daemon.serve_once()
        assert client.answer() == "Y=2\n"
        assert not os.path.exists(ipc.request_path(kdir, 5))
    finally:
        client.close()
        daemon.close()


def test_a_config_is_either_taken_back_by_the_rank_or_sent_never_both(kdir):
    log0, log1 = "/r/.kineto.0.rank0.json", "/r/.kineto.ahead.rank0.9-9.json"
    daemon, client = Daemon(kdir), Client(kdir)
    try:
        client.ask(6)
        daemon.serve_once()
        ipc.post_config(kdir, 6, ipc.config_text({"ACTIVITIES_LOG_FILE": log0}))
        assert not ipc.take_back(kdir, 6, log1)  # another window's: left queued
        assert ipc.take_back(kdir, 6, log0)  # taken back: never sent
        client.ask(6)
        daemon.serve_once()
        assert client.answer() == "" and not ipc.config_taken(kdir, 6, log0)
        ipc.post_config(kdir, 6, ipc.config_text({"ACTIVITIES_LOG_FILE": log0}))
        client.ask(6)
        daemon.serve_once()
        assert log0 in (client.answer() or "")
        assert not ipc.take_back(kdir, 6, log0) and ipc.config_taken(kdir, 6, log0)
        # the agent, done with window 0, leaves the next window's config (posted ahead) queued
        ipc.post_config(kdir, 6, ipc.config_text({"ACTIVITIES_LOG_FILE": log1}))
        assert ipc.withdraw_config(kdir, 6, log0) is False
        assert not ipc.config_taken(kdir, 6, log0) and ipc.take_back(kdir, 6, log1)
    finally:
        client.close()
        daemon.close()


def test_the_agent_says_at_once_that_libkineto_dropped_a_sent_config(tmp_path, kdir):
    """The config was sent, the window ended (its iterations counted past its end), and the
    process then polled saying it could take a config: libkineto is not recording it."""
    req = _request(kdir, tmp_path, os.getpid())
    daemon, client = Daemon(kdir), Client(kdir)
    try:
        client.ask(req.pid)
        daemon.serve_once()
        ipc.post_config(kdir, req.pid, req.config)
        client.ask(req.pid)
        daemon.serve_once()
        assert client.answer() == req.config  # sent
        open(ended_path(req.log_file), "w").close()
        ended = time.time() - 1.0
        os.utime(ended_path(req.log_file), (ended, ended))
        client.ask(req.pid)  # free again, and no trace
        daemon.serve_once()
        assert client.answer() == ""
        t0 = time.monotonic()
        why = await_trace(req, str(tmp_path / "raw.json"), serve=len)
        assert time.monotonic() - t0 < 2, why
        assert why is not None and "libkineto dropped the window's config" in why["message"]
        assert os.listdir(os.path.join(kdir, "requests")) == []
        assert not os.path.exists(ended_path(req.log_file))
    finally:
        client.close()
        daemon.close()
