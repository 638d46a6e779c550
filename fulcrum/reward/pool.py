"""Scoring in worker processes under a per-sample time limit, so that no sample can stall a run.

sympy (numina_*), Math-Verify and code tests can take unbounded time on a model's text, and some of it
in C code no signal interrupts. `ScoringPool.map` runs each call in one of `workers` long-lived
processes; a call still running `sample_timeout_s` after it started has its process killed and
replaced, and comes back as timed out (the manager scores it 0 and counts it in
`reward/num_timeouts`). A scorer may also raise `ScoringTimeout` itself (a time limit of its own).

The processes are started with "spawn" (the trainer holds CUDA state and threads that fork would
copy), once, on first use, and serve every later batch; `close()` ends them.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

STARTUP_S = 120.0


class ScoringTimeout(Exception):
    """A sample's scoring ran past its time limit."""


@dataclass
class Outcome:
    """One call's result: `value` when it returned; else `error` ("Type: text") and whether it timed out."""

    value: Any = None
    error: str | None = None
    timed_out: bool = False


def _serve(conn: Connection) -> None:
    """A worker: say it is ready, then run each (fn, args) received and send back ("ok", value) or
    ("timeout"|"error", text)."""
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        fn, args = task
        try:
            reply: tuple[str, Any] = ("ok", fn(*args))
        except ScoringTimeout as err:
            reply = ("timeout", str(err))
        except BaseException as err:  # SystemExit too: the sample fails, the worker lives
            reply = ("error", f"{type(err).__name__}: {err}")
        try:
            conn.send(reply)
        except Exception as err:  # a value that does not pickle
            conn.send(("error", f"the score could not be sent back: {type(err).__name__}: {err}"))


@dataclass
class _Worker:
    process: Any
    conn: Connection
    task: int | None = None
    started: float = 0.0


class ScoringPool:
    """`workers` processes scoring calls, each under `sample_timeout_s` seconds."""

    def __init__(self, workers: int, sample_timeout_s: float) -> None:
        if workers < 1:
            raise ValueError(f"reward_model.num_workers must be at least 1, got {workers}")
        if not sample_timeout_s > 0:
            raise ValueError(f"reward_model.sample_timeout_s must be positive, got {sample_timeout_s!r}")
        self.num_workers = workers
        self.sample_timeout_s = float(sample_timeout_s)
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []

    def _start(self, count: int) -> list[_Worker]:
        """`count` new workers, once each has started (a spawned process takes a second or two to
        import; its first sample's clock must not run meanwhile)."""
        started = []
        for _ in range(count):
            parent, child = self._context.Pipe()
            process = self._context.Process(target=_serve, args=(child,), daemon=True, name="fulcrum-scorer")
            process.start()
            child.close()
            started.append(_Worker(process, parent))
        for worker in started:
            if not worker.conn.poll(STARTUP_S) or worker.conn.recv()[0] != "ready":
                raise RuntimeError(f"a scoring process did not start within {STARTUP_S:g} s")
        return started

    def _replace(self, worker: _Worker) -> None:
        worker.process.kill()
        worker.process.join()
        worker.conn.close()
        self._workers[self._workers.index(worker)] = self._start(1)[0]

    def map(self, fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]]) -> list[Outcome]:
        """`fn(*args)` for each args of `calls`, in the workers; one Outcome per call, in order."""
        wanted = min(self.num_workers, max(len(calls), 1))
        if len(self._workers) < wanted:
            self._workers += self._start(wanted - len(self._workers))
        outcomes: list[Outcome | None] = [None] * len(calls)
        pending = list(range(len(calls)))[::-1]
        while pending or any(w.task is not None for w in self._workers):
            for worker in self._workers:
                if worker.task is None and pending:
                    worker.task, worker.started = pending.pop(), time.monotonic()
                    worker.conn.send((fn, calls[worker.task]))
            busy = [w for w in self._workers if w.task is not None]
            now = time.monotonic()
            wait_s = max(0.0, min(w.started + self.sample_timeout_s for w in busy) - now)
            ready = wait([w.conn for w in busy], timeout=wait_s)
            now = time.monotonic()
            for worker in busy:
                task = worker.task
                assert task is not None
                if worker.conn in ready:
                    try:
                        kind, payload = worker.conn.recv()
                    except (EOFError, OSError):
                        code = worker.process.exitcode
                        outcomes[task] = Outcome(error=f"the scoring process died (exit code {code})")
                        worker.task = None
                        self._replace(worker)
                        continue
                    outcomes[task] = (
                        Outcome(value=payload)
                        if kind == "ok"
                        else Outcome(error=payload, timed_out=kind == "timeout")
                    )
                    worker.task = None
                elif now - worker.started >= self.sample_timeout_s:
                    outcomes[task] = Outcome(
                        error=f"ScoringTimeout: scoring ran past reward_model.sample_timeout_s="
                        f"{self.sample_timeout_s:g} s",
                        timed_out=True,
                    )
                    worker.task = None
                    self._replace(worker)
        return [o if o is not None else Outcome(error="not scored") for o in outcomes]

    def close(self) -> None:
        """End the workers."""
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
        for worker in self._workers:
            worker.process.join(timeout=2)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.conn.close()
        self._workers = []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
