"""The training console: one progress bar kept on the terminal's last line, every other line above it.

In a terminal (rank 0's stderr is a TTY) `fit` shows one tqdm bar (steps done, rate, time left, the last
step's score) and every line the run writes meanwhile (the step lines, diagnoses, checkpoint messages,
warnings, log records) is printed above it: the bar is cleared, the line written, the bar drawn again
under it, as `tqdm.write` does. Elsewhere (a file, a pipe, `tee`, another rank) there is no bar: the
same lines go out as they are, with no carriage returns between them. The libraries' own bars
(transformers' "Writing model shards" when a checkpoint saves) are switched off while the bar is up, and
wherever the output is not a terminal.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections.abc import Iterator
from typing import TextIO

from tqdm import tqdm

SCORE_KEY = "critic/score/mean"  # shown on the bar after each step


class LinesAboveBar(io.TextIOBase):
    """A text stream whose whole lines are written to `target` above `bar` (cleared, written, redrawn)."""

    def __init__(self, target: TextIO, bar: tqdm) -> None:
        self.target, self.bar, self.pending = target, bar, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        if lines:
            with self.bar.get_lock():
                self.bar.clear()
                self.target.write("".join(line + "\n" for line in lines))
                self.target.flush()
                self.bar.refresh()
        return len(text)

    def flush(self) -> None:
        self.target.flush()

    def finish(self) -> None:
        """Write a last line that had no newline yet."""
        if self.pending:
            self.write("\n")

    def isatty(self) -> bool:
        return self.target.isatty()

    def writable(self) -> bool:
        return True


def shows_bar(is_main: bool, stream: TextIO | None = None) -> bool:
    """A bar only on rank 0 and in a terminal: a log file or a pipe gets the lines alone."""
    stream = stream if stream is not None else sys.stderr
    return is_main and bool(getattr(stream, "isatty", lambda: False)())


@contextlib.contextmanager
def library_bars_off() -> Iterator[None]:
    """transformers' progress bars (its save and load loops) off inside, as they were after."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def quiet_library_bars_off_terminal(is_main: bool) -> None:
    """Where the output is not a terminal, transformers' bars stay off for the run: in a log file each
    redraw would be one more carriage-return segment."""
    if not shows_bar(is_main):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


class StepBar:
    """`fit`'s progress: `open()` before the first step, `step(metrics)` after each, `close()` at the end;
    while open, prints and log records go above the bar (`LinesAboveBar`)."""

    def __init__(self, total: int, done: int, is_main: bool) -> None:
        self.shown = shows_bar(is_main)
        self.bar = tqdm(
            total=total,
            initial=done,
            desc="training",
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
            disable=not self.shown,
        )
        self._open = contextlib.ExitStack()

    def open(self) -> StepBar:
        self._open.enter_context(library_bars_off())
        if self.shown:
            out, err = LinesAboveBar(sys.stdout, self.bar), LinesAboveBar(sys.stderr, self.bar)
            self._open.callback(out.finish)
            self._open.callback(err.finish)
            self._open.enter_context(contextlib.redirect_stdout(out))  # type: ignore[type-var]
            self._open.enter_context(contextlib.redirect_stderr(err))  # type: ignore[type-var]
            self._open.enter_context(log_records_to({out.target: out, err.target: err}))
        return self

    def step(self, metrics: dict[str, float]) -> None:
        """One more step done; the bar shows its score when it has one."""
        if SCORE_KEY in metrics:
            self.bar.set_postfix_str(f"score {metrics[SCORE_KEY]:.3f}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        """The bar's last state stays on screen; the streams and log handlers are as before `open`."""
        self._open.close()
        self.bar.close()


@contextlib.contextmanager
def log_records_to(streams: dict[TextIO, TextIO]) -> Iterator[None]:
    """The root logger's console handlers that write to a key of `streams` write to its value inside."""
    moved = []
    for handler in logging.getLogger().handlers:
        if type(handler) is logging.StreamHandler and handler.stream in streams:
            moved.append((handler, handler.setStream(streams[handler.stream])))
    try:
        yield
    finally:
        for handler, stream in moved:
            handler.setStream(stream)
