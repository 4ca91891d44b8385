"""``status()`` of a recorded run: the coordinator's reply, made from its record.

What the record holds is as the coordinator showed it (the run, its config with secrets
redacted, windows, trainers, counters, rank counts, stalls, the memory marks); what belongs to
a live process is empty: no current or next window, no ranks listed (``rank_counts`` counts
them), no nodes, no metrics, a process of pid 0, no checkpoint. ``record`` says where the
record was read.
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.core.memory_record import memory_status
from coordinator.protocol.finding_replies import StatusFindings
from coordinator.protocol.replies import RecordEntry, StatusReply
from coordinator.service.record_reader import Recorded

FULL_STATUS_RANKS = 256  # (as ``Readers.status``: larger runs list cut windows by default)
Found = Sequence[StatusFindings]
"""``status()["findings"]``: the latest closed window's (``status_findings.FindingCache``)."""


def recorded_status(rec: Recorded, ranks: str = "summary", found: Found = ()) -> StatusReply:
    """The ``StatusReply`` of the run ``rec`` holds (see the module docstring), ``found``."""
    head, run, st = rec.file, rec.run, rec.run.state
    complete = ranks == "all" or sum(head.rank_counts.values()) <= FULL_STATUS_RANKS
    return {
        "name": "record",
        "namespace": "",
        "run": run.info(),
        "phase": "idle",
        "config": dict(head.config),
        "run_dir": run.run_dir,
        "global_step": st.global_step,
        "current_window": None,
        "next_window": None,
        "windows": [w.to_dict(complete) for w in st.closed_windows()],
        "trainers": [t.to_dict(t.trainer_id == st.stepping_trainer) for t in st.trainers.values()],
        "ranks": [],
        "ranks_complete": False,
        "rank_counts": dict(head.rank_counts),
        "nodes": {"by_path": {}, "listed": [], "complete": True},
        "counters": {
            "worker_rpcs": 0,
            "ignored_steps": 0,
            "skipped_windows": head.skipped_windows,
            **head.counters,
        },
        "metrics": {},
        "process": {
            "pid": 0,
            "torch_loaded": False,
            "worker_handle_stubs": False,
            "loop": {
                "max_stall_ms": 0.0,
                "max_stall_at": None,
                "max_busy_ms": 0.0,
                "recent_stalls": [],
                "gc_max_ms": {},
            },
        },
        "previous_runs": [],
        "restarts": 0,
        "last_restart": None,
        "checkpoint": dict(bytes=0, seconds=0.0, at=None, error=None, restore_problems=[]),
        "record": record_entry(rec),
        "memory": memory_status(rec.memory) if rec.memory is not None else None,  # (older: none)
        "auto_capture": {
            "enabled": False,
            "source": "config",
            "captures": head.counters.get("auto_captures", 0),
            "max_per_run": run.config.auto_capture.max_per_run,
            "baseline_ms": None,
            "recent_ms": None,
            "slow_steps": 0,
            "last_trigger": None,
        },
        "stalls": list(rec.stalls),
        "attach_problems": [],
        "schedule_problems": [],
        "findings": list(found),
    }


def record_entry(rec: Recorded) -> RecordEntry:
    """``status()["record"]`` of a record read back: where, what it holds, what could not be
    read (``error``)."""
    problems = rec.problems
    return {
        "dir": rec.url,
        "windows": len(rec.run.state.windows),
        "steps": rec.phases.steps_seen,
        "files": 0,
        "bytes": 0,
        "pending": 0,
        "failures": len(problems),
        "dropped": 0,
        "error": "; ".join(problems)[:2000] if problems else None,
        "retry_in_s": None,
        "last_write_at": rec.file.written_at,
    }
