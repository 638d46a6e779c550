"""What `fulcrum train` shows: in a terminal one progress bar kept on the last line, every step, diagnosis
and checkpoint line whole above it; in a file or a pipe the same lines without carriage returns.

The terminal is a pseudo-terminal of 160 columns (Python's `pty`, no tmux needed); `screen` replays what
the run wrote as a terminal lays it out, for the controls tqdm writes (text, carriage return, line feed,
line wrap, cursor up)."""

from __future__ import annotations

import fcntl
import io
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from helpers import make_assets, short_run_overrides

from fulcrum.trainer.console import StepBar, shows_bar

COLUMNS, ROWS = 160, 50


def run_in_terminal(argv: list[str], timeout: float = 300.0) -> tuple[int, str]:
    """`python -m fulcrum.trainer.main_ppo argv` with stdout and stderr on a COLUMNS-wide terminal: its
    exit code and everything it wrote there."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
    env = {**os.environ, "COLUMNS": str(COLUMNS), "TERM": "xterm"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fulcrum.trainer.main_ppo", *argv],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    out, deadline = bytearray(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal's other side closed: the run ended
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    else:
        proc.kill()
    os.close(master)
    return proc.wait(timeout=30), out.decode(errors="replace")


def screen(raw: str, columns: int = COLUMNS) -> list[str]:
    """The rows a `columns`-wide terminal holds (scrolled-off rows included) after `raw`: characters at
    the cursor, a carriage return to column 0, a line feed to the next row, a wrap at the right edge
    (on the next character, as terminals defer it), ESC[nA n rows up; other escape sequences skipped."""
    rows: list[list[str]] = [[]]
    row = col = 0
    i = 0
    while i < len(raw):
        ch = raw[i]
        i += 1
        if ch == "\x1b":
            m = re.match(r"\[(\d*)([A-Za-z])", raw[i:])
            if m:
                i += m.end()
                if m.group(2) == "A":
                    row = max(0, row - int(m.group(1) or 1))
            continue
        if ch == "\r":
            col = 0
            continue
        if ch == "\n":
            row += 1
        elif ch.isprintable():
            if col >= columns:
                row, col = row + 1, 0
            while len(rows) <= row:
                rows.append([])
            line = rows[row]
            line.extend(" " * (col + 1 - len(line)))
            line[col] = ch
            col += 1
        while len(rows) <= row:
            rows.append([])
    return ["".join(line).rstrip() for line in rows]


def test_screen_lays_text_out_as_a_terminal() -> None:
    assert screen("abc\rX\r\n12345", columns=4) == ["Xbc", "1234", "5"]
    assert screen("one\r\ntwo\x1b[A\rONE") == ["ONE", "two"]


def test_a_terminal_keeps_one_bar_at_the_bottom_and_whole_lines_above_it(tmp_path: Path) -> None:
    assets = make_assets(tmp_path / "assets")
    argv = short_run_overrides(assets, tmp_path / "run", **{"data.max_response_length": 8})
    code, raw = run_in_terminal(argv)
    assert code == 0, raw[-3000:]
    shown = [line for line in screen(raw) if line.strip()]
    bars = [i for i, line in enumerate(shown) if line.startswith("training:")]
    assert len(bars) == 1, "\n".join(shown)  # no old bar stays behind
    bar = shown[bars[0]]
    assert re.fullmatch(
        r"training: 100%\|█+\| 2/2 \[\d\d:\d\d<00:00, +[\d.]+(step/s|s/step), score -?\d\.\d{3}\]", bar
    )
    steps = [i for i, line in enumerate(shown) if re.match(r"step \d+ \| score ", line)]
    assert [shown[i].split(" |")[0] for i in steps] == ["step 1", "step 2"], "\n".join(shown)
    assert all(i < bars[0] for i in steps)  # above the bar
    assert not any("| score" in line and not line.startswith("step ") for line in shown), "\n".join(shown)
    assert any(line.startswith("diagnosis (length_limit) step 1: ") for line in shown[: bars[0]])
    assert any(line.startswith("checkpoint global_step_2 written in ") for line in shown[: bars[0]])
    assert not any("Writing model shards" in line for line in shown)


def test_a_file_gets_the_lines_without_a_bar() -> None:
    """Not a terminal (a log file, a pipe, `tee`): no bar and no carriage return, the lines as written."""
    out, err = io.StringIO(), io.StringIO()
    sys_out, sys_err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        progress = StepBar(total=2, done=0, is_main=True).open()
        print("step 1 | score 0.500")
        progress.step({"critic/score/mean": 0.5})
        print("diagnosis (x) step 1: y -> z", file=sys.stderr)
        progress.step({})
        progress.close()
    finally:
        sys.stdout, sys.stderr = sys_out, sys_err
    assert not progress.shown
    assert out.getvalue() == "step 1 | score 0.500\n"
    assert err.getvalue() == "diagnosis (x) step 1: y -> z\n"


@pytest.mark.parametrize("is_main", [True, False])
def test_only_rank_0_in_a_terminal_draws_a_bar(is_main: bool) -> None:
    master, slave = os.openpty()
    try:
        with os.fdopen(os.dup(slave), "w") as tty:
            assert shows_bar(is_main, tty) is is_main
        assert shows_bar(is_main, io.StringIO()) is False
    finally:
        os.close(master)
        os.close(slave)
