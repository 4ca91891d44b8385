"""Notebook frames and plots from a real run, and straggler flags end to end."""

import uuid

import matplotlib
import pytest

from coordinator import get_or_create_coordinator
from coordinator.ops import notebook as nb
from coordinator.ops import plots
from tests.configs import profiler_config

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def run(ray_session, worker_pool, tmp_path_factory):
    """3 ranks, 2 windows; rank 2 does 12x the work of the others.

    Each rank's step is a few milliseconds of ops, well above a scheduler time slice: on a
    loaded 2-core machine a rank preempted in the middle of an op sees that op's wall time grow
    by a slice or two, which swamped a 0.5 ms step and made the 6x rank look like the median.
    """
    ray = ray_session
    tmp_path = tmp_path_factory.mktemp("nb")
    cfg = profiler_config(
        tmp_path,
        export_type="none",
        wait=0,
        warmup=1,
        active=2,
        repeat=2,
        straggler_threshold=1.5,
    )
    coord = get_or_create_coordinator(
        cfg, name=f"p-{uuid.uuid4().hex[:8]}", namespace="profiler-tests"
    )
    workers = worker_pool.take(3)
    ray.get(coord.register.remote("t", workers))
    ray.get(coord.start.remote("t", 0))
    for k in range(6):
        ray.get([w.train_step.remote(96 if r == 2 else 8) for r, w in enumerate(workers)])
        ray.get(coord.step.remote("t", k))
    ray.get(coord.stop.remote("t"))
    status = ray.get(coord.status.remote())
    summaries = [
        ray.get(coord.kernel_summary.remote(window=w["index"], top_k=8, per_rank=True))
        for w in status["windows"]
    ]
    collectives = ray.get(coord.collectives.remote(window=status["windows"][-1]["index"]))
    yield status, summaries, collectives
    ray.kill(coord)
    worker_pool.give_back(workers)


def test_stragglers_are_flagged_in_status_and_summary(run):
    status, summaries, _ = run
    for s in summaries:
        assert s["stragglers"]["flagged"] == [2], (s["rank_totals"], s["breakdown"]["ranks"])
        assert s["stragglers"]["ranks"][2]["compute_ratio"] > 1.5
    assert [w["stragglers"] for w in status["windows"]] == [[2], [2]]


def test_frames(run):
    status, summaries, _ = run
    k = nb.kernels_frame(summaries[-1])
    assert len(k) == 8 and k["total_us"].is_monotonic_decreasing
    m = nb.rank_kernel_frame(summaries[-1])
    assert list(m.index) == [0, 1, 2] and list(m.columns) == list(k["name"])
    assert m.sum().tolist() == pytest.approx(k["total_us"].tolist(), rel=1e-5)
    assert list(nb.ranks_frame(status)["state"]) == ["ok", "ok", "ok"]
    assert list(nb.windows_frame(status).index) == [0, 1]
    assert list(nb.stragglers_frame(summaries[-1]).index) == [0, 1, 2]
    steps = nb.step_times_frame(summaries)
    assert steps.shape == (2, 3)
    with pytest.raises(ValueError, match="per_rank=True"):
        nb.rank_kernel_frame({**summaries[-1], "per_rank": None})


def test_the_collectives_frames_of_a_window_without_collectives_are_empty(run):
    _, _, collectives = run  # toy ranks: no process group, so no collective in their traces
    ranks = nb.collectives_frame(collectives)
    assert list(ranks.index) == [0, 1, 2] and (ranks["collectives"] == 0).all()
    assert ranks.attrs["matched"] == 0 and ranks.attrs["ranks_without"] == [0, 1, 2]
    matched = nb.matched_collectives_frame(collectives)
    assert matched.empty and "last_rank" in matched.columns


@pytest.mark.parametrize(
    "draw",
    [
        lambda s: plots.plot_top_kernels(s[-1]),
        lambda s: plots.plot_rank_kernel_heatmap(s[-1]),
        lambda s: plots.plot_step_times(s),
    ],
    ids=["top_kernels_by_rank", "rank_kernel_heatmap", "step_times"],
)
def test_plots_render_to_png(run, tmp_path, draw, request):
    import matplotlib.pyplot as plt

    _, summaries, _ = run
    ax = draw(summaries)
    path = tmp_path / f"{request.node.callspec.id}.png"
    ax.figure.savefig(path, dpi=80)
    plt.close(ax.figure)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
