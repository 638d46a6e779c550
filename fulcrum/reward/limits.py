"""A time limit on a block of code in the main thread, for a user's reward function.

`TimeLimit(seconds, what)` is a context manager: when the block runs past `seconds`, `RewardTimeout`
is raised inside it, wherever the main thread is (a `time.sleep`, a socket read, a Python loop).

How: a watchdog thread waits for the deadline and then sends `LIMIT_SIGNAL` to the main thread
(`signal.pthread_kill`); the handler, installed only for the block, raises. Why not the others:

- `signal.alarm` / `setitimer`: one process-wide timer, and math graders commonly set their own
  (verl's among them) then cancel it with `alarm(0)`, which would cancel the limit without a word.
  A real-time signal of our own is used by nobody else in the process.
- a worker thread with `join(timeout)`: a stuck thread cannot be stopped, and a reward function run
  off the main thread cannot install signal handlers, so those same graders would fail on every call.
- a process pool: a robust kill, but every batch pays for a fork of a process holding the models,
  functions must pickle, and a function's state (a loaded judge model, a cache) is lost between batches.

What it cannot do: code that never returns to the interpreter (a C extension looping without checking
for signals), or a function that catches BaseException and carries on, does not see the exception.
For those the watchdog gives `grace_s` more seconds, then prints what happened and ends the process
(`os._exit`): a stuck run must not hang forever. Outside the main thread, or where the platform has no
`pthread_kill`, the block runs without a limit.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType, TracebackType

# A real-time signal (Linux), far from SIGRTMIN where C libraries take theirs; SIGALRM elsewhere.
LIMIT_SIGNAL: int = signal.SIGRTMAX - 2 if hasattr(signal, "SIGRTMAX") else signal.SIGALRM
GRACE_S = 30.0  # after the deadline, before a function that ignored the limit ends the process
STUCK_EXIT_CODE = 1


class RewardTimeout(BaseException):
    """Raised inside the reward function when its batch's time limit passes. A BaseException, like
    KeyboardInterrupt, so that a function's own `except Exception` does not swallow it."""


class TimeLimit:
    """`with TimeLimit(seconds, what) as limit:` raises RewardTimeout in the block after `seconds`
    (None: no limit). `limit.expired` tells afterwards whether the deadline passed, even when the block
    swallowed the exception. `what` names the code for the message printed if the process must end."""

    def __init__(self, seconds: float | None, what: str, grace_s: float = GRACE_S) -> None:
        if seconds is not None and not seconds > 0:
            raise ValueError(f"a time limit must be a positive number of seconds or None, got {seconds!r}")
        self.seconds = seconds
        self.what = what
        self.grace_s = grace_s
        self.expired = False
        self._active = False
        self._done = threading.Event()
        self._sending = threading.Lock()  # the watchdog sends only while the block is still active
        self._watchdog: threading.Thread | None = None
        self._previous: object = None

    @property
    def armed(self) -> bool:
        """Whether the limit can act here: a limit was asked, in the main thread, on a platform with pthread_kill."""
        return (
            self.seconds is not None
            and hasattr(signal, "pthread_kill")
            and threading.current_thread() is threading.main_thread()
        )

    def __enter__(self) -> TimeLimit:
        if not self.armed:
            return self
        self._previous = signal.signal(LIMIT_SIGNAL, self._on_signal)
        self._active = True
        self._watchdog = threading.Thread(
            target=self._watch, args=(threading.main_thread().ident,), name="reward-time-limit", daemon=True
        )
        self._watchdog.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._watchdog is None:
            return
        # Order matters: once `_sending` is taken with the block inactive, no signal can follow, and one
        # already sent has reached the handler, which ignores it. The handler must never be the default
        # one when a signal lands: for a real-time signal that ends the process.
        self._active = False
        try:
            with self._sending:
                self._done.set()
            self._watchdog.join()
        finally:
            # None: the previous handler was not set from Python; the default is what was there.
            previous = self._previous if self._previous is not None else signal.SIG_DFL
            signal.signal(LIMIT_SIGNAL, previous)  # type: ignore[arg-type]
            self._watchdog = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._active:
            raise RewardTimeout(f"{self.what} ran past its time limit of {self.seconds:g} s")

    def _watch(self, main_thread_id: int | None) -> None:
        """The watchdog: at the deadline, interrupt the main thread; if the block still runs `grace_s`
        later, say so and end the process."""
        assert self.seconds is not None and main_thread_id is not None
        if self._done.wait(self.seconds):
            return
        with self._sending:
            if not self._active:
                return
            self.expired = True
            signal.pthread_kill(main_thread_id, LIMIT_SIGNAL)
        if self._done.wait(self.grace_s):
            return
        print(
            f"\nfulcrum: {self.what} is still running {self.grace_s:g} s after its time limit of "
            f"{self.seconds:g} s (it is in code that does not return to Python, or it caught the interruption); "
            "ending the process. The newest checkpoint is the last one written before this step.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(STUCK_EXIT_CODE)
