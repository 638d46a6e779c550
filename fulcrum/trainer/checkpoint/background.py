"""One checkpoint write at a time on a thread beside training; its error comes back to the trainer.

The trainer hands over a write (serialise, hash, fsync, rename: `CheckpointManager` builds it from a
host snapshot) and goes on training. `wait()` joins it and raises what it raised, unchanged, so a full
disk reads as the same `DiskFullError` whether the write ran in the step or beside it. The next save,
the end of the run and every error exit call `wait()` first; a stop that must not wait (a second
Ctrl-C) calls `cancel()`, which makes the write stop at its next file and remove its temporary folder.
A killed process leaves that folder behind under its pid: resume never reads it and deletes it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

THREAD_NAME = "fulcrum-checkpoint-writer"


class WriteCancelled(Exception):
    """Raised inside a write that `cancel()` stopped; its clean-up runs, nothing is published."""


class BackgroundWriter:
    """Runs one write at a time on its own (non-daemon) thread; see the module docstring.

    `seconds_of_finished()` gives, once, how long the last write took (for `perf/checkpoint_write_s`).
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._cancel = threading.Event()
        self._started = 0.0
        self._seconds: float | None = None  # of the last finished write, until it is reported
        self.label = ""  # what the running (or last) write is writing, for messages

    @property
    def busy(self) -> bool:
        """A write is running now."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, label: str, write: Callable[[], Any]) -> None:
        """Start `write()` on the writer thread. Call `wait()` first: one write at a time."""
        if self._thread is not None:
            raise RuntimeError(f"checkpoint write {self.label} still pending: wait() for it first")
        self._cancel.clear()
        self.label = label
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(write,), name=THREAD_NAME)
        self._thread.start()

    def _run(self, write: Callable[[], Any]) -> None:
        try:
            write()
        except BaseException as exc:  # raised again on the trainer's thread by wait()
            self._error = exc
        finally:
            self._seconds = time.perf_counter() - self._started

    def check_cancelled(self) -> None:
        """Called by the write between files: raises WriteCancelled once `cancel()` asked it to stop."""
        if self._cancel.is_set() and threading.current_thread() is self._thread:
            raise WriteCancelled(f"checkpoint write {self.label} cancelled")

    def wait(self) -> None:
        """Block until the running write (if any) ends; raise its error, if it failed."""
        thread = self._thread
        if thread is None:
            return
        thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None and not isinstance(error, WriteCancelled):
            raise error

    def cancel(self) -> BaseException | None:
        """Stop the running write at its next file (it removes its temporary folder) and wait for that.
        A write that had already published its checkpoint finishes normally. Returns the error a write
        failed with on its own (not raised: the caller is already stopping for another reason)."""
        self._cancel.set()
        try:
            self.wait()
        except BaseException as exc:
            return exc
        finally:
            self._cancel.clear()
        return None

    def seconds_of_finished(self) -> float | None:
        """How long the last finished write took, once: None until a write finishes (a write submitted
        since then does not hide it), and after it was reported."""
        seconds, self._seconds = self._seconds, None
        return seconds

    def finish(self, stopping: BaseException | None) -> str | None:
        """The end of a run for a write still running. A normal end (`stopping` None) waits for it and
        raises its failure; a run ending on an error waits too, its failure then a warning; a second
        Ctrl-C (stop at once: KeyboardInterrupt) cancels it, its temporary folder removed and the
        previous checkpoint still the newest. Returns, on a normal end, the line saying how long a
        finished write took beside training."""
        if stopping is None:
            self.wait()
            seconds = self.seconds_of_finished()
            return (
                None
                if seconds is None
                else f"checkpoint {self.label} written in {seconds:.1f} s beside training"
            )
        try:
            if isinstance(stopping, KeyboardInterrupt):
                failure = self.cancel()
            else:
                self.wait()
                failure = None
        except Exception as exc:
            failure = exc
        if failure is not None:
            print(f"warning: the background checkpoint write failed too: {failure}", file=sys.stderr)
        return None
