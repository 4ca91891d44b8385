"""The CLI's conventions, checked without a cluster: options anywhere, exit codes, examples."""

import pytest

from coordinator.ops.cli import _EXAMPLES, EXIT_USAGE, parse_args

COMMANDS = ["status", "top", "capture --active 1", "cancel 3", "stragglers", "watch", "auto on"]


@pytest.mark.parametrize("command", COMMANDS)
def test_global_options_go_before_or_after_the_command(command):
    words = command.split()
    opts = ["--address", "10.0.0.1:6379", "--namespace", "ns", "--name", "p", "--json"]
    before, after = parse_args(opts + words), parse_args(words + opts)
    for args in (before, after):
        assert (args.address, args.namespace, args.name, args.json) == (
            "10.0.0.1:6379",
            "ns",
            "p",
            True,
        )
        assert args.command == words[0]


def test_an_option_given_before_the_command_is_not_reset_by_its_default():
    args = parse_args(["--name", "mine", "status"])
    assert args.name == "mine" and args.namespace == "profiler" and args.json is False


def test_ray_address_is_the_default_and_auto_is_accepted(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "192.0.2.7:6379")
    assert parse_args(["status"]).address == "192.0.2.7:6379"
    assert parse_args(["status", "--address", "auto"]).address == "auto"
    monkeypatch.delenv("RAY_ADDRESS")
    assert parse_args(["status"]).address == "auto"


def test_auto_switches_on_or_off_or_shows():
    assert parse_args(["auto", "on"]).switch == "on"
    assert parse_args(["auto", "off"]).switch == "off"
    assert parse_args(["auto"]).switch is None


def test_auto_capture_reads_as_one_line_with_its_reason():
    from coordinator.ops.tables import render_auto, trigger_text

    entry = {
        "enabled": True,
        "source": "operator",
        "captures": 1,
        "max_per_run": 5,
        "baseline_ms": 20.4,
        "recent_ms": 61.0,
        "slow_steps": 0,
        "last_trigger": 312,
    }
    assert render_auto(entry) == (
        "auto capture: on (operator), 1 of at most 5 taken, baseline step 20.4 ms"
    )
    trigger = {
        "step": 312,
        "ratio": 2.99,
        "baseline_ms": 20.4,
        "recent_ms": 61.0,
        "slow_steps": [301, 312],
        "region": None,
    }
    assert trigger_text(trigger) == (
        "steps 301-312 ran 2.99x the baseline: 61.0 ms against 20.4 ms"
    )


@pytest.mark.parametrize(
    "argv",
    [[], ["nope"], ["capture"], ["status", "--bogus"], ["top", "--k", "x"], ["auto", "maybe"]],
)
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == EXIT_USAGE
    assert "usage: ray-profiler" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(_EXAMPLES))
def test_every_command_help_shows_an_example(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "example:" in out and _EXAMPLES[command].splitlines()[0] in out


def test_top_level_help_names_the_exit_codes(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert "exit status: 0 ok, 1 error, 2 usage" in capsys.readouterr().out


def _window_of_three_ranks():
    from coordinator.core.aggregate import WindowAggregate
    from coordinator.protocol.summary_codec import Breakdown, KernelRow, MemoryRow, RankSummary

    agg = WindowAggregate(2)
    for rank, gemm_us in ((0, 900.0), (1, 1000.0), (2, 3000.0)):
        agg.add(
            RankSummary(
                rank,
                2,
                (10, 12),
                False,
                "cpu",
                [KernelRow("aten::addmm", gemm_us, 6, 0), KernelRow("gloo:all_reduce", 50.0, 3, 0)],
                step_us=[(10 + i, gemm_us) for i in range(3)],
                breakdown=Breakdown(compute_us=gemm_us, comm_us=4000.0 - gemm_us, window_us=5000.0),
                peak_bytes=(rank + 1) * 2**20,
                memory=[MemoryRow("aten::empty", 2**20, 4)],
            )
        )
    return agg.to_dict(5, straggler_threshold=1.5)


def test_the_tables_show_every_rank_kernel_and_the_straggler():
    from coordinator.ops.tables import render_stragglers, render_top

    ks = _window_of_three_ranks()
    top = render_top(ks)
    assert top.splitlines()[0].startswith("window 2 steps [10, 12], policy ranks [0, 1, 2]")
    assert "aten::addmm" in top and "gloo:all_reduce" in top
    assert "memory: peak 3.0 MB on rank 2" in top and "aten::empty" in top
    rows = {line.split()[0]: line for line in top.splitlines() if line.endswith("%")}
    assert set(rows) >= {"0", "1", "2"}  # the breakdown: one row per rank
    assert rows["2"].split()[2] == "60.0%"  # rank 2: 3,000 of 5,000 us computing
    strag = render_stragglers(ks)
    flagged = [line.split()[0] for line in strag.splitlines() if line.endswith("STRAGGLER")]
    assert flagged == ["2"] and "flagged [2]" in strag


def test_the_tables_say_when_no_window_has_closed():
    from coordinator.core.aggregate import empty_summary
    from coordinator.ops.tables import render_stragglers, render_top

    assert render_top(empty_summary()) == "no closed window yet"
    assert render_stragglers(empty_summary()) == "no closed window yet"
