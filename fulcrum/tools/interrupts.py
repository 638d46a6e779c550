"""Ctrl-C and SIGTERM for the `fulcrum` commands: one line, no traceback, exit 128 + the signal number.

SIGTERM is turned into an exception (`Terminated`) so that it unwinds like Ctrl-C: each command
removes its own partial output in `except BaseException` / `finally` blocks, and may say what it
removed with `exc.add_note(...)`. `fulcrum.cli.main` then prints one line with those notes.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class Terminated(BaseException):
    """SIGTERM received; a BaseException like KeyboardInterrupt, so `except Exception` lets it pass."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(signum)


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """While active, SIGTERM raises `Terminated` where the main thread is (outside it: no change)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupt_line(command: str, exc: BaseException) -> tuple[str, int]:
    """The one line to print for an interrupt of `fulcrum COMMAND`, and the exit code (130 or 143)."""
    signum = signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT
    what = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
    notes = "; ".join(getattr(exc, "__notes__", []))
    return f"fulcrum {command}: interrupted ({what})" + (f"; {notes}" if notes else ""), 128 + int(signum)
