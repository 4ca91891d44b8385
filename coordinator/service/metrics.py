"""The coordinator's counters as Ray metrics, so a Prometheus that scrapes Ray sees them."""

from __future__ import annotations

from typing import Any

from coordinator.core.state import CoordinatorState, rank_counts
from coordinator.protocol.memory_replies import MemoryMark


class CoordinatorMetrics:
    """The coordinator's counters as Ray metrics, so a Prometheus that scrapes Ray sees them.

    Ray prefixes the names with ``ray_``: ``ray_profiler_global_step`` and so on.
    """

    GAUGES = {
        "profiler_global_step": "Last global step the stepping trainer reported finished",
        "profiler_ranks_disabled": "Ranks whose profiling is disabled by a fault",
        "profiler_ranks_lost": "Ranks whose worker died or whose node went away",
        "profiler_ranks_unresponsive": "Ranks that did not answer within worker_timeout_s",
    }
    COUNTERS = {
        "profiler_windows_captured": "Profiling windows closed",
        "profiler_worker_rpcs": "Calls the coordinator made to worker ranks",
        "profiler_auto_captures": "Auto captures planned because the run slowed down",
        "profiler_stalls": "Stalls the watchdog detected (no step for the stall threshold)",
        "profiler_regressions": (
            "Windows marked slower than the run's baseline window, each counted once"
        ),
    }

    def __init__(self, name: str) -> None:
        self.values: dict[str, float] = {}
        self._leak_tags: set[tuple[str, str]] = set()
        self._sent: dict[str, float] = {}
        try:
            from ray.util import metrics

            tags = {"coordinator": name}
            self._gauges = {
                n: metrics.Gauge(n, d, tag_keys=("coordinator",)) for n, d in self.GAUGES.items()
            }
            self._counters = {
                n: metrics.Counter(n, d, tag_keys=("coordinator",))
                for n, d in self.COUNTERS.items()
            }
            for m in (*self._gauges.values(), *self._counters.values()):
                m.set_default_tags(tags)
            self._phase: Any = metrics.Gauge(
                "profiler_phase_ms",
                "The stepping trainer's last step: its wall time (region=step) and each region's",
                tag_keys=("coordinator", "region"),
            )
            self._phase.set_default_tags(tags)
            self._leaking: Any = metrics.Gauge(
                "profiler_memory_leaking_ranks",
                "Ranks marked as leaking memory",
                tag_keys=("coordinator",),
            )
            self._leaks: Any = metrics.Gauge(
                "profiler_memory_leak_bytes_per_min",
                "A rank marked as leaking: how fast its resident memory grows (0: no longer)",
                tag_keys=("coordinator", "trainer_id", "rank"),
            )
            for g in (self._leaking, self._leaks):
                g.set_default_tags(tags)
            self.error: str | None = None
        except Exception as exc:  # metrics are a convenience; never fail the coordinator
            self._gauges, self._counters, self._phase = {}, {}, None
            self._leaking = self._leaks = None
            self.error = f"{type(exc).__name__}: {exc}"

    def phases(self, ms: dict[str, float] | None) -> None:
        """The last step's wall time (``region="step"``) and region times, in ms."""
        if not ms or self._phase is None:
            return
        try:
            for region, value in ms.items():
                self._phase.set(value, tags={"region": region})
            self.values["profiler_phase_ms"] = ms["step"]
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"

    def memory(self, marks: list[MemoryMark]) -> None:
        """The ranks marked as leaking: how many, and each one's rate (bytes a minute)."""
        if self._leaks is None:
            return
        try:
            self._leaking.set(float(len(marks)))
            self.values["profiler_memory_leaking_ranks"] = float(len(marks))
            now = {(m["trainer_id"], str(m["rank"])) for m in marks}
            for tid, rank in self._leak_tags - now:  # a mark that ended reads 0, not its last
                self._leaks.set(0.0, tags={"trainer_id": tid, "rank": rank})
            for m in marks:
                tags = {"trainer_id": m["trainer_id"], "rank": str(m["rank"])}
                self._leaks.set(m["bytes_per_min"], tags=tags)
            self._leak_tags = now
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"

    def export(self, st: CoordinatorState) -> None:
        counts = rank_counts(st)  # (of selected ranks: the others are "not_selected")
        leaking = self.values.get("profiler_memory_leaking_ranks")
        self.values = {
            "profiler_global_step": float(st.global_step if st.global_step is not None else -1),
            "profiler_ranks_disabled": float(counts.get("disabled", 0)),
            "profiler_ranks_lost": float(counts.get("lost", 0)),
            "profiler_ranks_unresponsive": float(counts.get("unresponsive", 0)),
            "profiler_windows_captured": float(st.counters["windows_closed"]),
            "profiler_worker_rpcs": float(st.counters["worker_rpcs"]),
            "profiler_auto_captures": float(st.counters["auto_captures"]),
            "profiler_stalls": float(st.counters["stalls"]),
            "profiler_regressions": float(st.counters["regressions"]),
        }
        if leaking is not None:  # (set by ``memory`` when the marks are made)
            self.values["profiler_memory_leaking_ranks"] = leaking
        try:
            for n, g in self._gauges.items():
                g.set(self.values[n])
            for n, c in self._counters.items():
                delta = self.values[n] - self._sent.get(n, 0.0)
                if delta > 0:
                    c.inc(delta)
                    self._sent[n] = self.values[n]
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"

    def snapshot(self) -> dict[str, Any]:
        return {
            "exported": bool(self._gauges) and self.error is None,
            "error": self.error,
            "values": dict(self.values),
        }
