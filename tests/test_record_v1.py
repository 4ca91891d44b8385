"""A run's record written by the code of 2026-12-06, before the one store (version 1,
``tests/data/record-v1``, made from the two real GPU ranks), read by today's reader: the same
tables, window entries, stalls and phase times the old reader gave
(``tests/data/record-v1-expected.json``), and the same bytes' meaning when written again."""

from __future__ import annotations

import json
import os

import msgspec

from coordinator.core import record_codec as codec
from coordinator.core.saved import AggregateFile, DeviceFile, RowTableFile
from coordinator.ops.recorded import RecordedCoordinator, call, open_record

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
RECORD = os.path.join(DATA, "record-v1")


def plain(obj):
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def test_a_version_1_record_reads_with_the_old_reader_s_answers():
    with open(os.path.join(DATA, "record-v1-expected.json")) as f:
        want = json.load(f)
    h = RecordedCoordinator(open_record(RECORD))
    assert h.rec.problems == want["problems"] == []
    st = call(h, "status")
    got = {
        "kernel_summary": call(h, "kernel_summary", 4, 100000, None, True),
        "by_op": call(h, "kernel_summary", 4, 50, None, False, None, None, "op"),
        "windows": st["windows"],
        "stalls": st["stalls"],
        "run": st["run"],
        "counters": st["counters"],
        "phases": call(h, "phase_times", last=50),
    }
    for key, value in got.items():
        assert plain(value) == want[key], key
    assert got["kernel_summary"]["device"] == "cuda" and len(got["windows"]) == 1


def test_its_window_written_again_is_the_same_file_under_the_declared_names():
    """The names on disk are the structs' declared ones (``_kernels`` for
    ``AggregateFile.kernels``): a window read back and written again is the file it was."""
    with open(os.path.join(RECORD, "windows", "000004.msgpack"), "rb") as f:
        blob = f.read()
    old = codec.decode(blob)
    again = codec.window_file(old.run, codec.window_record(old))
    assert codec.decode(codec.encode(again)) == old
    raw = msgspec.msgpack.decode(blob)
    agg = raw["aggregates"]["policy"]
    later_fields = {"memory_flow", "collectives", "host"}  # (added after this file was written)
    assert set(agg) == set(AggregateFile.__struct_encode_fields__) - later_fields
    assert {"_kernels", "_memory", "_detail", "_torn"} <= set(agg)
    assert set(agg["gpu"]) == set(DeviceFile.__struct_encode_fields__) - {"rows"}  # (later)
    assert set(agg["_kernels"]) == set(RowTableFile.__struct_encode_fields__)
    later = {"opened_at", "closed_at"}  # optional fields added after this file was written
    assert set(raw) == (set(codec.WindowFile.__struct_encode_fields__) - later) | {"kind"}


def test_renaming_a_private_field_changes_no_byte_on_disk():
    """``aggregate.py`` loaded with three private attributes renamed (as a refactor would)
    saves the same bytes for the same summaries: the format is the declared structs', never
    an attribute's name."""
    import pathlib
    import re
    import sys
    import types

    from coordinator.core import aggregate
    from tests.test_run_record import gpu_window

    src = pathlib.Path(aggregate.__file__).read_text()
    renamed = src
    for old, new in (("_torn", "_ranks_torn"), ("_memory", "_alloc_table"), ("_detail", "_cells")):
        renamed = re.sub(rf"\b{old}\b", new, renamed)
    assert renamed.count("_ranks_torn") >= 4 and "_torn" not in renamed.replace("_ranks_torn", "")
    mod = types.ModuleType("renamed_aggregate")
    sys.modules[mod.__name__] = mod
    try:
        exec(compile(renamed, "renamed_aggregate.py", "exec"), mod.__dict__)
        window = gpu_window()
        original = window.aggregates["policy"]
        copy = mod.restored_aggregate(aggregate.saved_aggregate(original))  # (same figures)
        assert "_ranks_torn" in vars(copy) and "_torn" not in vars(copy)
        assert msgspec.msgpack.encode(mod.saved_aggregate(copy)) == msgspec.msgpack.encode(
            aggregate.saved_aggregate(original)
        )
    finally:
        del sys.modules[mod.__name__]
