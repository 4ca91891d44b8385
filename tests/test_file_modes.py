"""Files the profiler writes are this user's alone (0600) unless the user asks otherwise
(``RAY_PROFILER_FILE_MODE``): issue 53, Deliver 2. A real rank's trace (raw, and compressed
by the agent's trace job), libkineto's trace with our metadata, a stall dump and ``collect``'s
copy, each written under a umask that would have made it 0644; the variable's mode where it
is set (read by the process that writes); a bad value a clear error and no file."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from coordinator.ops.collect import _writer
from coordinator.protocol.atomic_file import DEFAULT_MODE, FILE_MODE_ENV, file_mode, write_atomic
from coordinator.service.stall_watchdog import _dump
from tests.configs import ROOT
from worker_ext.agent.kineto_traces import _with_metadata


@pytest.fixture(autouse=True)
def _umask_022():
    old = os.umask(0o022)  # (the usual umask: ``open`` would make these files 0644)
    yield
    os.umask(old)


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _stall(path: str) -> None:
    _dump(path, {"index": 0, "trainer_id": "t", "detected_at": 1.0}, None)  # type: ignore[typeddict-item]


def _kineto(path: str) -> None:
    src = path + ".libkineto"
    with open(src, "w") as f:
        f.write('{"traceEvents": []}')
    _with_metadata(src, path, '"rank": 0')


def _collected(path: str) -> None:
    with _writer(path, {}) as f:
        f.write(b"{}")


WRITERS = {"stall dump": _stall, "kineto trace": _kineto, "collect": _collected}


@pytest.mark.parametrize("asked", [None, "640", "0o644"])
@pytest.mark.parametrize("writer", WRITERS)
def test_the_profiler_s_files_are_0600_unless_the_user_asks(tmp_path, monkeypatch, writer, asked):
    if asked is None:
        monkeypatch.delenv(FILE_MODE_ENV, raising=False)
    else:
        monkeypatch.setenv(FILE_MODE_ENV, asked)
    path = str(tmp_path / "out" / "file.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    WRITERS[writer](path)
    want = DEFAULT_MODE if asked is None else int(asked.removeprefix("0o"), 8)
    assert _mode(path) == want and DEFAULT_MODE == 0o600


@pytest.mark.parametrize("bad", ["rw-r--r--", "999", "0x1a4", "400", "0o1777", "-600"])
def test_a_mode_the_user_gives_that_is_no_mode_is_a_clear_error_and_no_file(
    tmp_path, monkeypatch, bad
):
    monkeypatch.setenv(FILE_MODE_ENV, bad)
    with pytest.raises(ValueError, match=f"{FILE_MODE_ENV}=.*not a file mode.*600"):
        file_mode()
    with pytest.raises(ValueError, match=FILE_MODE_ENV):
        write_atomic(str(tmp_path / "trace.json"), b"{}")
    assert os.listdir(tmp_path) == []  # (no temporary file left either)
    write_atomic(str(tmp_path / "board"), b"b", mode=0o600)  # a mode named: the caller's
    assert _mode(str(tmp_path / "board")) == 0o600


RANK = """
import os, sys
sys.path.insert(0, {root!r})
os.umask(0o022)
from tests.test_rank_profiler import cfg_for
from tests.torch_helpers import TinyMLP, run_profiled
cfg = cfg_for({tmp!r}, export_type={export!r}, wait=0, ranks="all")
rp, _ = run_profiled(cfg, steps=4, rank=0, model=TinyMLP())
print(rp.status()["last_trace_path"])
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("asked", [None, "640"])
@pytest.mark.parametrize("export", ["chrome_trace", "chrome_trace_gz"])
def test_a_real_rank_s_trace_is_0600_unless_the_user_asks(tmp_path, export, asked):
    """A real rank (a tiny model trained under the schedule, in a fresh process with the
    variable in its environment or not), its trace exported by torch (``export_trace``, which
    writes a file of its own by name) and, for ``chrome_trace_gz``, compressed by the agent's
    trace job (``trace_jobs``) in the rank's spawned agent, which inherits the variable."""
    env = {k: v for k, v in os.environ.items() if k != FILE_MODE_ENV}
    if asked is not None:
        env[FILE_MODE_ENV] = asked
    code = RANK.format(root=ROOT, tmp=str(tmp_path), export=export)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    path = out.stdout.split()[-1]
    assert path.endswith(".pt.trace.json.gz" if export.endswith("gz") else ".pt.trace.json")
    assert _mode(path) == (0o600 if asked is None else 0o640), oct(_mode(path))
