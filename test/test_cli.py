"""`sps-driving --help` and every subcommand's `--help`: what a new user runs first."""

import subprocess
import sys

import pytest

from sps_driving.cli import COMMANDS, main


def test_top_level_help_lists_every_command():
    result = subprocess.run([sys.executable, "-m", "sps_driving.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    for name in COMMANDS:
        assert name in result.stdout
    assert "95%" in result.stdout and "%%" not in result.stdout  # help strings are %-formatted


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_help_exits_0(command, capsys):
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    assert f"sps-driving {command}" in capsys.readouterr().out
