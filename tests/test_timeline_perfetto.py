"""A merged timeline imports clean in Perfetto (issue 54, item 6): real torch.profiler traces
whose step is counted by the optimizer's hook, as an attached job's is (``ProfilerStep#N``
ends inside ``Optimizer.step``), merged, then loaded in the Perfetto that ``ray-profiler
serve`` serves, in Debian's headless Chromium, and its import stats read from its trace
processor, which runs in the page."""

from __future__ import annotations

import base64
import gzip
import json
import time
from collections import defaultdict

import pytest

from coordinator.core.timeline import RankLabel
from coordinator.ops.timeline import write_timeline

LOST = """async () => {
  const trace = window.app.trace;
  if (!trace) return null;
  const stats = await trace.engine.query(
    "select name, severity, value from stats " +
    "where severity in ('error', 'data_loss') and value > 0 order by name");
  const rows = [];
  for (const it = stats.iter({}); it.valid(); it.next())
    rows.push([it.name, it.severity, Number(it.value)]);
  const slices = await trace.engine.query("select count(*) as n from slice");
  const flowStats = await trace.engine.query(
    "select name, value from stats where name like 'flow%' and value > 0 order by name");
  const flowLost = [];
  for (const it = flowStats.iter({}); it.valid(); it.next())
    flowLost.push([it.name, Number(it.value)]);
  const flows = await trace.engine.query(
    "select o.name as out_name, o.ts as out_ts, i.name as in_name, i.ts as in_ts " +
    "from flow f join slice o on f.slice_out = o.id join slice i on f.slice_in = i.id");
  const arrows = [];
  for (const it = flows.iter({}); it.valid(); it.next())
    arrows.push([it.out_name, Number(it.out_ts), it.in_name, Number(it.in_ts)]);
  return {lost: rows, slices: Number(slices.firstRow({}).n), flow_stats: flowLost, arrows};
}"""
"""Perfetto's import errors and data losses (its ``#!/info`` page lists the same table), the
slices it kept, its flow stats that are not zero, and each arrow's two slices (name, ns);
null until the trace is loaded."""
OPEN = """([b64, name]) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  window.app.openTraceFromFile(new File([bytes], name));
}"""


def hooked_trace(path: str) -> str:
    """A real trace of a small training loop whose profiler steps in the optimizer's step
    hook: the step spans and the optimizer's spans overlap without nesting. Every other step
    runs its forward and backward in a closure that the optimizer's step calls, so autograd's
    ``fwdbwd`` arrows start and end inside the optimizer's spans, as well as outside them."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters())
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=1, active=3, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(path),
    ) as prof:
        hook = opt.register_step_post_hook(lambda *_: prof.step())

        def closure() -> torch.Tensor:
            loss = model(torch.randn(32, 64)).sum()
            loss.backward()
            return loss

        for i in range(6):
            if i % 2:
                opt.step(closure)
            else:
                closure()
                opt.step()
            opt.zero_grad()
        hook.remove()
    return path


def partial_overlaps(events: list[dict]) -> int:
    """Complete events that start inside another of their track and end after it (what
    Perfetto drops), in whole nanoseconds as it reads them."""
    tracks: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            start = round(e["ts"] * 1000)
            tracks[(e["pid"], e["tid"])].append((start, start + round(e["dur"] * 1000)))
    bad = 0
    for spans in tracks.values():
        open_: list[int] = []  # the open spans' ends, innermost last
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ and open_[-1] <= start:
                open_.pop()
            bad += bool(open_) and end > open_[-1]
            open_.append(end)
    return bad


@pytest.fixture(scope="module")
def attached_window(tmp_path_factory):
    """Two ranks' real traces of one window, and their merged timeline."""
    where = tmp_path_factory.mktemp("attached")
    traces = [hooked_trace(str(where / f"rank{r}.pt.trace.json")) for r in (0, 1)]
    out = str(where / "window.json.gz")
    labels = [RankLabel(rank=r, role="policy", node="n1") for r in (0, 1)]
    write_timeline(list(zip(labels, traces, strict=True)), out)
    return traces, out


def slices(events: list[dict]) -> int:
    """The slices Perfetto makes of ``events``: one per complete or instant event."""
    return sum(e["ph"] in ("X", "i") for e in events)


def _events(path: str) -> list[dict]:
    with gzip.open(path) if path.endswith(".gz") else open(path, "rb") as f:
        return json.load(f)["traceEvents"]


def test_events_that_cannot_nest_go_to_a_lane_of_their_thread_and_none_is_lost(attached_window):
    traces, out = attached_window
    raw = [_events(t) for t in traces]
    assert all(partial_overlaps(events) > 0 for events in raw)  # the real case reproduces
    merged = _events(out)
    assert partial_overlaps(merged) == 0
    timed = sum(e["ph"] == "X" for e in merged)
    assert timed == sum(e["ph"] == "X" for events in raw for e in events)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in merged if e["name"] == "thread_name"}
    lanes = [n for n in names.values() if n.endswith(" · lane 2")]
    assert len(lanes) == 2, names  # one per rank, named for its thread
    optimizer = {(e["pid"], e["tid"]) for e in merged if e["name"].startswith("Optimizer.step")}
    assert {names[t] for t in optimizer} <= set(lanes)


@pytest.mark.subprocess
def test_the_merged_timeline_imports_in_the_served_perfetto_with_no_error_and_no_loss(
    attached_window,
):
    from coordinator.ops.web.server import CoordinatorLink
    from tests.test_web import ServerThread, chromium_browser

    traces, out = attached_window
    web = ServerThread(CoordinatorLink("no-coordinator", "profiler-tests"))  # Perfetto alone
    try:
        with chromium_browser() as browser:
            # the control: one rank's own trace, as torch wrote it, loses its overlaps
            raw = perfetto_import(browser, web.url, traces[0])
            assert [n for n, _, _ in raw["lost"]] == ["slice_drop_overlapping_complete_event"]
            assert raw["slices"] < slices(_events(traces[0]))
            got = perfetto_import(browser, web.url, out)
    finally:
        web.close()
    assert got["lost"] == [] and got["flow_stats"] == []
    merged = _events(out)
    assert got["slices"] == slices(merged)  # every complete and instant event
    # every arrow kept, and bound to the op that starts where it does (torch's fwdbwd starts
    # at the forward op and ends at its backward op), inside a lane or not
    assert sorted(a[1] for a in got["arrows"]) == at_ns(merged, "s")
    assert sorted(a[3] for a in got["arrows"]) == at_ns(merged, "f")
    outer = ("ProfilerStep#", "Optimizer.step")
    assert not [a for a in got["arrows"] if a[0].startswith(outer) or a[2].startswith(outer)]


def at_ns(events: list[dict], ph: str) -> list[int]:
    """The times of the flow events of phase ``ph``, in nanoseconds as Perfetto reads them."""
    return sorted(round(e["ts"] * 1000) for e in events if e["ph"] == ph)


def perfetto_import(browser, url: str, path: str, timeout_s: float = 120.0) -> dict:
    """Load ``path`` in a new page of the Perfetto served at ``url``: its import errors and
    data losses, and its slice count."""
    page = browser.new_page()
    try:
        page.goto(url + "/perfetto/")
        deadline = time.monotonic() + timeout_s
        while not page.evaluate("() => !!(window.app && window.app.openTraceFromFile)"):
            assert time.monotonic() < deadline, "Perfetto's UI did not start"
            time.sleep(0.1)
        with open(path, "rb") as f:
            page.evaluate(OPEN, [base64.b64encode(f.read()).decode(), path.rsplit("/", 1)[-1]])
        while (got := page.evaluate(LOST)) is None:
            assert time.monotonic() < deadline, f"Perfetto did not load {path}"
            time.sleep(0.1)
        return dict(got)
    finally:
        page.close()
