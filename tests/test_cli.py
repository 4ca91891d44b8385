"""The CLI's conventions, checked without a cluster: options anywhere, exit codes, examples."""

import pytest

from coordinator.cli import _EXAMPLES, EXIT_USAGE, parse_args

COMMANDS = ["status", "top", "capture --active 1", "cancel 3", "stragglers", "watch"]


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


@pytest.mark.parametrize(
    "argv", [[], ["nope"], ["capture"], ["status", "--bogus"], ["top", "--k", "x"]]
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
