"""Issue 53, finding 2, as two real users of one node (``tests/two_users.py``): another user
takes the old shared folders first (``<tmp>/ray-profiler-stacks/memory`` made 0777, links at the
victim's pid names to the victim's own 0600 file, a forged OOM note), or the victim's own
directory; the victim's rank and agent (our real code, in the victim's real processes) write
nothing through a link, trust no forged note, and say why when their directory is taken; a
second user of the node gets their own directory and loses nothing."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest

from tests.two_users import Node, two_users

pytestmark = pytest.mark.subprocess

# A rank and its node agent, in one process of the user's (the agent's reads are the same
# calls a separate agent makes): a snapshot note, the demand pipe asked through, the stack
# dump, a plan board written and read back. Prints what it saw, as JSON.
WORKFLOW = """
import json, os, sys, time
from pathlib import Path
tmp = Path(os.environ["TMPDIR"])
if os.environ.get("WAIT_FOR"):  # (the other user plants its links once it knows our pid)
    (tmp / "victim.pid").write_text(str(os.getpid()))
    deadline = time.monotonic() + 60
    while not (tmp / os.environ["WAIT_FOR"]).exists():
        assert time.monotonic() < deadline, "nothing was planted"
        time.sleep(0.02)
from coordinator.protocol import plan_board
from worker_ext.agent import memory_sampler as ms
from worker_ext.rank import memory_snapshot, stack_dump
out = {"pid": os.getpid()}
out["noted"] = ms.note_snapshot("oom", "/mine.memory.pickle", None)
out["pipe"] = memory_snapshot._open_demand_pipe()
out["asked"] = ms.ask_for_snapshot(os.getpid(), "/nowhere/x.memory.pickle")
out["dump"] = stack_dump.enable_stack_dump(cuda=False)
try:
    bid = plan_board.board_id("ns", "profiler", "run", "sft")
    plan_board.write_private(plan_board.board_path(bid), b"board")
    out["board"] = plan_board.read_capped(plan_board.board_path(bid)).decode()
except OSError as exc:
    out["board"] = f"refused: {exc}"
sampler = ms.MemorySampler("node")
watch = {"targets": [{"pid": os.getpid()}], "sample_s": 1.0}
notes, deadline = [], time.monotonic() + 30
while len(notes) < 2 and out["asked"] is None and time.monotonic() < deadline:
    notes += sampler.watch(watch)["snapshots"]  # (the demand's note comes from the pipe's thread)
    time.sleep(0.05)
notes += sampler.watch(watch)["snapshots"]
sampler.close()
out["notes"] = [(n["on"], n["path"], n["pid"]) for n in notes]
print(json.dumps(out))
"""


def _run(node: Node, user, **env: str) -> dict:
    got = node.run(user, WORKFLOW, env=env, timeout=180)
    out = json.loads(got.stdout.strip().splitlines()[-1])
    out["notes"] = [tuple(n) for n in out["notes"]]
    return out


def _secret(node: Node) -> Path:
    """The victim's own 0600 file, which the other user names but cannot read."""
    secret = node.victim.home / "secret"
    secret.write_text("the victim's own\n")
    os.chown(secret, node.victim.uid, node.victim.gid)
    secret.chmod(0o600)
    return secret


PLANT = """
import os, json
from pathlib import Path
tmp, secret = Path(os.environ["TMPDIR"]), os.environ["SECRET"]
pid = (tmp / "victim.pid").read_text()
old = tmp / "ray-profiler-stacks"
(old / "memory").mkdir(parents=True)
for d in (old, old / "memory"):
    d.chmod(0o777)
for name in (f"memory/{pid}.mem", f"{pid}.txt", f"{pid}.fr"):
    (old / name).symlink_to(secret)
note = {"on": "oom", "path": "/forged.memory.pickle", "error": None, "at": 1.0}
(old / f"memory/{pid}.snapshots.jsonl").write_text(json.dumps(note) + "\\n")
plans = tmp / f"ray-profiler-plans-{os.environ['VICTIM_UID']}"
plans.mkdir()
plans.chmod(0o777)
staging = tmp / "ray-profiler-staging"
staging.mkdir()
staging.chmod(0o777)
(tmp / "planted").touch()
"""


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every entry under ``root``: (owner, mode)."""
    out = {}
    for path in [root, *root.rglob("*")]:
        st = os.lstat(path)
        out[str(path.relative_to(root.parent))] = (st.st_uid, stat.S_IMODE(st.st_mode))
    return out


def test_links_and_a_forged_note_in_the_old_shared_folder_reach_nothing_of_the_victim_s():
    with two_users() as node:
        secret = _secret(node)
        victim: dict = {}

        def run_victim() -> None:
            victim.update(_run(node, node.victim, WAIT_FOR="planted"))

        worker = threading.Thread(target=run_victim)
        worker.start()
        try:
            node.run(
                node.other,
                "import os, time\nfrom pathlib import Path\n"
                "p = Path(os.environ['TMPDIR']) / 'victim.pid'\nt = time.monotonic()\n"
                "while not p.exists() and time.monotonic() - t < 60: time.sleep(0.02)\n" + PLANT,
                env={"SECRET": str(secret), "VICTIM_UID": str(node.victim.uid)},
            )
        finally:
            worker.join(240)
        assert victim, "the victim's run did not finish"
        pid = victim["pid"]
        assert secret.read_text() == "the victim's own\n"  # nothing written through a link
        assert victim["noted"] is None and victim["pipe"] is None and victim["asked"] is None
        assert victim["board"] == "board"
        assert ("oom", "/mine.memory.pickle", pid) in victim["notes"]
        assert ("demand", "/nowhere/x.memory.pickle", pid) in victim["notes"]  # (its failure)
        assert all(n[1] != "/forged.memory.pickle" for n in victim["notes"])  # never trusted
        root = node.tmp / f"ray-profiler-{node.victim.uid}"
        assert victim["dump"]["path"] == str(root / "stacks" / f"{pid}.txt")
        tree = _tree(root)
        assert {uid for uid, _ in tree.values()} == {node.victim.uid}
        assert all(mode & 0o077 == 0 for _, mode in tree.values())
        assert tree[f"ray-profiler-{node.victim.uid}/memory/{pid}.snapshots.jsonl"][1] == 0o600


def test_a_directory_taken_by_another_user_is_refused_and_said_never_written():
    with two_users() as node:
        taken = node.tmp / f"ray-profiler-{node.victim.uid}"
        node.run(
            node.other, f"import os; os.mkdir({str(taken)!r}); os.chmod({str(taken)!r}, 0o777)"
        )
        got = _run(node, node.victim)
        why = f"belongs to uid {node.other.uid}, not this user's ({node.victim.uid})"
        assert why in got["noted"] and "the memory folder" in got["noted"]
        assert why in got["pipe"] and why in got["board"]
        assert got["asked"].startswith("the memory folder cannot be had") and why in got["asked"]
        assert "not a CUDA rank" not in got["asked"]
        assert why in got["dump"]["note"] and got["dump"]["path"] is None
        assert got["notes"] == []
        assert list(taken.iterdir()) == []  # nothing of the victim's written there
        # The way out the refusal names: a directory of the victim's own.
        own = node.victim.home / "profiler"
        moved = _run(node, node.victim, RAY_PROFILER_NODE_DIR=str(own))
        assert moved["noted"] is None and moved["asked"] is None and moved["board"] == "board"


def test_a_second_user_of_the_node_gets_their_own_directory_and_loses_nothing():
    with two_users() as node:
        first = _run(node, node.other)  # the first user on the node makes its directory
        second = _run(node, node.victim)
        for user, got in ((node.other, first), (node.victim, second)):
            assert got["noted"] is None and got["pipe"] is None and got["asked"] is None, got
            assert got["board"] == "board"
            mine = {n for n in got["notes"] if n[2] == got["pid"]}
            assert ("oom", "/mine.memory.pickle", got["pid"]) in mine
            assert ("demand", "/nowhere/x.memory.pickle", got["pid"]) in mine
            root = node.tmp / f"ray-profiler-{user.uid}"
            assert {uid for uid, _ in _tree(root).values()} == {user.uid}
            assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700
