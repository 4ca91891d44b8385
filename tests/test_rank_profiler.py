import gzip
import json
import os

import pytest
import torch

from coordinator.core.config import ProfilerConfig
from coordinator.core.schedule import Schedule, Window
from coordinator.core.trace_layout import default_run_name, run_dir
from coordinator.protocol.summary_codec import decode_summary
from tests.torch_helpers import TinyMLP, run_profiled, summaries, window_dirs
from worker_ext.rank.rank_profiler import RankProfiler
from worker_ext.rank.torch_session import activities

pytestmark = pytest.mark.subprocess  # every test here starts another process


def cfg_for(tmp_path, **kw):
    base = {
        "enable": True,
        "save_path": str(tmp_path),
        "activities": ["cpu"],
        "export_type": "chrome_trace",
        "skip_first": 0,
        "wait": 1,
        "warmup": 1,
        "active": 2,
        "repeat": 1,
    }
    base.update(kw)
    return ProfilerConfig(**base)


def expected_dirs(cfg, steps):
    return [
        f"window_{w.index:04d}_steps_{w.first}-{w.last}"
        for w in Schedule(cfg).windows(limit=steps)
        if w.last < steps
    ]


@pytest.mark.parametrize(
    "kw,steps",
    [
        ({"repeat": 1}, 12),
        ({"repeat": 3}, 20),
        ({"repeat": 0}, 17),
        ({"skip_first": 5, "repeat": 2}, 20),
        ({"skip_first": 4, "wait": 6, "skip_first_wait": True, "repeat": 2}, 25),
    ],
    ids=["one_window", "repeat", "repeat_0", "skip_first", "skip_first_wait"],
)
def test_trace_files_follow_the_schedule(tmp_path, kw, steps):
    cfg = cfg_for(tmp_path, **kw)
    rp, statuses = run_profiled(cfg, steps)
    dirs = expected_dirs(cfg, steps)
    assert dirs and window_dirs(cfg) == dirs
    for d in dirs:
        assert os.listdir(tmp_path / "run" / d) == ["policy"]
        assert os.listdir(tmp_path / "run" / d / "policy") == ["rank0.pt.trace.json"]
    assert rp.status()["windows_captured"] == len(dirs)
    assert sorted(decode_summary(s).window for s in summaries(statuses)) == list(range(len(dirs)))


def test_stop_mid_window_writes_a_partial_window_named_by_its_real_last_step(tmp_path):
    cfg = cfg_for(tmp_path, wait=0, warmup=1, active=10)
    _, statuses = run_profiled(cfg, steps=5)  # warmup 0, records 1..4, stopped
    assert window_dirs(cfg) == ["window_0000_steps_1-4"]
    (s,) = [decode_summary(b) for b in summaries(statuses)]
    assert s.partial is True and s.steps == (1, 4)
    assert [st for st, _ in s.step_us] == [1, 2, 3, 4]
    closed = [st["closed"] for st in statuses if st["closed"]]
    assert closed[0]["partial"] is True and closed[0]["steps"] == [1, 4]


def test_stop_during_warmup_writes_nothing(tmp_path):
    cfg = cfg_for(tmp_path, wait=0, warmup=5, active=2)
    rp, statuses = run_profiled(cfg, steps=3)
    assert window_dirs(cfg) == [] and summaries(statuses) == []
    assert rp.status()["state"] == "ok" and rp.status()["windows_captured"] == 0


def test_stop_without_start_and_double_stop_are_noops(tmp_path):
    rp = RankProfiler(0, cfg_for(tmp_path), str(tmp_path / "run"))
    assert rp.stop_window()["state"] == "ok"
    rp.start_window(Window(0, 0, 1, 3), 0)
    TinyMLP().train_step()
    rp.step(0)
    TinyMLP().train_step()
    rp.step(1)
    first = rp.stop_window()
    second = rp.stop_window()
    assert first["closed"]["steps"] == [1, 1] and second["closed"] is None
    assert second["state"] == "ok"


def test_a_window_told_twice_is_recorded_once(tmp_path):
    """A command can reach a rank twice (its relay failed after delivering it, and the
    coordinator told it directly): the same start and the same steps change nothing."""
    rp = RankProfiler(0, cfg_for(tmp_path), str(tmp_path / "run"))
    w = Window(0, 0, 1, 2)
    rp.start_window(w, 0)
    closed = []
    for k in range(3):
        TinyMLP().train_step()
        if k == 0:
            rp.start_window(w, 0)  # the second time
        closed += [rp.step(k)["closed"], rp.step(k)["closed"]]
    assert [c["steps"] for c in closed if c] == [[1, 2]]
    assert os.listdir(tmp_path / "run") == ["window_0000_steps_1-2"]
    assert rp.status()["windows_captured"] == 1 and rp.status()["state"] == "ok"


def test_unselected_rank_creates_no_profiler(tmp_path, monkeypatch):
    made = []
    real = torch.profiler.profile

    def spy(*a, **kw):
        made.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(torch.profiler, "profile", spy)
    cfg = cfg_for(tmp_path, ranks=[0], wait=0)
    rp, statuses = run_profiled(cfg, steps=6, rank=1)
    assert made == [] and rp._prof is None
    assert {st["state"] for st in statuses} == {"not_selected"}
    assert window_dirs(cfg) == []


def test_save_path_resolution(tmp_path):
    assert run_dir(str(tmp_path), "exp1") == os.path.join(os.path.realpath(tmp_path), "exp1")
    assert default_run_name(0) == "run_19700101-000000"
    with pytest.raises(ValueError, match="escapes|single file name"):
        run_dir(str(tmp_path), "../x")
    os.symlink("/", tmp_path / "link")
    with pytest.raises(ValueError, match="escapes"):
        run_dir(str(tmp_path), "link")


def test_cuda_requested_without_gpu_records_cpu_and_says_so(tmp_path):
    rp = RankProfiler(0, cfg_for(tmp_path, activities=["cpu", "cuda"]), str(tmp_path / "r"))
    st = rp.status()
    if torch.cuda.is_available():
        assert st["device"] == "cuda" and st["note"] is None
    else:
        assert st["device"] == "cpu" and "no GPU" in st["note"]
    assert activities(rp.device) == [
        torch.profiler.ProfilerActivity.CPU,
        *([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []),
    ]


def load_trace(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


@pytest.mark.parametrize("export", ["chrome_trace", "chrome_trace_gz"])
def test_traces_carry_their_rank_and_real_ops(tmp_path, export):
    cfg = cfg_for(tmp_path, export_type=export, wait=0, ranks="all")
    rp, _ = run_profiled(cfg, steps=4, rank=3, model=TinyMLP())
    path = rp.status()["last_trace_path"]
    assert path.endswith(".pt.trace.json.gz" if export.endswith("gz") else ".pt.trace.json")
    assert os.path.basename(path) == "rank3" + os.path.basename(path)[5:]
    trace = load_trace(path)
    assert trace["rank"] == 3 == trace["distributedInfo"]["rank"]  # no process group: ours
    assert os.path.basename(os.path.dirname(path)) == "policy"
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::addmm" in names and "ProfilerStep#1" in names and "ProfilerStep#2" in names
    assert not [f for f in os.listdir(os.path.dirname(path)) if f.endswith((".tmp", ".part"))]


def test_summary_has_real_ops_step_times_and_top_k(tmp_path):
    cfg = cfg_for(tmp_path, wait=0, top_k=3, export_type="none")
    _, statuses = run_profiled(cfg, steps=4)
    (s,) = [decode_summary(b) for b in summaries(statuses)]
    assert window_dirs(cfg) == []  # export none: summary only
    assert s.device == "cpu" and s.unit == "us" and s.steps == (1, 2)
    assert len(s.kernels) == 3 and s.dropped_rows > 0 and s.dropped_us > 0
    assert [k.self_us for k in s.kernels] == sorted((k.self_us for k in s.kernels), reverse=True)
    assert not any(k.name.startswith("ProfilerStep") for k in s.kernels)
    assert [st for st, _ in s.step_us] == [1, 2] and all(us > 0 for _, us in s.step_us)

    cfg = cfg_for(tmp_path / "b", wait=0, top_k=500, export_type="none")
    _, statuses = run_profiled(cfg, steps=4)
    (s,) = [decode_summary(b) for b in summaries(statuses)]
    names = {k.name for k in s.kernels}
    assert {"aten::addmm", "aten::mm", "aten::relu"} <= names
    assert s.dropped_rows == 0


def test_flops_and_stack_rows_are_normalised(tmp_path):
    cfg = cfg_for(
        tmp_path,
        wait=0,
        top_k=1000,
        with_stack=True,
        with_flops=True,
        export_type="stacks",
    )
    rp, statuses = run_profiled(cfg, steps=4)
    (s,) = [decode_summary(b) for b in summaries(statuses)]
    assert not [k.name for k in s.kernels if "0x7" in k.name]
    assert any("0x?" in k.name for k in s.kernels)
    assert any(k.flops > 0 for k in s.kernels if k.name == "aten::addmm")
    stacks = rp.status()["last_trace_path"]
    assert stacks.endswith("rank0.stacks.txt")
    with open(stacks) as f:
        lines = f.read().splitlines()
    assert any(";" in line and "train_step" in line for line in lines)
    assert all(line.rsplit(" ", 1)[1].isdigit() for line in lines)


def test_the_summary_is_built_from_the_trace_in_another_process(tmp_path, monkeypatch):
    def never(self, *a, **kw):
        raise AssertionError("key_averages() must not run")

    monkeypatch.setattr(torch.profiler.profile, "key_averages", never)
    monkeypatch.setattr(torch.profiler.profile, "export_stacks", never)
    rp, statuses = run_profiled(cfg_for(tmp_path, wait=0, export_type="chrome_trace_gz"), steps=4)
    (s,) = [decode_summary(b) for b in summaries(statuses)]
    assert s.steps == (1, 2) and s.kernels
    agent = rp.status()["agent"]  # the node agent when this process is in Ray
    assert agent["kind"] in ("local_process", "node_agent")
    assert agent["pid"] is not None and agent["pid"] != os.getpid()
    assert rp.status()["last_agent_error"] is None


def test_export_none_summarises_a_temporary_trace_then_deletes_it(tmp_path):
    cfg = cfg_for(tmp_path, wait=0, export_type="none")
    _, statuses = run_profiled(cfg, steps=4)
    assert len(summaries(statuses)) == 1
    assert [p for p in (tmp_path / "run").rglob("*") if p.is_file()] == []


def test_export_none_keeps_two_roles_rank_0_apart_in_one_run_directory(tmp_path):
    """The policy's and the rollout's rank 0 close the same window at once in one directory:
    each writes its own temporary trace (one used to rename the other's away, disabling both)."""
    from worker_ext.rank.torch_session import TraceTarget, export_trace, trace_job

    cfg = cfg_for(tmp_path, wait=0, export_type="none")
    window = Window(index=0, warmup_start=0, first=0, last=0)
    jobs = []
    for role in ("policy", "rollout", "a/b"):
        with torch.profiler.profile(activities=activities(["cpu"])) as prof:
            TinyMLP().train_step()
        target = TraceTarget(0, "cpu", str(tmp_path / "run"), None, role)
        jobs.append(export_trace(prof, trace_job(cfg, target, window, (0, 0), False, None)))
    paths = [j.raw_path for j in jobs]
    assert len(set(paths)) == 3 and all(os.path.dirname(p) == str(tmp_path / "run") for p in paths)
    assert all(load_trace(p)["traceEvents"] for p in paths)


def test_a_script_without_a_main_guard_is_not_run_again_by_the_local_agent(tmp_path):
    """The local agent is a spawned child; it must not re-run the user's unguarded script."""
    import subprocess
    import sys

    marker = tmp_path / "runs.txt"
    script = tmp_path / "train.py"
    script.write_text(
        f"""
import os, sys
sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})
with open({str(marker)!r}, "a") as f:
    f.write("ran\\n")
from coordinator.core.config import ProfilerConfig
from coordinator.core.schedule import Window
from tests.torch_helpers import TinyMLP
from worker_ext.rank.rank_profiler import RankProfiler
cfg = ProfilerConfig(enable=True, save_path={str(tmp_path)!r}, ranks="all", activities=["cpu"])
rp = RankProfiler(0, cfg.validate(), {str(tmp_path / "run")!r})
rp.start_window(Window(0, 0, 1, 2), 0)
m = TinyMLP()
for k in range(3):
    m.train_step()
    rp.step(k)
st = rp.wait_for_summaries(60)
print(len(st["summaries"]), st["agent"]["kind"], st["last_agent_error"])
"""
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, check=True
    )
    assert out.stdout.split() == ["1", "local_process", "None"], out.stderr[-2000:]
    assert marker.read_text() == "ran\n"


def test_a_trace_without_torch_s_events_summarises_as_a_default_one(tmp_path):
    """trace_only changes what torch keeps in memory, not the trace: the same work profiled
    both ways gives the same ops, counts and flops (from the shapes' metadata)."""
    from worker_ext.agent.trace_summary import summarise_trace
    from worker_ext.rank.torch_session import window_profiler

    cfg = cfg_for(tmp_path, record_shapes=True, with_flops=True, top_k=1000)
    window = Window(index=0, warmup_start=0, first=1, last=3)
    tables = []
    action = torch.profiler.ProfilerAction
    for trace_only in (True, False):
        model = TinyMLP()
        if trace_only:
            prof = window_profiler(cfg, "cpu", 0, window, 0, lambda p: None)
        else:
            prof = torch.profiler.profile(
                activities=activities(["cpu"]),
                schedule=lambda n: action.WARMUP if n < 1 else action.RECORD,
                record_shapes=True,
                with_flops=True,
            )
        prof.start()
        for _ in range(4):
            model.train_step()
            prof.step()
        prof.stop()
        path = str(tmp_path / f"trace_only_{trace_only}.json")
        prof.export_chrome_trace(path)
        summary, _ = summarise_trace(
            path,
            rank=0,
            window=0,
            steps=(1, 3),
            partial=False,
            device="cpu",
            top_k=1000,
            flops=True,
        )
        tables.append({k.name: (k.count, k.flops) for k in summary.kernels})
    assert tables[0] == tables[1]
    assert tables[0]["aten::addmm"][0] == 3 * 2 and tables[0]["aten::addmm"][1] > 0  # 2 layers
