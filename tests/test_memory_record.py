"""Every rank's memory in the run's record (``memory.msgpack``): its codec (a round trip, its
bounds, its fields checked on read), an older record with no memory, a malformed memory file
(said, the rest of the record still read), and the recorder that writes it (the one writer:
at the run's end and at a flush, not again while nothing changed, kept across a coordinator
that goes on from the record)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import types

import msgspec
import pytest

from coordinator.core import memory_record as mr
from coordinator.core import record_codec as codec
from coordinator.core.config import ProfilerConfig
from coordinator.core.memory import SERIES_POINTS, MemoryBook
from coordinator.core.memory_view import culprit_lines, marks, rank_entry
from coordinator.core.run import new_run
from coordinator.ops.cli import EXIT_ERROR
from coordinator.ops.cli import main as cli_main
from coordinator.ops.recorded import RecordedCoordinator, call, open_record
from coordinator.protocol.memory_replies import MemoryReply
from coordinator.service.phase_store import PhaseStore
from coordinator.service.run_recorder import RunRecorder

MiB = 1 << 20
NAN, INF = float("nan"), float("inf")
V1 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "record-v1")


def book_reply(ranks: int = 2, seconds: int = 400, leak: int = 1, run: str = "job") -> MemoryReply:
    """``memory(series=True)`` of a real ``MemoryBook`` folded from ``seconds`` samples a rank,
    rank ``leak`` growing 2 MiB a second (marked), the others flat."""
    book = MemoryBook()
    for r in range(ranks):
        rate = 2 * MiB if r == leak else 0
        samples = [(1e6 + s, 10**9 + rate * s + 4096 * (s % 3), None, None) for s in range(seconds)]
        book.add(("sft", r), 100 + r, samples, None, "node-a")
    book.evaluate(1e6 + seconds - 1, 300.0, 1e5)
    roles = {("sft", r): "policy" for r in range(ranks)}
    culprits = book.culprits(roles)
    where = (("node-a", 0, None),)
    return {
        "run": run, "sample_s": 1.0, "leak_span_s": 300.0, "leak_min_bytes_per_min": 6e6,
        "leak_fast_span_s": 90.0, "leak_fast_min_bytes_per_min": 1e8, "taken_at": 2e6,
        "ranks": [rank_entry(book, ("sft", r), "policy", (where[0][0], 100 + r, None), True,
                             ("sft", r) in culprits) for r in range(ranks)],
        "culprits": culprit_lines(marks(book, roles), roles),
        "windows": [(0, 1e6 + 10, 1e6 + 20)],
        "gpu": {"node-a": "no NVML"}, "agent_cpu_s": {"node-a": 0.5},
        "snapshots": [{"trainer_id": "sft", "rank": 1, "on": "oom", "path": "/r/rank1.pickle",
                       "error": None, "at": 1e6 + 5}],
        "nodes": {"node-a": {"total_bytes": 8 << 30, "available_bytes": 4 << 30, "at": 1e6,
                             "source": "host"}},
    }  # fmt: skip


def plain(obj):
    return json.loads(json.dumps(obj))


def written(reply: MemoryReply) -> mr.MemoryFile:
    """``reply`` as its record file, through the bytes."""
    got = codec.decode(codec.encode(mr.memory_file(reply, codec.VERSION, 3e6)))
    assert isinstance(got, mr.MemoryFile)
    return got


def test_a_run_s_memory_comes_back_from_its_record_as_the_coordinator_showed_it():
    reply = book_reply()
    assert reply["ranks"][1]["growth"] and reply["ranks"][1]["culprit"] and reply["culprits"]
    f = written(reply)
    assert plain(mr.memory_reply(f, series=True, trainer_id=None)) == plain(reply)
    brief = mr.memory_reply(f, series=False, trainer_id="sft")
    assert [r["series"] for r in brief["ranks"]] == [None, None]
    assert mr.memory_reply(f, series=True, trainer_id="other")["ranks"] == []
    st = mr.memory_status(f)
    assert [(m["rank"], m["culprit"]) for m in st["marked"]] == [(1, True)]
    assert st["marked"][0]["bytes_per_min"] == reply["ranks"][1]["growth"]["bytes_per_min"]
    assert st["culprits"] == reply["culprits"] and st["snapshots"] == reply["snapshots"]
    assert (st["sampled_ranks"], st["lost_ranks"]) == (2, 0)


def test_the_file_is_bounded_however_many_the_ranks_and_the_peaks_stay():
    reply = book_reply(ranks=2)
    series = reply["ranks"][0]["series"]
    assert series is not None
    long = [(1e6 + i, 10**9 + (5 * MiB if i == 377 else 0)) for i in range(SERIES_POINTS)]
    ranks = [{**reply["ranks"][0], "rank": r, "series": long} for r in range(2000)]
    big = {**reply, "ranks": ranks, "windows": [(i, 1.0, 2.0) for i in range(1000)],
           "snapshots": reply["snapshots"] * 1000,
           "culprits": ["x" * 10_000]}  # fmt: skip
    big["ranks"][0] = {**ranks[0], "reason": "y" * 10_000}
    f = written(big)  # type: ignore[arg-type]
    per_rank = mr.MAX_POINTS // 2000
    assert {len(r["series"] or []) for r in f.ranks} == {per_rank}
    assert max(v for _, v in f.ranks[5]["series"] or []) == 10**9 + 5 * MiB  # the peak kept
    assert len(f.windows) == mr.MAX_BANDS and f.windows[-1][0] == 999  # the latest kept
    assert len(f.snapshots) == mr.MAX_SNAPSHOTS
    assert len(f.culprits[0]) == len(f.ranks[0]["reason"] or "") == 4096
    assert len(codec.encode(f)) < 16 * MiB


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda raw: raw["ranks"][0].update(rank=-1), "$.ranks[0].rank"),
        (lambda raw: raw["ranks"][0].update(trainer_id="../etc"), "$.ranks[0].trainer_id"),
        (lambda raw: raw["ranks"][0].update(state="gone"), "$.ranks[0].state"),
        (lambda raw: raw["ranks"][1]["series"].append([1.0, "a lot"]), "$.ranks[1].series"),
        (lambda raw: raw["ranks"][1].update(series=[[1.0, 1]] * 601), "$.ranks[1].series"),
        (lambda raw: raw.pop("ranks"), "missing required field `ranks`"),
        (lambda raw: raw["ranks"][1]["growth"].update(since=NAN), "$.ranks[1].growth.since"),
        (lambda raw: raw["ranks"][1]["growth"].update(since=1e300), "$.ranks[1].growth.since"),
        (lambda raw: raw["ranks"][1]["growth"].update(bytes_per_min=INF), "bytes_per_min"),
        (lambda raw: raw["ranks"][1]["growth"].update(time_left_s=-1.0), "time_left_s"),
        (lambda raw: raw["ranks"][0].update(samples=-5), "$.ranks[0].samples"),
        (lambda raw: raw["ranks"][0].update(pid=1 << 40), "$.ranks[0].pid"),
        (lambda raw: raw["ranks"][0].update(last_at=NAN), "$.ranks[0].last_at"),
        (lambda raw: raw["ranks"][0]["series"].append([NAN, 1]), "$.ranks[0].series"),
        (lambda raw: raw.update(taken_at=INF), "$.taken_at"),
        (lambda raw: raw["nodes"]["node-a"].update(at=NAN), "$.nodes"),
        (lambda raw: raw["snapshots"][0].update(at=-INF), "$.snapshots[0].at"),
        (
            lambda raw: raw.update(ranks=[{**raw["ranks"][0], "series": None}] * 31_251),
            "31251 ranks, over the 31250 read",
        ),
        (
            lambda raw: raw.update(ranks=[{**raw["ranks"][0], "series": [[1.0, 1]] * 600}] * 900),
            "540000 points in its ranks' series, over the 500000 read",
        ),
    ],
)
def test_a_malformed_memory_file_is_refused_naming_the_field(change, said):
    raw = msgspec.msgpack.decode(codec.encode(mr.memory_file(book_reply(), codec.VERSION, 1.0)))
    change(raw)
    with pytest.raises(codec.RecordError) as err:
        codec.decode(msgspec.msgpack.encode(raw), "r/memory.msgpack")
    assert "r/memory.msgpack: malformed 'memory' file" in str(err.value) and said in str(err.value)


def test_an_older_record_has_no_memory_and_says_so():
    h = RecordedCoordinator(open_record(V1))
    assert h.rec.memory is None and h.rec.problems == []
    assert call(h, "status")["memory"] is None
    with pytest.raises(ValueError, match="written before memory was recorded"):
        call(h, "memory")


def test_a_malformed_memory_file_is_said_and_the_rest_of_the_record_read(tmp_path):
    record = tmp_path / "record"
    shutil.copytree(V1, record)
    raw = msgspec.msgpack.decode(codec.encode(mr.memory_file(book_reply(), codec.VERSION, 1.0)))
    raw["ranks"][0]["peak_rss_bytes"] = "huge"
    (record / "memory.msgpack").write_bytes(msgspec.msgpack.encode(raw))
    h = RecordedCoordinator(open_record(str(record)))
    assert list(h.rec.run.state.windows) == [4] and h.rec.phases.steps_seen  # the rest is read
    with pytest.raises(ValueError, match=r"memory.msgpack: malformed 'memory' file .*peak_rss"):
        call(h, "memory")
    st = call(h, "status")
    assert st["memory"] is None and "malformed 'memory' file" in st["record"]["error"]
    assert [w["index"] for w in st["windows"]] == [4]


def test_a_record_s_advise_names_the_leak_its_memory_marks(tmp_path):
    """``advise`` from a record reads the memory book the record kept (issue 57's
    ``memory_leak``); the same record without it is quiet, never an error."""
    h = RecordedCoordinator(open_record(V1))
    assert "memory book" in call(h, "advise")["not_judged"]["memory_leak"]
    record = tmp_path / "record"
    shutil.copytree(V1, record)
    reply = book_reply(run=h.rec.run.name)
    for r in reply["ranks"]:
        r["trainer_id"] = "policy"  # (the record's trainer)
    (record / "memory.msgpack").write_bytes(codec.encode(mr.memory_file(reply, codec.VERSION, 1.0)))
    found = call(RecordedCoordinator(open_record(str(record))), "advise")
    (leak,) = [f for f in found["findings"] if f["rule"] == "memory_leak"]
    assert leak["ranks"] == [1] and leak["cost_ms_per_step"] == 0.0, leak
    assert leak["evidence"]["mb_per_s"][1] == pytest.approx(2 * MiB / 1e6, rel=0.05), leak
    assert found["window"] == 4 and "memory_leak" not in found["quiet"]


def test_a_run_going_on_from_its_record_keeps_the_memory_recorded_before():
    old = written(book_reply(seconds=400))
    later = book_reply(seconds=800)
    for r in later["ranks"]:  # the new coordinator's samples start where the old ones end
        r["series"] = [p for p in r["series"] or [] if p[0] >= 1e6 + 400]
        r["peak_rss_bytes"] = 10**9
    later["snapshots"] = [{**later["snapshots"][0], "rank": 0, "at": 1e6 + 500}]
    f = mr.merged(old, written(later))
    for r, was in zip(f.ranks, old.ranks, strict=True):
        before = [p for p in r["series"] or [] if p[0] < 1e6 + 400]
        assert before[0] == (was["series"] or [])[0] and len(r["series"] or []) == SERIES_POINTS
        assert max(v for _, v in before) == max(v for _, v in was["series"] or [])
        assert r["peak_rss_bytes"] == was["peak_rss_bytes"] and r["samples"] > was["samples"]
    assert [s["rank"] for s in f.snapshots] == [1, 0]


class Watched:
    """The memory watcher's ``recorded`` as the recorder calls it: a reply for run ``run``."""

    def __init__(self, run: str) -> None:
        self.run, self.calls, self.reply = run, 0, book_reply(run=run)

    async def __call__(self, run: str) -> MemoryReply | None:
        self.calls += 1
        return self.reply if run == self.run else None


def recorded_run(tmp_path, lifecycle: str):
    cfg = ProfilerConfig.from_dict({"enable": True, "save_path": str(tmp_path)})
    run = new_run(cfg, set())
    run.lifecycle = lifecycle
    watched = Watched(run.name)
    shell = types.SimpleNamespace(
        run=run, previous=[], restored={}, stalls=[], phases=PhaseStore(lambda *a: "", print),
        memory_recorded=watched,
    )  # fmt: skip

    async def mark(_run):
        return None

    return RunRecorder(shell, mark), run, watched  # type: ignore[arg-type]


def test_the_recorder_writes_the_memory_at_the_run_s_end_once(tmp_path):
    recorder, run, watched = recorded_run(tmp_path, "stopped")
    record = os.path.join(run.run_dir, "record")

    async def go():
        await recorder.look()
        assert await recorder.flush(30.0)
        files, calls = recorder.writes.stats()["files"], watched.calls
        await recorder.look()  # ended, written: not made again
        assert watched.calls == calls
        assert await recorder.flush(30.0)  # made (a flush), the same: not written again
        assert watched.calls == calls + 1 and recorder.writes.stats()["files"] == files

    asyncio.run(go())
    h = RecordedCoordinator(open_record(record))
    assert plain(call(h, "memory", series=True)) == plain(watched.reply)
    assert plain(call(h, "status")["memory"]["marked"])[0]["rank"] == 1


def test_while_the_run_goes_the_memory_is_made_at_most_every_interval(tmp_path):
    recorder, run, watched = recorded_run(tmp_path, "running")

    async def go():
        await recorder.look()
        await recorder.look()  # within MEMORY_EVERY_S of the first: not made
        assert watched.calls == 1
        assert await recorder.flush(30.0)  # a flush makes it whenever it was last made
        assert watched.calls == 2

    asyncio.run(go())
    assert os.path.isfile(os.path.join(run.run_dir, "record", "memory.msgpack"))


@pytest.mark.parametrize("since", [NAN, 1e300])
@pytest.mark.parametrize("as_json", [False, True])
def test_memory_from_a_record_of_a_nan_or_huge_time_says_so_without_a_traceback(
    tmp_path, capsys, since, as_json
):
    """``memory --from`` on a memory file whose leak began at NaN or 1e300 (ValueError and
    OverflowError from ``time.localtime`` before, and NaN printed as ``--json``): one line
    naming the field, the CLI's error exit; the rest of the record still read."""
    record = tmp_path / "record"
    shutil.copytree(V1, record)
    raw = msgspec.msgpack.decode(codec.encode(mr.memory_file(book_reply(), codec.VERSION, 1.0)))
    raw["ranks"][1]["growth"]["since"] = since
    (record / "memory.msgpack").write_bytes(msgspec.msgpack.encode(raw))
    code = cli_main(["memory", "--from", str(record), *(["--json"] if as_json else [])])
    out, err = capsys.readouterr()
    assert code == EXIT_ERROR and out == "", out
    assert "malformed 'memory' file" in err and "$.ranks[1].growth.since" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert cli_main(["status", "--from", str(record), "--json"]) == 0
    assert [w["index"] for w in json.loads(capsys.readouterr().out)["windows"]] == [4]


def test_record_text_is_printed_with_its_control_characters_escaped(tmp_path, capsys):
    """A record's culprits, reasons, snapshots' paths and errors and node ids may hold escape
    sequences (anyone who can write ``save_path`` made it): the table prints them escaped,
    never raw to the reader's terminal."""
    esc = "\x1b]0;owned\x07\x1b[2J\u202e"
    reply = book_reply()
    reply["culprits"] = [f"rank 1 {esc}"]
    reply["ranks"][0] = {**reply["ranks"][0], "state": "lost", "reason": f"gone {esc}"}
    reply["snapshots"][0] = {**reply["snapshots"][0], "path": f"/r/{esc}", "error": f"no {esc}"}
    reply["gpu"] = {f"n{esc}": f"no NVML {esc}"}
    record = tmp_path / "record"
    shutil.copytree(V1, record)
    (record / "memory.msgpack").write_bytes(codec.encode(mr.memory_file(reply, codec.VERSION, 1.0)))
    assert cli_main(["memory", "--from", str(record)]) == 0
    out = capsys.readouterr().out
    for c in "\x1b\x07\u202e":
        assert c not in out, repr(out)
    assert out.count("\\x1b]0;owned\\x07") == 6, out
    for said in (
        "leak: rank 1 \\x1b",
        "(gone \\x1b",
        "/r/\\x1b",
        "FAILED: no \\x1b",
        "node n\\x1b",
    ):
        assert said in out, (said, out)


def test_the_file_keeps_within_the_points_it_may_hold_whatever_the_rank_count():
    """Past 31,250 ranks the 16 points a rank keeps would pass the 500,000 a reader takes: the
    file keeps the first ``MAX_RANKS`` ranks, and it reads back."""
    reply = book_reply(ranks=1)
    long = [(1e6 + i, 10**9 + i) for i in range(SERIES_POINTS)]
    reply["ranks"] = [{**reply["ranks"][0], "rank": r, "series": long} for r in range(40_000)]
    blob = codec.encode(mr.memory_file(reply, codec.VERSION, 3e6))
    f = codec.decode(blob)
    assert isinstance(f, mr.MemoryFile) and len(f.ranks) == mr.MAX_RANKS == 31_250
    assert sum(len(r["series"] or []) for r in f.ranks) <= mr.MAX_POINTS
    assert {len(r["series"] or []) for r in f.ranks} == {mr.MIN_POINTS}
    assert mr.oversized(blob) is None
    double = mr.merged(f, f)  # (a run going on from its record: bounded the same)
    assert mr.oversized(codec.encode(double)) is None and len(double.ranks) == mr.MAX_RANKS


def test_a_time_left_past_what_a_reader_takes_is_written_as_the_longest_it_takes():
    """A node of unbounded memory (a cgroup's ``max``) gives a leak a time left past
    ``MAX_SECONDS``: the writer keeps its file readable, the time left said as the longest."""
    reply = book_reply()
    growth = reply["ranks"][1]["growth"]
    assert growth is not None
    growth["time_left_s"] = float(1 << 63) / 1e5
    f = written(reply)
    assert (f.ranks[1]["growth"] or {}).get("time_left_s") == mr.MAX_SECONDS
