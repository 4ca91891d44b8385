"""Kineto on a node shared with another user, as two real users (``tests/two_users.py``): the
daemon directory is refused when another user made a folder above it, and a rank whose
directory is refused never asks the other user's daemon; the attach hook turns libkineto on only
where its config reader says ``enable: true`` and ``engine: kineto``."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.two_users import two_users

pytestmark = pytest.mark.subprocess

# The other user's daemon: our own class, bound in the directory it swapped in, open to all,
# counting the datagrams it receives (any one would be a victim's request reaching it).
IMPOSTOR = """
import os, sys, time
d = sys.argv[1]
os.makedirs(os.path.join(d, "requests"))
for p in (os.path.dirname(d), d):
    os.chmod(p, 0o777)
with open(os.path.join(d, "client.conf"), "w") as f:
    f.write("ON_DEMAND_CONFIG_UPDATE_INTERVAL_SECS=1\\n")
count = os.path.join(os.path.dirname(d), "requests-seen")
if os.fork() == 0:  # the daemon, detached, serving on for 90 s
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    from worker_ext.agent.kineto_daemon import Daemon
    daemon = Daemon(d)
    os.chmod(daemon.path, 0o777)
    n, end = 0, time.time() + 90
    open(count, "w").write("0")
    while time.time() < end:
        try:
            daemon.sock.recvfrom(1 << 16)
        except TimeoutError:
            continue
        n += 1
        open(count, "w").write(str(n))
    os._exit(0)
while not os.path.exists(count):
    time.sleep(0.05)
"""

# The victim's rank on that node, started with the variables kineto_env() gave on the driver's
# node: Ray runs the setup hook they name, then the rank imports torch and lives three polls.
RANK = """
import os, time
from worker_ext.attach import kineto_setup
kineto_setup()
print("DAEMON", os.environ.get("KINETO_USE_DAEMON"))
print("PROBLEM", os.environ.get("RAY_PROFILER_KINETO_PROBLEM"))
import torch
time.sleep(3.5)
"""


def test_a_directory_under_another_user_s_folder_is_refused_and_its_daemon_never_asked():
    with two_users() as node:
        root = node.tmp / f"ray-profiler-{node.victim.uid}"
        kdir = root / "kineto"
        node.run(node.other, IMPOSTOR.replace("sys.argv[1]", repr(str(kdir)), 1))
        assert os.stat(root).st_uid == node.other.uid and (root / "kineto" / "dynolog").exists()

        refused = node.run(
            node.victim,
            "from worker_ext import kineto_env\n"
            "try:\n    kineto_env()\nexcept PermissionError as e:\n    print('REFUSED', e)\n",
        )
        assert f"REFUSED libkineto's daemon directory {root} belongs to uid {node.other.uid}" in (
            refused.stdout
        ), refused.stdout
        env = {"KINETO_USE_DAEMON": "1", "KINETO_IPC_SOCKET_DIR": str(kdir),
               "KINETO_CONFIG": str(kdir / "client.conf"),
               "RAY_PROFILER_KINETO_DIR": str(kdir)}  # fmt: skip
        rank = node.run(node.victim, RANK, env=env, timeout=300)
        assert "DAEMON None" in rank.stdout, rank.stdout
        assert f"belongs to uid {node.other.uid}" in rank.stdout, rank.stdout
        time.sleep(0.5)
        assert (root / "requests-seen").read_text() == "0"  # not one request reached it
        victim_files = [p for p in kdir.iterdir() if p.stat().st_uid == node.victim.uid]
        assert victim_files == []  # (libkineto bound no socket there)


def test_the_attach_hook_turns_libkineto_on_only_where_the_config_reader_says_kineto():
    probe = (
        "import os, sys, json\n"
        "import worker_ext.attach as a\n"
        "a.setup()\n"
        "print('ENV', json.dumps({k: v for k, v in os.environ.items() if 'KINETO' in k}))\n"
    )
    with two_users() as node:
        colon = node.tmp / "job:1.yaml"  # a file path the reader takes for YAML text
        colon.write_text("enable: true\nengine: kineto\n")
        colon.chmod(0o644)
        off = ["enable: false\nengine: kineto\n", "enable: true\nnotes:\n  engine: kineto\n",
               str(colon), "engine: kineto\n"]  # fmt: skip
        for config in off:
            got = node.run(node.victim, probe, env={"RAY_PROFILER_CONFIG": config})
            line = [x for x in got.stdout.splitlines() if x.startswith("ENV ")]
            assert line and json.loads(line[0][4:]) == {}, (config, got.stdout, got.stderr)
        assert sorted(p.name for p in node.tmp.iterdir()) == ["job:1.yaml"]  # nothing made
        on = node.run(node.victim, probe, env={"RAY_PROFILER_CONFIG": colon.read_text()})
        got = json.loads([x for x in on.stdout.splitlines() if x.startswith("ENV ")][0][4:])
        kdir = str(node.tmp / f"ray-profiler-{node.victim.uid}" / "kineto")
        assert got["KINETO_USE_DAEMON"] == "1" and got["KINETO_IPC_SOCKET_DIR"] == kdir, got
        assert os.stat(kdir).st_uid == node.victim.uid
