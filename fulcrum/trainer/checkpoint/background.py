"""One checkpoint write at a time beside training, in a forked process; its error comes back to the trainer.

The trainer hands over a write (serialise, hash, fsync, rename: `CheckpointManager` builds it from a
host snapshot) and goes on training. `wait()` waits for it and raises what it raised, so a full disk
reads as the same `DiskFullError` whether the write ran in the step or beside it. The next save, the
end of the run and every error exit call `wait()` first; a stop that must not wait (a second Ctrl-C)
calls `cancel()`, which makes the write stop at its next file and remove its temporary folder. A
killed trainer leaves that folder behind under its own pid: resume never reads it and deletes it.

Why a process and not a thread: on an H200 the seed run's steps after a save ran 2-3x slower while a
writer thread wrote 12 GB beside them (17.5 s against 7.5; the phases that launch many small kernels
from Python, 4-10x), a price the 1.2-1.6 s stall of the save itself did not show. Training and writer
then share one interpreter lock: each of the thousands of times a step's thread lets go of it (every
torch op and kernel launch does) the writer can take it. A forked child shares nothing but the
snapshot's memory, which it reads copy-on-write (the trainer does not touch those host buffers until
the next save, which waits for this write first). The child runs only this package's writer (files,
torch.save and safetensors of host tensors, hashes): it never touches CUDA (torch refuses CUDA in a
forked child, loudly), uses one CPU thread (an OpenMP pool does not survive fork), ignores Ctrl-C (the
trainer decides whether a write goes on), runs at a lower priority than training, and dies with the
trainer (Linux: PR_SET_PDEATHSIG), so a SIGKILL of the trainer kills its write too. Where `os.fork`
is missing the write runs on a thread, as it does with FULCRUM_CHECKPOINT_WRITER=thread (the
comparison `bench/features.sh` makes).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

THREAD_NAME = "fulcrum-checkpoint-writer"
WRITER_NICE = 10  # the child's niceness above the trainer's: training gets the CPU when both want it
RESULT_LIMIT = 32 * 1024  # bytes of the child's report (less than a pipe holds, so its write never blocks)


class WriteCancelled(Exception):
    """Raised inside a write that `cancel()` stopped; its clean-up runs, nothing is published."""


class WriterDied(RuntimeError):
    """The writer process ended without a report (killed, or crashed outside Python)."""


def writer_kind() -> str:
    """`process` (forked, the default where the platform forks) or `thread`."""
    asked = os.environ.get("FULCRUM_CHECKPOINT_WRITER", "process")
    if asked not in ("process", "thread"):
        raise ValueError(f"FULCRUM_CHECKPOINT_WRITER={asked!r}: expected 'process' or 'thread'")
    return asked if hasattr(os, "fork") else "thread"


class BackgroundWriter:
    """Runs one write at a time in a forked child (or on a thread); see the module docstring.

    `seconds_of_finished()` gives, once, how long the last write took (for `perf/checkpoint_write_s`).
    """

    def __init__(self, kind: str | None = None) -> None:
        self.kind = kind or writer_kind()
        self._thread: threading.Thread | None = None
        self._child: tuple[int, int] | None = None  # (pid, read end of its report pipe)
        self._done = False  # the write in flight has ended and its result is taken
        self._error: BaseException | None = None
        self._cancel = threading.Event()  # in the child: set by SIGTERM (`cancel()` of the trainer)
        self._in_child = False
        self._started = 0.0
        self._seconds: float | None = None  # of the last finished write, until it is reported
        self.label = ""  # what the running (or last) write is writing, for messages

    @property
    def busy(self) -> bool:
        """A write is running now."""
        if self._thread is not None:
            return self._thread.is_alive()
        return self._child is not None and not self._poll()

    def submit(self, label: str, write: Callable[[], Any]) -> None:
        """Start `write()` beside training. Call `wait()` first: one write at a time."""
        if self._thread is not None or self._child is not None:
            raise RuntimeError(f"checkpoint write {self.label} still pending: wait() for it first")
        self._cancel.clear()
        self.label = label
        self._started = time.perf_counter()
        self._done = False
        if self.kind == "thread":
            self._thread = threading.Thread(target=self._run_thread, args=(write,), name=THREAD_NAME)
            self._thread.start()
        else:
            self._fork(write)

    def _run_thread(self, write: Callable[[], Any]) -> None:
        try:
            write()
        except BaseException as exc:  # raised again on the trainer's thread by wait()
            self._error = exc
        finally:
            self._seconds = time.perf_counter() - self._started

    def _fork(self, write: Callable[[], Any]) -> None:
        read_end, write_end = os.pipe()
        parent = os.getpid()
        # Ctrl-C and SIGTERM stay blocked across the fork, so the child sets its own handlers first.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            with warnings.catch_warnings():
                # Python warns that fork() in a process with threads may deadlock the child: this child
                # takes no lock another thread can hold (see the module docstring) and ends in os._exit.
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            os.close(read_end)
            os.close(write_end)
            raise
        if pid == 0:
            os.close(read_end)
            self._run_child(write, write_end, parent, blocked)  # never returns
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        os.close(write_end)
        self._child = (pid, read_end)

    def _run_child(self, write: Callable[[], Any], report: int, parent: int, blocked: set[Any]) -> None:
        """The forked writer: run `write()`, send (seconds, error) to the trainer, exit without clean-up
        (the trainer's atexit handlers and buffered output are the trainer's)."""
        code = 1
        try:
            self._in_child = True
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, lambda *_: self._cancel.set())
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            _die_with(parent)
            os.nice(WRITER_NICE)
            import torch  # already imported by the trainer: no import runs here

            torch.set_num_threads(1)
            started = time.perf_counter()
            error: BaseException | None = None
            try:
                write()
            except BaseException as exc:
                error = exc
            os.write(report, _report(time.perf_counter() - started, error))
            code = 0
        finally:
            os._exit(code)

    def _poll(self) -> bool:
        """Whether the forked write has ended (its result taken if so); never blocks."""
        if self._done or self._child is None:
            return True
        ended, status = os.waitpid(self._child[0], os.WNOHANG)
        if ended == 0:
            return False
        self._take_result(status)
        return True

    def _take_result(self, status: int | None = None) -> None:
        """Read the child's report (blocking until it ends) and reap it."""
        assert self._child is not None
        pid, read_end = self._child
        chunks = []
        while chunk := os.read(read_end, 65536):
            chunks.append(chunk)
        os.close(read_end)
        if status is None:
            _, status = os.waitpid(pid, 0)
        data = b"".join(chunks)
        if data:
            seconds, self._error = pickle.loads(data)
        else:
            seconds = time.perf_counter() - self._started
            how = f"signal {-os.waitstatus_to_exitcode(status)}" if os.WIFSIGNALED(status) else "no report"
            self._error = WriterDied(f"checkpoint write {self.label}: the writer process ended ({how})")
        self._seconds = seconds
        self._done = True

    def check_cancelled(self) -> None:
        """Called by the write between files: raises WriteCancelled once `cancel()` asked it to stop."""
        here = self._in_child or threading.current_thread() is self._thread
        if here and self._cancel.is_set():
            raise WriteCancelled(f"checkpoint write {self.label} cancelled")

    def wait(self) -> None:
        """Block until the running write (if any) ends; raise its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        elif self._child is not None:
            if not self._done:
                self._take_result()
            self._child = None
        else:
            return
        error, self._error = self._error, None
        if error is not None and not isinstance(error, WriteCancelled):
            raise error

    def cancel(self) -> BaseException | None:
        """Stop the running write at its next file (it removes its temporary folder) and wait for that.
        A write that had already published its checkpoint finishes normally. Returns the error a write
        failed with on its own (not raised: the caller is already stopping for another reason)."""
        self._cancel.set()
        if self._child is not None and not self._poll():
            os.kill(self._child[0], signal.SIGTERM)
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
        self._poll()
        seconds, self._seconds = self._seconds, None
        return seconds


def _report(seconds: float, error: BaseException | None) -> bytes:
    """The child's result for the trainer: the error itself where it pickles small, else its text."""
    try:
        data = pickle.dumps((seconds, error))
    except Exception:
        data = b""
    if not data or len(data) > RESULT_LIMIT:
        from fulcrum.trainer.checkpoint.layout import CheckpointError

        text = f"{type(error).__name__}: {error}"[: RESULT_LIMIT // 4]
        data = pickle.dumps((seconds, CheckpointError(text)))
    return data


def _die_with(parent: int) -> None:
    """Have the kernel kill this process when the trainer dies (Linux), and leave if it already has."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)
