"""Stacks made readable (parsing, grouping, the culprit), the watchdog's clock, and the checks on
what crosses Ray: pure, in milliseconds."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as hs

from coordinator.core.config import ProfilerConfig
from coordinator.core.stack_report import Whom, stack_entry, stacks_reply
from coordinator.core.stacks import (
    main_thread,
    parse_faulthandler,
    parse_py_spy,
    ranges,
    short_stack,
    stack_kind,
)
from coordinator.core.stall_watch import MAX_TAKES, StallWatch
from coordinator.core.validate import checked_driver
from coordinator.protocol.stack_replies import ProcessStack, StackFrame
from worker_ext.agent.stack_reader import check_request

SITE = "/venv/lib/python3.11/site-packages"
RAY_LOOP = [
    {"function": "main_loop", "file": f"{SITE}/ray/_private/worker.py", "line": 946},
    {"function": "<module>", "file": f"{SITE}/ray/_private/workers/default_worker.py", "line": 9},
]
RAY_TASK = [
    {
        "function": "actor_method_executor",
        "file": f"{SITE}/ray/_private/function_manager.py",
        "line": 1,
    },
    *RAY_LOOP,
]


def frames(*names: str, file: str = "/job/train.py") -> list[StackFrame]:
    return [{"function": n, "file": file, "line": i + 1} for i, n in enumerate(names)]


COLLECTIVE = [
    {
        "function": "all_reduce",
        "file": f"{SITE}/torch/distributed/distributed_c10d.py",
        "line": 2950,
    },
    {"function": "wrapper", "file": f"{SITE}/torch/distributed/c10d_logger.py", "line": 81},
    *frames("_update", "train"),
    *RAY_TASK,
]
HUNG = [*frames("slow_loader", "load_batch", "train"), *RAY_TASK]


def got(pid: int, stack: list[StackFrame], method="py-spy") -> ProcessStack:
    return {
        "pid": pid,
        "method": method,
        "threads": [
            {"thread": "0x1", "name": "helper", "main": False, "active": False, "frames": RAY_LOOP},
            {"thread": "0x2", "name": "MainThread", "main": True, "active": True, "frames": stack},
        ],
        "error": None,
        "tried": [],
        "taken_at": 0.0,
        "read_ms": 1.0,
        "flight_recorder": None,
    }


def test_identical_stacks_group_and_the_rank_outside_the_collective_is_named():
    entries = [
        stack_entry(
            Whom("rank", "sft", "policy", r),
            got(100 + r, HUNG if r == 1 else COLLECTIVE),
            None,
            False,
        )
        for r in range(16)
    ]
    reply = stacks_reply(entries, 0.0, 0.1, False, "auto")
    assert reply["lines"] == [
        "rank 1 (1): slow_loader <- load_batch <- train  <- likely culprit",
        "ranks 0, 2-15 (15): all_reduce <- _update <- train",
    ]
    assert (
        reply["culprit"]
        == "likely culprit: rank 1 in slow_loader (while 15 ranks of sft wait in a collective)"
    )
    assert [g["kind"] for g in reply["groups"]] == ["other", "collective"]
    assert entries[0]["threads"] is None and reply["unreadable"] == []


def test_culprits_in_two_trainers_each_get_their_own_count_of_waiting_ranks():
    sft = [
        stack_entry(
            Whom("rank", "sft", "policy", r), got(r, HUNG if r == 0 else COLLECTIVE), None, False
        )
        for r in range(4)
    ]
    gen = [
        stack_entry(
            Whom("rank", "gen", "rollout", r),
            got(10 + r, RAY_LOOP if r == 1 else COLLECTIVE),
            None,
            False,
        )
        for r in range(3)
    ]
    reply = stacks_reply(sft + gen, 0.0, 0.1, False, "auto")
    assert reply["culprit"] == (  # the groups' order: smallest first
        "likely culprit: rank 1 in main_loop (while 2 ranks of gen wait in a collective); "
        "rank 0 in slow_loader (while 3 ranks of sft wait in a collective)"
    )


def test_no_culprit_without_a_collective_and_other_trainers_never_blamed():
    a = [stack_entry(Whom("rank", "sft", "policy", r), got(r, HUNG), None, False) for r in range(2)]
    b = [stack_entry(Whom("rank", "gen", "rollout", 0), got(9, RAY_LOOP), None, False)]
    w = [stack_entry(Whom("rank", "sft2", "policy", 0), got(7, COLLECTIVE), None, False)]
    reply = stacks_reply(a + b + w, 0.0, 0.1, False, "auto")
    assert reply["culprit"] is None
    assert {g["trainer_id"]: g["kind"] for g in reply["groups"]} == {
        "sft": "other",
        "gen": "idle",
        "sft2": "collective",
    }


def test_an_idle_rank_beside_ranks_in_a_collective_is_the_culprit():
    entries = [
        stack_entry(
            Whom("rank", "sft", "policy", r),
            got(r, RAY_LOOP if r == 3 else COLLECTIVE),
            None,
            False,
        )
        for r in range(4)
    ]
    reply = stacks_reply(entries, 0.0, 0.1, False, "auto")
    assert reply["groups"][0]["ranks"] == [3] and reply["groups"][0]["culprit"]
    assert reply["groups"][0]["kind"] == "idle"


def test_unreadable_processes_say_why_and_a_driver_is_listed_apart():
    entries = [
        stack_entry(Whom("rank", "sft", "policy", 0, error="exited (killed)"), None, None, False),
        stack_entry(Whom("rank", "sft", "policy", 1), None, "node abc unreachable", False),
        stack_entry(
            Whom("driver", "sft", "policy", None), got(5, frames("get", "run_sft")), None, True
        ),
    ]
    reply = stacks_reply(entries, 0.0, 0.1, False, "auto")
    assert reply["lines"] == [
        "sft driver (1): get <- run_sft",
        "sft rank 0: no stack: exited (killed)",
        "sft rank 1: no stack: node abc unreachable",
    ]
    assert entries[2]["threads"] is not None and len(entries[2]["threads"]) == 2
    json.dumps(reply)  # it crosses Ray and lands in files: plain JSON


def test_py_spy_json_and_faulthandler_text_parse_to_the_same_stack():
    spy = json.dumps(
        [
            {
                "thread_id": 7,
                "thread_name": "MainThread",
                "active": True,
                "frames": [
                    {"name": "Loader.slow", "filename": "/job/a.py", "line": 3},
                    {"name": "train", "filename": "/job/a.py", "line": 9},
                ],
            }
        ]
    )
    text = (
        "# ray-profiler faulthandler pid=1\n"
        "Thread 0x0000000000000009 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n\n'
        "Current thread 0x0000000000000007 (most recent call first):\n"
        '  File "/job/a.py", line 3 in slow\n'
        '  File "/job/a.py", line 9 in train\n'
    )
    a, b = parse_py_spy(spy), parse_faulthandler(text, main_thread=7)
    assert [t["main"] for t in b] == [False, True]
    ta, tb = main_thread(a), main_thread(b)
    assert ta is not None and tb is not None
    assert short_stack(ta["frames"]) == short_stack(tb["frames"]) == "slow <- train"
    with pytest.raises(ValueError):
        parse_faulthandler("nothing here", None)
    with pytest.raises(ValueError):
        parse_py_spy('{"not": "a list"}')


def test_an_async_actor_s_stack_is_its_busy_thread_not_the_idle_main_thread():
    busy = frames("generate", "handle")
    threads = got(1, RAY_LOOP)["threads"]
    threads.append(
        {"thread": "0x3", "name": "AsyncIO Thread", "main": False, "active": True, "frames": busy}
    )
    chosen = main_thread(threads)
    assert chosen is not None and chosen["frames"] == busy


def test_native_gloo_and_nccl_waits_count_as_collectives():
    native = [
        {
            "function": "gloo::transport::tcp::UnboundBuffer::waitRecv",
            "file": "libgloo.so",
            "line": 0,
        }
    ]
    assert stack_kind(native + frames("train")) == "collective"
    assert stack_kind(frames("all_reduce")) == "other"  # not torch.distributed's own


@given(hs.lists(hs.integers(0, 300), max_size=60))
def test_ranges_list_every_rank_once(ranks):
    text = ranges(ranks, shown=10_000)
    back = []
    for part in filter(None, text.split(", ")):
        a, _, b = part.partition("-")
        back.extend(range(int(a), int(b or a) + 1))
    assert back == sorted(set(ranks))


def test_the_watchdog_fires_once_then_backs_off_then_resumes():
    w = StallWatch(factor=5.0, min_s=2.0)
    assert w.due(1e9) is None  # no step yet: no stall
    for k in range(10):
        w.observe(k, float(k))  # 1 s steps: threshold 5 s
    assert w.threshold_s() == 5.0 and w.due(13.9) is None and w.due(14.0) == "stall"
    w.took(14.0)
    times = []
    t = 14.0
    while (t := t + 1.0) < 5000 and w.takes < MAX_TAKES:
        if w.due(t) == "retake":
            w.took(t)
            times.append(t)
    gaps = [b - a for a, b in zip([14.0, *times], times, strict=False)]
    assert gaps[:4] == [5.0, 10.0, 20.0, 40.0] and w.takes == MAX_TAKES
    assert w.due(1e6) is None  # no more than MAX_TAKES
    assert w.observe(10, 5000.0) and w.resumed == (10, 5000.0) and w.due(5001.0) is None


def test_stall_fields_are_validated_like_the_rest():
    cfg = ProfilerConfig.from_dict({"stall_factor": 3, "stall_min_s": 5.5, "stall_watch": False})
    assert (cfg.stall_factor, cfg.stall_min_s, cfg.stall_watch) == (3, 5.5, False)
    assert (ProfilerConfig().stall_factor, ProfilerConfig().stall_min_s) == (5.0, 60.0)
    for bad in (
        {"stall_factor": None},
        {"stall_factor": 0.5},
        {"stall_min_s": 0},
        {"stall_watch": "yes"},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ProfilerConfig.from_dict(bad)


@pytest.mark.parametrize(
    "driver",
    [
        "pid",
        {"pid": -1, "node_id": "n"},
        {"pid": 1, "node_id": ""},
        {"pid": 1, "node_id": "n", "extra": 1},
        {"pid": 1, "node_id": "n", "dump": {"signal": [1]}},
        {"pid": True, "node_id": "n"},
    ],
)
def test_a_bad_driver_is_refused_with_a_reason(driver):
    with pytest.raises(ValueError, match="driver"):
        checked_driver(driver)


@pytest.mark.parametrize(
    "req",
    [
        None,
        {"targets": "x"},
        {"targets": [{"pid": 0}]},
        {"targets": [{"pid": 1, "dump": 3}]},
        {"targets": [], "native": 1, "method": "auto", "at": 0, "timeout_s": 1},
        {"targets": [], "native": False, "method": "gdb", "at": 0, "timeout_s": 1},
        {"targets": [], "native": False, "method": "auto", "at": 0, "timeout_s": 1e9},
        {"targets": [], "native": False, "method": "auto", "at": "now", "timeout_s": 1},
    ],
)
def test_a_malformed_stack_request_is_refused(req):
    with pytest.raises(ValueError):
        check_request(req)


def test_stacks_of_nobody_are_refused_with_what_is_registered():
    from types import SimpleNamespace

    from coordinator.service.stacks import unknown_whom

    trainers = {
        "sft": SimpleNamespace(trainer_id="sft", handles={0: "h", 1: "h"}),
        "gen": SimpleNamespace(trainer_id="gen", handles={0: "h", 5: "h"}),
    }
    assert unknown_whom(trainers, None, None) is None
    assert unknown_whom(trainers, [0, 5], None) is None  # ranks of any trainer
    assert unknown_whom(trainers, [1], "sft") is None
    assert (
        unknown_whom(trainers, None, "x")
        == "no trainer 'x' is registered; registered: ['gen', 'sft']"
    )
    assert unknown_whom(trainers, [5], "sft") == (
        "ranks [5] not registered by trainer 'sft' (registered ranks: [0, 1])"
    )
    assert unknown_whom(trainers, [], None) == (
        "ranks is an empty list: give None for every rank (registered ranks: [0, 1, 5])"
    )
    assert unknown_whom({}, None, None) is None  # the watchdog before any registration
