"""matplotlib plots of the cross-rank aggregates (the ``plot`` extra).

Each function draws on ``ax`` (a new figure when None) and returns the axes.
"""

from __future__ import annotations

from typing import Any

from coordinator.ops import notebook


def _axes(ax: Any, size: tuple[float, float]) -> Any:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=size, layout="constrained")
    return ax


def _short(name: str, n: int = 40) -> str:
    return name if len(name) <= n else name[: n - 1] + "…"


def plot_top_kernels(summary: dict[str, Any], ax: Any = None) -> Any:
    """Top kernels by total self time, each bar stacked by rank (needs per_rank=True)."""
    frame = notebook.rank_kernel_frame(summary)  # ranks x kernels
    ax = _axes(ax, (9, 0.4 * len(frame.columns) + 1.5))
    names = list(frame.columns)[::-1]  # largest on top
    left = [0.0] * len(names)
    for rank, row in frame.iterrows():
        values = [row[n] / 1e3 for n in names]
        ax.barh([_short(n) for n in names], values, left=left, label=f"rank {rank}")
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.set_xlabel(f"self {summary['device']} time (ms), summed over ranks")
    ax.set_title(f"window {summary['window']}, steps {summary['steps']}: top kernels by rank")
    ax.legend(loc="lower right", fontsize="small")
    return ax


def plot_rank_kernel_heatmap(summary: dict[str, Any], ax: Any = None) -> Any:
    """A rank x kernel heat map of self time (ms) for the top kernels (needs per_rank=True)."""
    frame = notebook.rank_kernel_frame(summary)
    ax = _axes(ax, (0.6 * len(frame.columns) + 3, 0.4 * len(frame.index) + 2.5))
    im = ax.imshow(frame.to_numpy() / 1e3, aspect="auto", cmap="viridis")
    ax.set_xticks(
        range(len(frame.columns)),
        [_short(c, 24) for c in frame.columns],
        rotation=60,
        ha="right",
        fontsize="small",
    )
    ax.set_yticks(range(len(frame.index)), [f"rank {r}" for r in frame.index])
    ax.figure.colorbar(im, ax=ax, label="self time (ms)")
    ax.set_title(f"window {summary['window']}: self time per rank and kernel")
    return ax


def plot_step_times(summaries: list[dict[str, Any]], ax: Any = None) -> Any:
    """Mean step time per rank, one point per window."""
    frame = notebook.step_times_frame(summaries)
    ax = _axes(ax, (8, 4))
    for rank in frame.columns:
        ax.plot(frame.index, frame[rank], marker="o", label=f"rank {rank}")
    ax.set_xlabel("window")
    ax.set_ylabel("mean step time (ms)")
    ax.set_title("step time per rank per window")
    ax.legend(fontsize="small")
    return ax


def plot_phases(phases: dict[str, Any], ax: Any = None) -> Any:
    """Each step's wall time stacked by region (``phase_times()``), ``other`` on top."""
    frame = notebook.phases_frame(phases)  # steps x regions, ms
    ax = _axes(ax, (9, 4))
    bottom = [0.0] * len(frame.index)
    for region in frame.columns:
        values = frame[region].tolist()
        ax.bar(frame.index, values, bottom=bottom, width=1.0, label=region)
        bottom = [a + b for a, b in zip(bottom, values, strict=True)]
    ax.set_xlabel("global step")
    ax.set_ylabel("ms")
    ax.set_title(f"run {phases['run']}: phase times per step")
    ax.legend(loc="upper right", fontsize="small")
    return ax
