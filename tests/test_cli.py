"""The `fulcrum` command's dispatch: help, unknown commands, and sub-commands not built yet."""

import pytest

from fulcrum.cli import COMMANDS, main


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


def test_unknown_command_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_a_command_not_built_yet_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "run"]) == 2
    assert "fulcrum report: not available" in capsys.readouterr().err
