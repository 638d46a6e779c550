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


def test_a_command_not_built_yet_says_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(COMMANDS, "later", ("fulcrum.tools.later", "a sub-command whose module is not built"))
    assert main(["later", "run"]) == 2
    assert "fulcrum later: not available" in capsys.readouterr().err


def test_report_is_dispatched(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    assert main(["report", str(tmp_path / "missing")]) == 1
    assert "no such run directory" in capsys.readouterr().err
