import contextlib
import math
import re
import struct

import msgpack
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from coordinator.protocol.summary_codec import (
    MAX_NAME_CHARS,
    MAX_PAYLOAD_BYTES,
    Breakdown,
    KernelRow,
    LaunchRow,
    MemoryRow,
    OpRow,
    RankSummary,
    StreamRow,
    SummaryDecodeError,
    decode_summary,
    encode_summary,
)

times = st.floats(min_value=0, max_value=1e12, allow_nan=False, allow_infinity=False)
ints = st.integers(0, 2**40)
kernel_rows = st.builds(KernelRow, st.text(min_size=1, max_size=80), times, ints, ints)
breakdowns = st.builds(Breakdown, times, times, times, times, times, times)
names = st.text(min_size=1, max_size=40)
op_rows = st.builds(OpRow, names, times, times, ints, st.lists(st.tuples(names, times), max_size=5))
launch_rows = st.builds(LaunchRow, ints, times, times, st.floats(0.0, 1.0))
stream_rows = st.builds(StreamRow, st.integers(-1, 16), st.integers(-(2**40), 2**40), times, times)
memory_rows = st.builds(MemoryRow, st.text(min_size=1, max_size=40), ints, ints)


@st.composite
def summaries(draw):
    first = draw(st.integers(0, 10**9))
    last = first + draw(st.integers(0, 50))
    peak = draw(st.none() | ints)
    return RankSummary(
        rank=draw(st.integers(0, 100_000)),
        window=draw(st.integers(0, 10_000)),
        steps=(first, last),
        partial=draw(st.booleans()),
        device=draw(st.sampled_from(["cpu", "cuda"])),
        kernels=draw(st.lists(kernel_rows, max_size=30)),
        dropped_rows=draw(ints),
        dropped_us=draw(times),
        step_us=draw(st.lists(st.tuples(st.integers(0, 10**9), times), max_size=10)),
        breakdown=draw(breakdowns),
        streams=draw(st.lists(stream_rows, max_size=4)),
        peak_bytes=peak,
        memory=draw(st.lists(memory_rows, max_size=5)) if peak is not None else [],
        unattributed_us=draw(times),
        step_device=draw(st.lists(st.tuples(st.integers(0, 10**9), times, times), max_size=5)),
        launch=draw(st.none() | launch_rows),
        launch_bound=draw(st.lists(st.integers(0, 10**9), max_size=3)),
        ops=draw(st.lists(op_rows, max_size=5)),
    )


def good_obj():
    return {
        "v": 3,
        "rank": 3,
        "window": 0,
        "steps": [4, 6],
        "partial": False,
        "device": "cpu",
        "unit": "us",
        "kernels": [["aten::mm", 12.5, 3, 0]],
        "dropped": [0, 0.0],
        "step_us": [[4, 100.0]],
        "breakdown": [10.0, 2.0, 0.5, 7.5, 20.0, 1.0],
        "streams": [[0, 7, 12.0, 8.0]],
        "memory": [4096, [["aten::empty", 4096, 2]]],
        "unattributed_us": 3.0,
        "step_device": [[4, 9.0, 15.0]],
        "launch": [12, 4.5, 30.0, 0.25],
        "launch_bound": [5],
        "ops": [["aten::mm", 11.0, 6.5, 3, [["gemm_kernel", 11.0]]]],
    }


def pack(obj):
    return msgpack.packb(obj, use_bin_type=True)


@settings(max_examples=200, deadline=None)
@given(summaries())
def test_round_trip(summary):
    back = decode_summary(encode_summary(summary))
    assert back == summary
    assert math.isclose(back.total_us, summary.total_us, rel_tol=1e-9, abs_tol=1e-9)


def test_good_payload_decodes():
    s = decode_summary(pack(good_obj()))
    assert s.kernels == [KernelRow("aten::mm", 12.5, 3, 0)] and s.steps == (4, 6)
    assert s.breakdown == Breakdown(10.0, 2.0, 0.5, 7.5, 20.0, 1.0)
    assert s.unattributed_us == 3.0 and s.step_device == [(4, 9.0, 15.0)]
    assert s.launch == LaunchRow(12, 4.5, 30.0, 0.25) and s.launch_bound == [5]
    assert s.ops == [OpRow("aten::mm", 11.0, 6.5, 3, [("gemm_kernel", 11.0)])]
    assert s.breakdown.share("compute") == 0.5
    assert s.streams == [StreamRow(0, 7, 12.0, 8.0)]
    assert s.peak_bytes == 4096 and s.memory == [MemoryRow("aten::empty", 4096, 2)]
    no_memory = good_obj() | {"memory": None}
    assert decode_summary(pack(no_memory)).peak_bytes is None


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=512))
def test_decoder_never_raises_anything_but_decode_error_on_garbage(data):
    with contextlib.suppress(SummaryDecodeError):
        decode_summary(data)


@settings(max_examples=500, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats()
        | st.text(max_size=10),
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(st.text(max_size=8), children, max_size=4)
        ),
        max_leaves=20,
    )
)
def test_decoder_rejects_random_structures(obj):
    with pytest.raises(SummaryDecodeError):
        decode_summary(pack(obj))


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(list(good_obj())),
    st.one_of(st.none(), st.booleans(), st.text(max_size=5), st.floats(), st.integers(-5, -1)),
)
def test_decoder_rejects_a_bad_value_in_any_field(key, bad):
    assume(not (key == "partial" and isinstance(bad, bool)))
    assume(not (key in ("memory", "launch") and bad is None))  # none is a valid value
    ok_time = isinstance(bad, float) and not isinstance(bad, bool) and 0 <= bad < math.inf
    assume(not (key == "unattributed_us" and ok_time))  # a time is a valid value
    obj = good_obj()
    obj[key] = bad
    with pytest.raises(SummaryDecodeError):
        decode_summary(pack(obj))


def at(what: str, path: str) -> str:
    """The pattern of an error that says ``what`` is wrong ``at`` the payload path ``path``."""
    return re.escape(what) + ".* - at " + re.escape(f"`{path}`")


@pytest.mark.parametrize(
    "mutate,pattern",
    [
        (lambda o: o.update(v=2), "version 2 is not supported"),
        (lambda o: o.update(v=4), "version 4 is not supported"),
        (lambda o: o["breakdown"].pop(), at("length 6, got 5", "$.breakdown")),
        (lambda o: o.update(launch=[1, 1.0, 1.0, 1.5]), at("<= 1.0", "$.launch[3]")),
        (lambda o: o.update(unattributed_us=-1.0), at(">= 0.0", "$.unattributed_us")),
        (lambda o: o["ops"][0][4].extend([["k", 1.0]] * 5), at("length <= 5", "$.ops[0][4]")),
        (lambda o: o["step_device"].append([1, 2.0]), at("length 3, got 2", "$.step_device[1]")),
        (lambda o: o["breakdown"].__setitem__(1, -2.0), at(">= 0.0", "$.breakdown[1]")),
        (lambda o: o["streams"].append([0, 1, math.inf, 0.0]), at("<= 1.79", "$.streams[1][2]")),
        (lambda o: o["streams"].append([0, True, 1.0, 0.0]), at("bool", "$.streams[1][1]")),
        (lambda o: o.update(memory=[-1, []]), at("`int` >= 0", "$.memory[0]")),
        (lambda o: o["memory"][1].append(["", 1, 1]), at("length >= 1", "$.memory[1][1][0]")),
        (lambda o: o["memory"][1].append(["x", 1.5, 1]), at("float", "$.memory[1][1][1]")),
        (lambda o: o.update(memory=[1]), at("length 2, got 1", "$.memory")),
        (lambda o: o.pop("rank"), "missing required field `rank`"),
        (lambda o: o.update(extra=1), "unknown field `extra`"),
        (lambda o: o.update(steps=[7, 6]), "first is after last"),
        (lambda o: o["kernels"].append(["x", math.nan, 1, 0]), at(">= 0.0", "$.kernels[1][1]")),
        (lambda o: o["kernels"].append(["x", -1.0, 1, 0]), at(">= 0.0", "$.kernels[1][1]")),
        (lambda o: o["kernels"].append(["x", 1.0, True, 0]), at("bool", "$.kernels[1][2]")),
        (lambda o: o["kernels"].append(["", 1.0, 1, 0]), at("length >= 1", "$.kernels[1][0]")),
        (
            lambda o: o["kernels"].append(["x" * (MAX_NAME_CHARS + 1), 1.0, 1, 0]),
            at(f"length <= {MAX_NAME_CHARS}", "$.kernels[1][0]"),
        ),
        (lambda o: o["kernels"].append(["x", 1.0, 1]), at("length 4, got 3", "$.kernels[1]")),
        (lambda o: o.update(device="tpu"), at("'tpu'", "$.device")),
        (lambda o: o.update(unit="ms"), at("'ms'", "$.unit")),
    ],
)
def test_decoder_errors_say_what_is_wrong(mutate, pattern):
    obj = good_obj()
    mutate(obj)
    with pytest.raises(SummaryDecodeError, match=pattern):
        decode_summary(pack(obj))


def test_oversized_payload_is_refused_before_parsing():
    with pytest.raises(SummaryDecodeError, match="over the"):
        decode_summary(b"\x90" * (MAX_PAYLOAD_BYTES + 1))


def test_lying_length_headers_do_not_allocate():
    # array32 / map32 / str32 headers claiming 4 billion items, with nothing behind them.
    for prefix in (b"\xdd", b"\xdf", b"\xdb", b"\xc6"):
        with pytest.raises(SummaryDecodeError):
            decode_summary(prefix + struct.pack(">I", 2**32 - 1))


def test_deep_nesting_is_refused():
    with pytest.raises(SummaryDecodeError):
        decode_summary(b"\x91" * 100_000 + b"\xc0")


def test_ext_types_and_trailing_bytes_are_refused():
    with pytest.raises(SummaryDecodeError):
        decode_summary(pack(msgpack.ExtType(5, b"abc")))
    with pytest.raises(SummaryDecodeError, match="not valid msgpack"):
        decode_summary(pack(good_obj()) + b"\x00")


def test_non_bytes_input_is_refused():
    with pytest.raises(SummaryDecodeError, match="must be bytes"):
        decode_summary({"v": 1})


def test_encoder_refuses_what_the_decoder_would_refuse():
    bad = RankSummary(0, 0, (1, 0), False, "cpu", [])
    with pytest.raises(ValueError):
        encode_summary(bad)
