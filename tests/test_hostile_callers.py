"""Any Ray client can call the coordinator: hostile arguments get a clear no, never a crash."""

import json
import os
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator import attach_coordinator
from tests.configs import profiler_config

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))


def deep(n):
    out = []
    for _ in range(n):
        out = [out]
    return out


HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, 2, -1, 2**31, 2**63 - 1, 2**63, 2**64, 10**12]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.binary(max_size=300),
    st.sampled_from(["t", "nobody", "../etc", "", "t" * 500, "run", "r\x00un"]),
    st.lists(st.integers(-5, 2**40), max_size=6),
    st.dictionaries(st.text(max_size=6), st.integers(), max_size=4),
    st.just(deep(150)),
    st.just(list(range(20_000))),
    st.just(b"\x93\x01\x02" * 1000),
)
# The public methods, each with its arity; every argument is drawn from HOSTILE.
METHODS = {
    "open_run": 2,
    "register": 5,
    "start": 3,
    "step": 4,
    "stop": 1,
    "request_capture": 5,
    "cancel_capture": 1,
    "kernel_summary": 6,
    "status": 1,
    "ranks": 4,
    "ingest_summary": 4,
    "ingest_partial": 3,
    "summary_failed": 5,
    "trace_stored": 5,
    "traces_stored": 3,
    "set_auto_capture": 1,
    "wait_window": 4,
    "ping": 0,
    "stacks": 6,
    "phase_times": 3,
    "step_series": 2,
    "tracker_figures": 1,
    "kernel_diff": 6,
    "pin_baseline": 1,
    "flush_record": 1,
    "attach_rank": 6,
    "rank_start": 4,
    "rank_status": 5,
    "memory": 2,
    "memory_snapshot": 2,
}
CALLS = st.sampled_from(sorted(METHODS)).flatmap(
    lambda m: st.tuples(st.just(m), st.lists(HOSTILE, min_size=METHODS[m], max_size=METHODS[m]))
)


@pytest.fixture(scope="module")
def target(ray_session, worker_pool, tmp_path_factory):
    """A live coordinator with trainer 't' registered (2 ranks) and stepping."""
    ray = ray_session
    tmp = tmp_path_factory.mktemp("hostile")
    cfg = profiler_config(tmp, wait=1, warmup=1, active=2, repeat=0, max_capture_steps=50)
    name = f"hostile-{uuid.uuid4().hex[:8]}"
    coord, _ = attach_coordinator(cfg, name=name, namespace="profiler-tests", trainer_id="t")
    workers = worker_pool.take(2)
    ray.get(coord.register.remote("t", workers))
    ray.get(coord.start.remote("t", 0))
    for k in range(3):
        ray.get(coord.step.remote("t", k))
    yield coord
    ray.kill(coord)
    worker_pool.give_back(workers)


class Invariants:
    def __init__(self):
        self.steps = {}  # run -> highest global step seen

    def check(self, ray, coord):
        st_ = ray.get(coord.status.remote(), timeout=60)  # alive, and answers
        json.dumps(st_)  # JSON-serialisable
        run, step = st_["run"]["name"], st_["global_step"]
        if step is not None:
            assert step >= self.steps.get(run, -1), "the global step went backwards"
            self.steps[run] = step
        spans = [w["steps"] for w in st_["windows"] if w["steps"]]
        assert all(a[1] < b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
        cur = st_["current_window"]
        if cur and spans:
            assert spans[-1][1] < cur["warmup_start"]
        return st_


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(calls=st.lists(CALLS, min_size=1, max_size=4))
def test_hostile_calls_get_a_clear_answer_and_leave_the_run_consistent(ray_session, target, calls):
    ray = ray_session
    inv = getattr(target, "_invariants", None) or Invariants()
    target._invariants = inv
    for method, args in calls:
        try:
            ray.get(getattr(target, method).remote(*args), timeout=20)
        except ray.exceptions.GetTimeoutError:
            assert method == "request_capture"  # waiting for a report is an answer too
        except ray.exceptions.RayTaskError as exc:
            cause = exc.as_instanceof_cause()
            assert isinstance(cause, ValueError), (method, args, exc)  # a clear error
            assert str(cause).strip()
        inv.check(ray, target)


def test_absurd_sizes_are_refused_with_a_reason(ray_session, target):
    ray = ray_session
    r = ray.get(target.request_capture.remote(active=10**12))
    assert not r["accepted"] and "max_capture_steps" in r["reason"]
    r = ray.get(target.request_capture.remote(active=1, warmup=60))
    assert not r["accepted"] and "max_capture_steps" in r["reason"]
    with pytest.raises(ValueError, match=r"worker rank int 1180591620717411303424 is not an int"):
        ray.get(target.register.remote("t2", {2**70: target}))
    r = ray.get(target.start.remote("t", 2**70))
    assert not r["applied"] and "first_step must be an int in 0..2**63-1" in r["reason"]
    r = ray.get(target.step.remote("t", float("nan")))
    assert not r["applied"] and "step must be an int" in r["reason"]
    with pytest.raises(ValueError, match="are not Ray actor handles"):
        ray.get(target.register.remote("t3", ["not a handle"]))


def test_a_100_mb_garbage_summary_is_refused_before_it_is_decoded(ray_session, target):
    ray = ray_session
    pid = ray.get(target.status.remote())["process"]["pid"]

    def rss_mb():
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    before = ray.get(target.status.remote())["counters"]
    assert ray.get(target.ingest_summary.remote("t", 0, os.urandom(100 << 20))) is True
    after = ray.get(target.status.remote())
    c = after["counters"]
    assert c.get("refused_ingest_summary", 0) == before.get("refused_ingest_summary", 0) + 1
    assert c.get("bad_summaries", 0) == before.get("bad_summaries", 0)  # never decoded
    assert all(0 not in w["summaries_pending"] for w in after["windows"])
    assert rss_mb() < 400  # the coordinator did not keep it


def test_oversized_or_malformed_node_partials_are_refused_and_nothing_changes(ray_session, target):
    ray = ray_session
    before = ray.get(target.status.remote())["counters"]
    assert ray.get(target.ingest_partial.remote("t", os.urandom(40 << 20))) is True
    assert ray.get(target.ingest_partial.remote("t", b"\x93garbage")) is False  # ranks resend
    assert ray.get(target.ingest_partial.remote("t", "not bytes")) is True
    c = ray.get(target.status.remote())["counters"]
    assert c["refused_ingest_partial"] == before.get("refused_ingest_partial", 0) + 2
    assert c["bad_partials"] == before.get("bad_partials", 0) + 1
    assert c.get("partials", 0) == before.get("partials", 0)


def test_a_batch_of_trace_reports_is_judged_report_by_report_as_single_ones(ray_session, target):
    ray = ray_session
    windows = ray.get(target.status.remote())["windows"]
    w = windows[0]["index"] if windows else 0
    reports = [
        {"rank": 0, "window": w, "path": "/tmp/x/rank0.pt.trace.json.gz", "node": "n"},
        {"rank": 1, "window": w, "path": None, "error": {"where": "upload", "message": "denied"}},
        {"rank": 99, "window": w, "path": "/x"},  # no such rank
        {"rank": 0, "window": "zero", "path": "/x"},  # not a window
        "not a dict",
        {"rank": -1},
    ]
    batch = ray.get(target.traces_stored.remote("t", reports))
    one_by_one = [
        ray.get(
            target.trace_stored.remote(
                "t",
                r.get("rank"),
                r.get("window"),
                r.get("path"),
                r.get("error"),
                local_path=r.get("local_path"),
                node=r.get("node"),
            )
        )
        if isinstance(r, dict)
        else False
        for r in reports
    ]
    assert batch == one_by_one and batch[2:] == [False] * 4
    before = ray.get(target.status.remote())["counters"].get("refused_traces_stored", 0)
    assert ray.get(target.traces_stored.remote("t", {"rank": 0})) == []
    assert ray.get(target.traces_stored.remote("t", [{}] * 5000)) == []  # over the bound
    c = ray.get(target.status.remote())["counters"]
    assert c["refused_traces_stored"] == before + 2
