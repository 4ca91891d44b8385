"""Summaries from the trace file: key_averages() numbers on CPU traces; GPU-shaped traces."""

import gzip
import json
import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from coordinator.ops.cli import main as cli_main
from tests.torch_helpers import TinyMLP
from tests.trace_equality import differences, key_averages_table, trace_table
from worker_ext.agent import trace_reader
from worker_ext.agent.trace_reader import TraceError, read_trace
from worker_ext.agent.trace_summary import summarise_trace


class Nested(torch.nn.Module):
    """Nested modules and a custom autograd path: deep op trees, forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.GELU())
            for _ in range(3)
        )
        self.opt = torch.optim.AdamW(self.parameters(), lr=1e-3)

    def step(self) -> None:
        x = torch.randn(8, 32)
        for b in self.blocks:
            with torch.profiler.record_function("block"):
                x = x + b(x)
        loss = torch.bmm(x.view(2, 4, 32), x.view(2, 32, 4)).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()


def profiled_trace(tmp_path, steps=3, **kw):
    model = Nested()
    with profile(activities=[ProfilerActivity.CPU], **kw) as prof:
        for _ in range(steps):
            model.step()
            TinyMLP().train_step()
            prof.step()
    path = str(tmp_path / "trace.json")
    prof.export_chrome_trace(path)
    return prof, path


def test_cpu_self_times_and_counts_equal_key_averages(tmp_path):
    prof, path = profiled_trace(tmp_path, record_shapes=True, with_flops=True)
    expected = key_averages_table(prof)
    got = trace_table(path, flops=True)
    names = set(got)
    # nested ops, backward nodes and optimizer ops are all there
    assert {"aten::linear", "aten::addmm", "aten::bmm", "aten::layer_norm", "block"} <= names
    assert any(n.startswith("autograd::engine::evaluate_function: AddmmBackward0") for n in names)
    assert any(n.startswith("Optimizer.step#AdamW.step") for n in names)
    assert differences(expected, got, flops=True) == []
    assert got["aten::addmm"][2] > 0 and got["aten::bmm"][2] > 0


def test_with_stack_python_frames_sit_in_the_same_tree(tmp_path):
    prof, path = profiled_trace(tmp_path, with_stack=True)
    got = trace_table(path)
    assert any(".py(" in name for name in got)  # Python frames are rows too
    assert differences(key_averages_table(prof), got) == []


def test_chunked_reading_equals_whole_reading(tmp_path):
    _, path = profiled_trace(tmp_path, record_shapes=True)
    whole = read_trace(path, chunk_bytes=1 << 30)
    for chunk in (4096, 65536, 1_000_003):
        part = read_trace(path, chunk_bytes=chunk)
        assert part.events == whole.events
    assert trace_table(path) == trace_table(path)
    with open(path, "rb") as f, gzip.open(str(path) + ".gz", "wb") as g:
        g.write(f.read())
    assert read_trace(path + ".gz", chunk_bytes=8192).events == whole.events


def test_any_json_layout_streams_and_reads_as_kinetos(tmp_path):
    _, path = profiled_trace(tmp_path)
    with open(path) as f:
        doc = json.load(f)
    want = read_trace(path)
    for name, text in [
        ("compact.json", json.dumps(doc, separators=(",", ":"))),
        ("indented.json", json.dumps(doc, indent=4)),
    ]:
        other = tmp_path / name
        other.write_text(text)
        assert trace_table(str(other)) == trace_table(path)
        for chunk in (7, 1024, 65536):  # pieces far smaller than the file: it streams
            got = read_trace(str(other), chunk_bytes=chunk, max_unsplit_bytes=4096)
            assert got.events == want.events and got.names == want.names
            assert all(
                (getattr(got.cpu(), f) == getattr(want.cpu(), f)).all()
                for f in ["start", "end", "name", "kind"]
            )
    big = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x" * 10_000, "ts": 1, "dur": 1}]}
    (tmp_path / "big.json").write_text(json.dumps(big, separators=(",", ":")))
    with pytest.raises(TraceError, match="too large"):
        read_trace(str(tmp_path / "big.json"), chunk_bytes=512, max_unsplit_bytes=4096)


# Names a byte scanner could misread: brackets and braces inside strings, escaped quotes, runs of
# backslashes before a closing quote, and what looks like the end of an event ("},").
AWKWARD = ["a{b", "}]", "[[{", 'q"}', "\\", 'x\\"]', "\\\\", "},{", 'p"},{"', "é},"]


def test_compact_strings_nested_args_and_chunk_edges(tmp_path, monkeypatch):
    ev = [
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": name,
            "ts": 10.0 * i,
            "dur": 5.0,
            "pid": 1,
            "tid": 1,
            "args": {"Input Dims": [[2, 3], []], "k": [name, {"deep": "]}"}, {"a": 1}, {"b": 2}]},
        }
        for i, name in enumerate(AWKWARD * 3)
    ]
    doc = {"schemaVersion": 1, "traceEvents": ev, "distributedInfo": {"rank": 3}}
    path = tmp_path / "awkward.json"
    path.write_text(json.dumps(doc, separators=(",", ":"), ensure_ascii=False))
    whole = read_trace(str(path), chunk_bytes=1 << 30)
    assert whole.names == AWKWARD and whole.events == len(ev) and whole.rank == 3
    used = {"guess": 0, "scan": 0}  # both ways of cutting are exercised, not just one
    for name, key in (("_cut_at_a_guess", "guess"), ("_event_ends", "scan")):
        real = getattr(trace_reader, name)

        def counted(buf, real=real, key=key):
            found = real(buf)
            used[key] += found[0] > 0
            return found

        monkeypatch.setattr(trace_reader, name, counted)
    for chunk in range(1, 60):  # every cut position relative to the strings' quotes
        got = read_trace(str(path), chunk_bytes=chunk)
        assert (got.names, got.events, got.rank) == (whole.names, whole.events, 3), chunk
        assert (got.cpu().start == whole.cpu().start).all()
    assert used["guess"] > 0 and used["scan"] > 0, used


def test_truncated_compact_trace_is_refused(tmp_path):
    _, path = profiled_trace(tmp_path, steps=1)
    with open(path) as f:
        data = json.dumps(json.load(f), separators=(",", ":")).encode()
    bad = tmp_path / "cut.json"
    for cut in (len(data) // 3, len(data) // 2, len(data) - 40, len(data) - 2):
        bad.write_bytes(data[:cut])
        with pytest.raises(TraceError, match="not a valid chrome trace"):
            read_trace(str(bad), chunk_bytes=4096)


def test_steps_memory_and_folded_stacks(tmp_path):
    model = TinyMLP()
    with profile(
        activities=[ProfilerActivity.CPU],
        profile_memory=True,
        with_stack=True,
        schedule=lambda _: torch.profiler.ProfilerAction.RECORD,  # step markers need a schedule
    ) as prof:
        prof.step_num = 10
        for _ in range(3):
            model.train_step()
            prof.step()
    path = str(tmp_path / "t.json")
    prof.export_chrome_trace(path)
    s, folded = summarise_trace(
        path,
        rank=2,
        window=1,
        steps=(11, 12),
        partial=False,
        device="cpu",
        top_k=5,
        stacks=True,
    )
    assert [st for st, _ in s.step_us] == [11, 12] and all(us > 0 for _, us in s.step_us)
    assert s.peak_bytes and s.peak_bytes > 0
    assert s.memory and s.memory[0].bytes >= s.memory[-1].bytes > 0
    assert any(r.name in ("aten::empty", "aten::mm", "aten::addmm") for r in s.memory)
    assert len(s.kernels) == 5 and s.dropped_rows > 0
    b = s.breakdown
    assert b.window_us > 0 and b.compute_us > 0 and b.comm_us == 0
    assert b.compute_us + b.memcpy_us + b.other_us == pytest.approx(b.window_us, rel=1e-6)
    assert folded and all(line.rsplit(" ", 1)[1].isdigit() for line in folded)
    assert any("train_step" in line and ";aten::" in line for line in folded)
    assert not [line for line in folded if "0x7" in line]


@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda b: b[: len(b) // 2], "not a valid chrome trace"),
        (lambda b: b[:-40], "not a valid chrome trace"),
        (lambda b: b"", "empty"),
        (lambda b: b"\x00\xff garbage" * 100, "not a valid chrome trace"),
        (lambda b: b'{"traceEvents": 5}', "not a valid chrome trace"),
        (lambda b: b.replace(b'"ts":', b'"ts": "x",', 1), "not a valid chrome trace"),
    ],
    ids=["half", "tail_cut", "empty", "garbage", "not_a_list", "bad_type"],
)
def test_broken_traces_raise_a_clear_reason(tmp_path, damage, reason):
    _, path = profiled_trace(tmp_path, steps=1)
    with open(path, "rb") as f:
        data = f.read()
    bad = tmp_path / "bad.json"
    bad.write_bytes(damage(data))
    with pytest.raises(TraceError, match=reason):
        read_trace(str(bad), chunk_bytes=8192)
    with pytest.raises(TraceError, match="cannot be read"):
        read_trace(str(tmp_path / "missing.json"))


# ---------------------------------------------------------------- GPU-shaped traces

T0 = 1_000_000.0  # us


def gpu_trace(tmp_path, with_nccl=True):
    """A trace shaped like Kineto's CUDA output (schema from Kineto and torch-profiler-facts)."""
    ev = []

    def x(cat, name, ts, dur, tid=1, pid=100, **args):
        ev.append(
            {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": T0 + ts, "dur": dur}
            | ({"args": args} if args else {})
        )

    # two steps on the CPU thread, 0-1000 and 1000-2000 us
    x("user_annotation", "ProfilerStep#5", 0, 1000)
    x("user_annotation", "ProfilerStep#6", 1000, 1000)
    x("cpu_op", "aten::mm", 10, 50)
    x("cuda_runtime", "cudaLaunchKernel", 20, 10, correlation=1)
    x("cpu_op", "aten::mm", 1010, 50)
    x("cuda_runtime", "cudaLaunchKernel", 1020, 10, correlation=2)
    x("cpu_op", "c10d::allreduce_", 1100, 30)
    x("cuda_runtime", "cudaMemcpyAsync", 480, 5, correlation=3)
    x("cuda_runtime", "cudaMemsetAsync", 640, 5, correlation=4)
    # device activity: pid = device, tid = stream
    gpu = {"pid": 0, "tid": 7, "device": 0, "stream": 7}
    x("kernel", "sm80_xmma_gemm", 100, 300, correlation=1, **gpu)
    x("kernel", "sm80_xmma_gemm", 1100, 300, correlation=2, **gpu)
    x("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 500, 100, correlation=3, **gpu)
    x("gpu_memset", "Memset (Device)", 650, 50, correlation=4, **gpu)
    if with_nccl:
        x("cuda_runtime", "cudaLaunchKernel", 1110, 5, correlation=5)
        nccl = {"pid": 0, "tid": 13, "device": 0, "stream": 13, "correlation": 5}
        x("kernel", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 1200, 400, **nccl)
    # GPU-side annotation spans overlap their kernels: never counted
    x("gpu_user_annotation", "ProfilerStep#5", 100, 900, pid=0, tid=7, device=0, stream=7)
    ev.append({"ph": "f", "cat": "ac2g", "id": 1, "pid": 0, "tid": 7, "ts": T0 + 100})
    ev.append(
        {
            "ph": "i",
            "cat": "cpu_instant_event",
            "name": "[memory]",
            "pid": 100,
            "tid": 1,
            "ts": T0 + 15,
            "s": "t",
            "args": {"Bytes": 4096, "Total Allocated": 1 << 20, "Device Type": 1, "Device Id": 0},
        }
    )
    doc = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "H100"}], "traceEvents": ev}
    path = tmp_path / "gpu.json"
    # Kineto's layout: one event per "\n  {" block
    body = ",".join("\n  " + json.dumps(e, indent=None).replace("{", "{\n", 1) for e in ev)
    path.write_text('{\n  "schemaVersion": 1,\n  "traceEvents": [' + body + "\n  ]}\n")
    assert json.loads(path.read_text())["traceEvents"] == doc["traceEvents"]
    return str(path)


def test_gpu_trace_kernels_streams_breakdown_and_memory(tmp_path):
    path = gpu_trace(tmp_path)
    s, _ = summarise_trace(
        path, rank=1, window=0, steps=(5, 6), partial=False, device="cuda", top_k=10
    )
    rows = {k.name: (k.self_us, k.count) for k in s.kernels}
    assert rows == {
        "sm80_xmma_gemm": (600.0, 2),
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL": (400.0, 1),
        "Memcpy HtoD (Pageable -> Device)": (100.0, 1),
        "Memset (Device)": (50.0, 1),
    }
    assert not any(k.name.startswith(("ProfilerStep", "aten::", "cuda")) for k in s.kernels)
    b = s.breakdown
    # the window on the device: its first event (100) to its last (1600)
    assert (b.compute_us, b.comm_us, b.memcpy_us, b.window_us) == (600.0, 400.0, 150.0, 1500.0)
    assert b.overlap_us == 200.0  # the all-reduce beside the second gemm, 1200-1400
    # idle: the window minus the union of all device activity (300 + 100 + 50 + 1100..1600)
    assert b.other_us == pytest.approx(1500.0 - 950.0)
    streams = {(r.device, r.stream): (r.busy_us, r.idle_us) for r in s.streams}
    assert streams == {(0, 7): (750.0, 750.0), (0, 13): (400.0, 1100.0)}
    assert s.unattributed_us == 0.0
    assert s.step_device == [(5, 450.0, 600.0), (6, 500.0, 500.0)]
    ops = {o.name: (o.device_us, o.cpu_us, o.count, o.kernels) for o in s.ops}
    assert ops["aten::mm"] == (600.0, 80.0, 2, [("sm80_xmma_gemm", 600.0)])
    assert ops["c10d::allreduce_"][0] == 400.0
    assert ops["<no op>"][0] == 150.0  # the copy and the set, launched outside any op
    assert s.peak_bytes == 1 << 20
    assert [(m.name, m.bytes, m.count) for m in s.memory] == [("aten::mm", 4096, 1)]
    assert [st for st, _ in s.step_us] == [5, 6]


def test_gpu_trace_on_a_cpu_rank_summarises_cpu_ops(tmp_path):
    path = gpu_trace(tmp_path, with_nccl=False)
    s, _ = summarise_trace(
        path, rank=0, window=0, steps=(5, 6), partial=False, device="cpu", top_k=10
    )
    names = {k.name for k in s.kernels}
    assert "aten::mm" in names and "sm80_xmma_gemm" not in names
    assert s.breakdown.comm_us == 30.0  # c10d::allreduce_ on the CPU thread


@pytest.fixture(scope="module")
def gloo_ranks(ray_session):
    """Two gloo ranks of the reference policy worker, shared by the equality tests."""
    from tests.ray_workers import ProfiledPolicyWorker, gloo_pair

    with gloo_pair(ray_session, ProfiledPolicyWorker) as workers:
        yield workers


@pytest.mark.parametrize("with_stack", [False, True], ids=["plain", "with_stack"])
def test_reference_trainer_windows_equal_key_averages(
    ray_session, gloo_ranks, tmp_path, with_stack
):
    """Two gloo ranks of the reference policy worker: SFT and RL steps with all-reduce."""
    ray, workers = ray_session, gloo_ranks
    paths = [str(tmp_path / f"rank{r}.json") for r in range(2)]
    tables = ray.get(
        [w.profile_window.remote(p, 3, with_stack) for w, p in zip(workers, paths, strict=True)]
    )
    for path, expected in zip(paths, tables, strict=True):
        got = trace_table(path)
        assert "c10d::allreduce_" in got and "aten::embedding" in got
        if "key_averages failed" in expected:
            # torch's own parser can fail on Python frame names of these windows (a
            # UnicodeDecodeError in torch 2.13); the trace itself reads fine
            assert with_stack and any(".py(" in name for name in got)
        else:
            assert differences(expected, got) == []
        s, _ = summarise_trace(
            path, rank=0, window=0, steps=(0, 9), partial=False, device="cpu", top_k=5
        )
        assert s.breakdown.comm_us > 0 and s.breakdown.compute_us > 0


def plain_memory_reading(path, steps):
    """The window's allocations read plainly from the trace's events: every ``[memory]`` event
    of the CPU, its innermost enclosing op on its thread, the ProfilerStep it falls in."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    mem = [e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0]
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    spans = {
        int(e["name"].split("#")[1]): (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
    }
    peak = max(mem, key=lambda e: e["args"]["Total Allocated"])
    peak_step = next(s for s, (b, end) in spans.items() if b <= peak["ts"] <= end and s in steps)
    by_op: dict[str, int] = {}
    for e in mem:
        if e["args"]["Bytes"] <= 0:
            continue
        around = [
            o for o in ops if o["tid"] == e["tid"] and o["ts"] <= e["ts"] < o["ts"] + o["dur"]
        ]
        inner = min(around, key=lambda o: o["dur"])["name"] if around else "<outside any op>"
        by_op[inner] = by_op.get(inner, 0) + e["args"]["Bytes"]
    return {
        "peak": peak["args"]["Total Allocated"],
        "peak_step": peak_step,
        "allocated": sum(e["args"]["Bytes"] for e in mem if e["args"]["Bytes"] > 0),
        "freed": -sum(e["args"]["Bytes"] for e in mem if e["args"]["Bytes"] < 0),
        "top": max(by_op.items(), key=lambda kv: kv[1]),
    }


def test_a_window_s_allocations_match_a_plain_reading_of_its_memory_events(tmp_path, capsys):
    model = TinyMLP()
    with profile(
        activities=[ProfilerActivity.CPU],
        profile_memory=True,
        schedule=lambda _: torch.profiler.ProfilerAction.RECORD,
    ) as prof:
        prof.step_num = 20
        for k in range(3):
            model.train_step()
            if k == 1:  # step 21 holds the window's peak: 8 MiB allocated and kept a moment
                big = torch.ones(2 << 20)
                del big
            prof.step()
    path = str(tmp_path / "t.json")
    prof.export_chrome_trace(path)
    s, _ = summarise_trace(
        path, rank=0, window=0, steps=(20, 22), partial=False, device="cpu", top_k=5
    )
    plain = plain_memory_reading(path, range(20, 23))
    assert s.peak_bytes == plain["peak"]
    assert s.memory_flow == (plain["peak_step"], plain["allocated"], plain["freed"])
    assert plain["peak_step"] == 21
    assert (s.memory[0].name, s.memory[0].bytes) == plain["top"]
    rank0 = tmp_path / "rank0.pt.trace.json"  # ``summarise`` prints the same for any trace
    os.rename(path, rank0)
    assert cli_main(["summarise", str(rank0), "--steps", "20-22"]) == 0
    assert "rank 0 peaked in step 21; the window allocated" in capsys.readouterr().out
