"""A time limit on every call into a tool or an interaction, enforced from outside the call.

`asyncio.wait_for` alone cannot stop a coroutine that blocks the event loop (`time.sleep`, a blocking
HTTP client, a busy loop): the timer that would cancel it runs on the very loop it blocks. So a user's
class (any class not defined in fulcrum.agent) runs its methods on a worker thread with an event loop of
its own, and the agent loop waits for the answer with a timeout on its own loop:

- a call that never returns, or blocks its thread, is abandoned at the limit: the caller gets
  CallTimeout and the run goes on. The worker's task is cancelled, which ends a coroutine that awaits;
  Python cannot stop a thread that blocks in C or in `time.sleep`, so that thread is left to finish on
  its own (a daemon: it never holds up the process's exit) and the next calls go to a new worker;
- fulcrum's own tools and interactions never block (the Python tool awaits its subprocess), so they run
  on the agent loop itself, under `asyncio.wait_for`, with no thread hop.

A user class's state bound to an event loop (an aiohttp session) lives on its worker's loop; after a
call of that class ran past its limit it is on a loop that is no longer used, which is the price of not
letting one stuck call hold up every conversation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

log = logging.getLogger("fulcrum.agent")

T = TypeVar("T")
PROBE_S = 0.5  # how long a worker's loop may take to answer before it counts as blocked
DEFAULT_TIMEOUT_S = 60.0  # multi_turn.call_timeout's default


class CallTimeout(Exception):
    """A tool or interaction call ran past its time limit and was abandoned."""


class CallExit(Exception):
    """A tool or interaction call raised SystemExit (carried as an ordinary exception: on an event loop
    SystemExit would stop the loop itself)."""

    def __init__(self, code: object) -> None:
        super().__init__(f"SystemExit({code!r})")
        self.code = code


async def exit_as_error(call: Callable[[], Awaitable[T]]) -> T:
    """`await call()`, a SystemExit it raises turned into CallExit before it reaches a task: a task
    re-raises SystemExit out of its event loop, which would stop every conversation."""
    try:
        return await call()
    except SystemExit as err:
        raise CallExit(err.code) from None


def trusted(obj: object) -> bool:
    """Whether `obj` is one of fulcrum's own tools or interactions (they never block the loop)."""
    return type(obj).__module__.startswith("fulcrum.agent.")


class Worker:
    """An event loop on a daemon thread of its own, for user classes' calls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fulcrum-tool-worker", daemon=True)
        self.thread.start()

    def submit(self, call: Callable[[], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Run `call()` (a method call returning an awaitable) on this worker's loop."""
        return asyncio.run_coroutine_threadsafe(exit_as_error(call), self.loop)

    def stop(self) -> None:
        """Stop the loop once it gets control back (now, unless a call blocks it)."""
        self.loop.call_soon_threadsafe(self.loop.stop)


class CallGuard:
    """Runs calls into tools and interactions with a time limit of `timeout_s` each."""

    def __init__(self, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(
                f"actor_rollout_ref.rollout.multi_turn.call_timeout: must be positive, got {timeout_s}"
            )
        self.timeout_s = float(timeout_s)
        self._worker: Worker | None = None
        self._lock = threading.Lock()

    def worker(self) -> Worker:
        with self._lock:
            if self._worker is None:
                self._worker = Worker()
            return self._worker

    async def retire_if_stuck(self, worker: Worker) -> None:
        """After a call ran past its limit: if the worker's loop does not answer within PROBE_S, a call
        blocks it, and later calls go to a new worker (this one stops if its loop ever comes back)."""
        probe: concurrent.futures.Future[None] = concurrent.futures.Future()
        worker.loop.call_soon_threadsafe(lambda: probe.done() or probe.set_result(None))
        try:
            await asyncio.wait_for(asyncio.wrap_future(probe), PROBE_S)
            return
        except asyncio.TimeoutError:
            pass
        with self._lock:
            if self._worker is worker:
                self._worker = None
        worker.stop()

    async def run(self, owner: object, call: Callable[[], Awaitable[Any]], what: str) -> Any:
        """`await call()` within the limit; CallTimeout (naming `what`) past it."""
        if trusted(owner):
            try:
                return await asyncio.wait_for(exit_as_error(call), self.timeout_s)
            except asyncio.TimeoutError:
                raise CallTimeout(f"{what} took longer than {self.timeout_s:g} s and was stopped") from None
        worker = self.worker()
        future = worker.submit(call)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except asyncio.TimeoutError:
            future.cancel()
            await self.retire_if_stuck(worker)
            log.warning("%s ran past its limit of %g s; abandoned", what, self.timeout_s)
            raise CallTimeout(f"{what} took longer than {self.timeout_s:g} s and was abandoned") from None
