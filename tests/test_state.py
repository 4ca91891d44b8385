"""CoordinatorState on its own: the bookkeeping of one run, without Ray (milliseconds each)."""

import pytest

from coordinator.core.records import TrainerRecord
from coordinator.core.schedule import Window
from coordinator.core.state import CoordinatorState, kernel_summary
from coordinator.protocol.summary_codec import Breakdown, KernelRow, RankSummary, encode_summary

W0 = Window(0, 1, 2, 3)


def state(world=4, selected=(0, 1), **kw):
    st = CoordinatorState(max_windows=kw.pop("max_windows", 8), **kw)
    keys = st.register(
        TrainerRecord("t", "policy", list(range(world)), {}, None), None, selected.__contains__
    )
    return st, keys


def blob(rank, window=0, us=10.0):
    s = RankSummary(rank, window, (2, 3), False, "cpu", [KernelRow("aten::mm", us, 2, 0)])
    s.breakdown = Breakdown(compute_us=us, window_us=2 * us)
    return encode_summary(s)


def closed_reply(window=0, pending=(), steps=(2, 3)):
    return {
        "state": "ok",
        "closed": {"window": window, "steps": list(steps), "partial": False, "trace_path": None},
        "summaries_pending": list(pending),
    }


def test_the_first_trainer_steps_and_a_later_one_takes_over_only_when_asked():
    st, keys = state()
    assert st.stepping_trainer == "t" and keys == [("t", 0), ("t", 1)]
    st.register(TrainerRecord("gen", "rollout", [0], {}, None), None, lambda r: False)
    assert st.stepping_trainer == "t"
    st.register(TrainerRecord("gen", "rollout", [0], {}, None), True, lambda r: False)
    assert st.stepping_trainer == "gen" and st.counters["registrations"] == 3


def test_registering_again_replaces_the_ranks_records():
    st, _ = state(world=4)
    st.rank_failed(("t", 0), "lost", {"where": "x", "type": "X", "message": "gone"})
    st.register(TrainerRecord("t", "policy", [0, 1], {}, None), None, lambda r: True)
    assert sorted(st.ranks) == [("t", 0), ("t", 1)] and st.ranks[("t", 0)].state == "ok"


def test_a_closing_reply_with_a_pending_summary_waits_for_it_and_the_push_ends_the_wait():
    st, keys = state()
    rec = st.open_window(W0, keys)
    st.apply_reply(("t", 0), closed_reply(pending=[0]))
    st.apply_reply(("t", 1), closed_reply())
    st.close_window(rec)
    assert rec.steps == (2, 3) and rec.summaries_pending == {("t", 0)}
    st.ingest_summary(("t", 0), blob(0))
    assert rec.summaries_pending == set() and rec.aggregates["t"].ranks == [0]
    assert rec.to_dict()["summaries_pending"] == [] and rec.to_dict()["kept"]


def test_a_summary_pushed_before_the_closing_reply_is_not_waited_for():
    st, keys = state()
    rec = st.open_window(W0, keys)
    st.ingest_summary(("t", 0), blob(0))
    st.apply_reply(("t", 0), closed_reply(pending=[0]))
    assert rec.summaries_pending == set()


def test_a_malformed_reply_disables_only_that_rank():
    st, keys = state()
    st.open_window(W0, keys)
    st.apply_reply(("t", 0), ["not", "a", "reply"])
    assert st.ranks[("t", 0)].state == "disabled" and st.ranks[("t", 1)].state == "ok"
    assert "malformed reply" in st.ranks[("t", 0)].reason["message"]


def test_a_rank_that_lost_its_config_is_disabled_with_a_reason():
    st, _ = state()
    st.apply_reply(("t", 1), {"state": "not_configured"})
    rank = st.ranks[("t", 1)]
    assert rank.state == "disabled" and rank.reason["type"] == "NotConfigured"


def test_a_bad_summary_marks_that_rank_bad_for_the_window_and_nothing_else():
    st, keys = state()
    rec = st.open_window(W0, keys)
    st.ingest_summary(("t", 0), b"\x93garbage")
    st.ingest_summary(("t", 1), blob(1))
    agg = rec.aggregates["t"]
    assert list(agg.bad_ranks) == [0] and agg.ranks == [1]
    assert st.counters["bad_summaries"] == 1


def test_summaries_of_unknown_windows_or_other_ranks_are_counted_not_kept():
    st, keys = state()
    st.open_window(W0, keys)
    st.ingest_summary(("t", 0), blob(0, window=5))
    st.ingest_summary(("t", 0), blob(1))  # rank 0 pushing rank 1's summary
    assert st.counters["unexpected_summaries"] == 2


def test_a_lost_summary_from_a_dead_agent_names_where_the_trace_stays():
    st, keys = state()
    rec = st.open_window(W0, keys)
    why = {"where": "agent", "type": "RayActorError", "message": "died", "trace_path": "/t/r0"}
    assert st.summary_failed(("t", 0), 0, why)
    assert rec.traces[("t", 0)]["path"] == "/t/r0" and rec.traces[("t", 0)]["error"]
    assert st.counters["lost_summaries"] == 1 and st.ranks[("t", 0)].last_agent_error
    assert not st.summary_failed(("t", 0), 9, why)  # a window this run does not know


def test_a_failed_rank_is_no_longer_waited_for():
    st, keys = state()
    rec = st.open_window(W0, keys)
    st.apply_reply(("t", 0), closed_reply(pending=[0]))
    st.rank_failed(("t", 0), "lost", {"where": "profile_step", "type": "X", "message": "x"})
    assert rec.summaries_pending == set() and st.ranks[("t", 0)].state == "lost"
    st.rank_failed(("t", 0), "disabled", {"where": "y", "type": "Y", "message": "later"})
    assert (
        st.ranks[("t", 0)].state == "lost" and st.ranks[("t", 0)].reason["where"] == "profile_step"
    )


def test_trace_reports_for_unknown_windows_change_nothing():
    st, keys = state()
    assert not st.trace_stored(("t", 0), 3, "/x", None)
    assert st.counters["unexpected_trace_reports"] == 1


def test_history_is_bounded_and_old_windows_drop_their_detail():
    st, keys = state(max_windows=2, detail_windows=1)
    for i in range(4):
        rec = st.open_window(Window(i, i * 10, i * 10 + 1, i * 10 + 2), keys)
        st.ingest_summary(("t", 0), blob(0, window=i))
        st.close_window(rec)
    assert [w.window.index for w in st.closed_windows()] == [2, 3]
    assert st.counters["windows_evicted"] == 2
    assert st.windows[2].aggregates["t"].per_rank(["aten::mm"]) is None
    assert st.windows[3].aggregates["t"].per_rank(["aten::mm"]) == {"aten::mm": {0: 10.0}}


def test_a_window_cut_short_says_why_it_did_not_keep_its_promise():
    st, keys = state()
    rec = st.open_window(W0, keys)
    st.apply_reply(("t", 0), closed_reply(steps=(2, 2)))
    rec.partial, rec.stopped_at = True, 2
    kept, why = rec.promise()
    assert not kept and why == "the run stopped at step 2 inside the window: recorded 2-2 of 2-3"


def test_kernel_summary_of_a_window_no_longer_kept_lists_what_is_kept():
    st, keys = state()
    rec = st.open_window(W0, keys)
    st.close_window(rec)
    with pytest.raises(ValueError, match=r"no window 7: the closed windows kept are \[0\]"):
        kernel_summary(st, 7, 10, None)
    assert kernel_summary(st, None, 10, None)["window"] == 0


def through_the_store(st):
    """``st`` as a restarted coordinator reads it back: its windows and ranks through the
    store's codec (``record_codec``, ``state_codec``)."""
    import collections

    import msgspec

    from coordinator.core import record_codec as codec
    from coordinator.core import state_codec as sc
    from coordinator.core.state import CoordinatorState

    back = CoordinatorState(st.max_windows, st.detail_windows, st.straggler_threshold)
    back.windows = collections.OrderedDict(
        (i, codec.window_record(codec.decode(codec.encode(codec.window_file("r", w)))))
        for i, w in st.windows.items()
    )
    back.ranks = {
        k: sc.rank_record(msgspec.msgpack.decode(msgspec.msgpack.encode(r), type=sc.RankFile))
        for k, r in st.ranks.items()
    }  # fmt: skip
    back.trainers, back.stepping_trainer = dict(st.trainers), st.stepping_trainer
    back.counters, back.global_step = collections.Counter(st.counters), st.global_step
    return back


def test_a_pending_summary_ends_by_a_later_reply_after_a_checkpoint_restore():
    st, keys = state()
    rec = st.open_window(W0, keys)
    st.apply_reply(("t", 0), closed_reply(pending=[0]))
    st.apply_reply(("t", 1), closed_reply())
    st.close_window(rec)
    assert rec.summaries_pending == {("t", 0)}
    restored = through_the_store(st)
    restored.apply_reply(("t", 0), {"state": "ok", "summaries_pending": []})  # lost, not pending
    assert restored.windows[0].summaries_pending == set()
    st.apply_reply(("t", 0), {"state": "ok", "summaries_pending": [0]})  # still being built
    assert st.windows[0].summaries_pending == {("t", 0)}


def _fresh(rec, complete):
    """``rec.to_dict(complete)`` built from nothing (the cache of role parts dropped)."""
    rec.__dict__.pop("_parts_cache", None)
    return rec.to_dict(complete)


def test_a_window_s_entry_is_built_once_and_rebuilt_whenever_anything_in_it_changes():
    import random

    from coordinator.core import record_codec as codec

    rng = random.Random(7)
    st, keys = state(world=12, selected=tuple(range(12)))
    rec = st.open_window(W0, keys)
    ops = [
        lambda k: st.apply_reply(k, closed_reply(pending=[0] if k[1] % 2 else [])),
        lambda k: st.ingest_summary(k, blob(k[1], us=rng.uniform(1, 30))),
        lambda k: st.trace_stored(k, 0, f"/t/{k[1]}", rng.choice([None, {"message": "x"}])),
        lambda k: st.summary_failed(k, 0, {"where": "agent", "type": "E", "message": "m"}),
        lambda k: st.rank_failed(k, "lost", {"where": "x", "type": "X", "message": "gone"}),
        lambda k: st.close_window(rec),
    ]
    for _ in range(200):  # every entry read after a change equals one built from nothing
        rng.choice(ops)(rng.choice(keys))
        for complete in (True, False):
            cached = rec.to_dict(complete)
            assert rec.to_dict(complete) == cached == _fresh(rec, complete)
    rec.to_dict(True)
    assert "_parts_cache" in rec.__dict__
    loaded = codec.window_record(codec.decode(codec.encode(codec.window_file("r", rec))))
    assert "_parts_cache" not in loaded.__dict__ and loaded.to_dict() == rec.to_dict()


def test_a_trace_reported_again_over_a_settled_window_shows_in_its_entry():
    st, keys = state()
    rec = st.open_window(W0, keys)
    for k in keys:
        st.apply_reply(k, closed_reply())
        st.trace_stored(k, 0, f"/t/{k[1]}", None)
    st.close_window(rec)
    assert rec.to_dict()["trace_errors"] == {}
    st.trace_stored(keys[0], 0, "/t/0", {"where": "upload", "message": "denied"})
    assert rec.to_dict()["trace_errors"] == {0: {"where": "upload", "message": "denied"}}


def test_a_window_s_entry_follows_summaries_pushed_early_and_stragglers_found_later():
    from coordinator.core.aggregate import CHEAP_RANKS

    n = CHEAP_RANKS + 4
    st, keys = state(world=n, selected=tuple(range(n)))
    rec = st.open_window(W0, keys)
    st.ingest_summary(keys[0], blob(0))  # before any closing reply: nothing else changes
    assert rec.to_dict()["roles"]["t"]["busy_ms_per_step"] == 0.005
    for k in keys[1:]:
        st.ingest_summary(k, blob(k[1], us=500.0 if k[1] == 3 else 10.0))
    for k in keys:
        st.apply_reply(k, closed_reply())
    st.close_window(rec)
    assert rec.to_dict()["stragglers"] == []  # too many ranks to find them on the loop
    kernel_summary(st, 0, 5, None)  # a table finds them (off the loop in the actor) and keeps them
    assert rec.to_dict()["stragglers"] == [3]


def test_rank_counts_are_kept_until_a_rank_changes_and_never_checkpointed():
    from coordinator.core import state_codec as sc
    from coordinator.core.config import ProfilerConfig
    from coordinator.core.run import new_run
    from coordinator.core.state import rank_counts

    st, keys = state(world=4, selected=(0, 1, 2))
    assert rank_counts(st) == {"ok": 3, "not_selected": 1}
    st.rank_failed(keys[0], "lost", {"where": "ray", "type": "Died", "message": "gone"})
    assert rank_counts(st) == {"ok": 2, "lost": 1, "not_selected": 1}
    st.apply_reply(keys[1], {"state": "disabled", "reason": {"where": "rank", "type": "X"}})
    assert rank_counts(st) == {"ok": 1, "lost": 1, "disabled": 1, "not_selected": 1}
    counts = rank_counts(st)
    counts["ok"] = 99  # a copy: the caller cannot change what is kept
    assert rank_counts(st)["ok"] == 1
    run = new_run(ProfilerConfig.from_dict({"enable": True, "save_path": "/r"}, False), set())
    run.state = st
    assert "_rank_counts" in st.__dict__
    assert "rank_counts" not in sc.RunState.__struct_fields__  # (made again from the ranks)
    back = new_run(run.config, set())
    sc.apply_state(back, sc.run_state(run, 0))
    assert "_rank_counts" not in back.state.__dict__


def test_a_window_s_parts_made_from_a_snapshot_are_kept_only_while_nothing_changed():
    """``status()`` makes a large window's parts from a snapshot off the event loop: the same
    parts as on the loop, kept for later calls unless the window changed meanwhile."""
    st, keys = state(world=12, selected=tuple(range(12)))
    rec = st.open_window(W0, keys)
    for k in keys[:6]:
        st.ingest_summary(k, blob(k[1], us=5.0 + k[1]))
    st.close_window(rec)
    for complete in (True, False):
        rec.__dict__.pop("_parts_cache", None)
        snap = rec.snapshot()
        made = snap._role_parts(complete)
        assert not rec.parts_kept(complete)
        rec.keep_parts_of(snap)
        assert rec.parts_kept(complete) and rec.to_dict(complete, made) == _fresh(rec, complete)
    rec.__dict__.pop("_parts_cache", None)
    snap = rec.snapshot()
    stale = snap._role_parts(True)
    st.ingest_summary(keys[7], blob(7, us=3.0))  # the window changes meanwhile
    rec.keep_parts_of(snap)
    assert not rec.parts_kept(True) and rec.to_dict(True)["roles"] != stale


def test_a_cuda_rank_s_launch_bound_steps_show_in_status():
    from coordinator.protocol.summary_codec import LaunchRow

    st, keys = state()
    rec = st.open_window(W0, keys)
    for k in keys:
        s = RankSummary(k[1], 0, (2, 3), False, "cuda", [KernelRow("gemm", 10.0, 2, 0)])
        s.breakdown = Breakdown(compute_us=10.0, window_us=40.0)
        if k[1] == 1:
            s.launch, s.launch_bound = LaunchRow(30, 2.0, 5.0, 0.9), [3]
        st.ingest_summary(k, encode_summary(s))
        st.apply_reply(k, closed_reply())
    st.close_window(rec)
    entry = rec.to_dict()
    assert entry["launch_bound"] == [1] and entry["roles"]["t"]["launch_bound"] == [1]
    ks = kernel_summary(st, 0, 5, None)
    assert ks["stragglers"]["ranks"][1]["launch_bound"] == [3]
    assert ks["launch"][1]["short_share"] == 0.9
