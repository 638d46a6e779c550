"""An asyncio front for a request engine: each conversation awaits its own turns, one background
loop steps the engine over everything in flight.

    rollout = AsyncRollout(engine)
    async def conversation(prompt):
        [turn] = await rollout.generate(prompt, params, keep=True)
        while wants_tool(turn.last_turn):
            answer = await run_tool(turn.last_turn)          # other conversations decode meanwhile
            turn = await rollout.resume(turn.seq_id, answer, params, keep=True)
        rollout.release(turn.seq_id)
        return turn                                          # token_ids, logprobs, loss_mask
    await asyncio.gather(*(conversation(p) for p in prompts))

Turns are handed to the engine only between steps, in the order they were asked for, so the engine
is touched by one caller at a time. Before each step the loop lets the event loop run until
`QUIET_PASSES` passes in a row bring no new call, so that every conversation whose tool has answered
joins that step: a coroutine tool, and a tool whose timer or I/O fired during the last step, take
a pass or two to reach `resume` (the callback, then the conversation's task). By default the engine
steps on the loop itself, so the device waits for the conversations' Python either way: the passes
only decide which step a turn joins.

Whether two runs give the same tokens under a seed depends on the same turns joining the same steps:
with tools that answer without real waiting (coroutines, functions) the event loop's order is fixed
and so are the tokens; with tools that take wall-clock time (a process, a network call) a turn joins
whichever step follows its answer, and the tokens of every conversation sharing those steps can
change from run to run.

The loop lives from the first call until nothing is in flight and no turn is held: while every
conversation awaits its tool it waits for the next call (no spinning), and it stops once the last
held turn is resumed or released.

`step_in_thread=True` runs each step in a worker thread, so that the event loop keeps serving tool
coroutines while the device works; the default runs it on the loop (tools in other processes run
concurrently either way, and are seen between steps).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fulcrum.rollout.base import RequestEngine, SamplingParams, SequenceOutput

QUIET_PASSES = 3  # passes of the event loop in a row without a new call before a step
MAX_PASSES = 100  # a caller that adds a request on every pass still lets the engine step


class _Samples:
    """The n samples of one request until the last has finished (a request of one sample waits on
    its future alone): each caller wakes once, when its whole answer is there."""

    __slots__ = ("first", "future", "left", "outputs")

    def __init__(self, future: asyncio.Future[list[SequenceOutput]], first: int, count: int) -> None:
        self.future = future
        self.first = first
        self.outputs: list[SequenceOutput | None] = [None] * count
        self.left = count

    def done(self) -> bool:
        return self.future.done()

    def set_result(self, out: SequenceOutput) -> None:
        self.outputs[out.seq_id - self.first] = out
        self.left -= 1
        if self.left == 0:
            self.future.set_result(self.outputs)  # type: ignore[arg-type]


class AsyncRollout:
    """Awaitable turns over a `RequestEngine` (the native engine), batched by one stepping loop."""

    def __init__(self, engine: RequestEngine, step_in_thread: bool = False) -> None:
        self.engine = engine
        # Engine calls made since the last step: (method, its arguments, the future its caller awaits;
        # None for a release). Plain tuples: a batch of conversations makes thousands of them.
        self._queued: list[tuple[Callable[..., None], tuple, asyncio.Future | None]] = []
        # Finished turns go to: the future of a one-sample call, or the `_Samples` of an n-sample request.
        self._waiters: dict[int, asyncio.Future[Any] | _Samples] = {}
        self._held: set[int] = set()  # turns handed back held and not yet resumed or released
        self._loop_task: asyncio.Task[None] | None = None
        self._idle: asyncio.Future[None] | None = None  # set when a call comes while nothing is in flight
        self._executor = ThreadPoolExecutor(max_workers=1) if step_in_thread else None

    async def generate(
        self, prompt: list[int], params: SamplingParams, keep: bool = False
    ) -> list[SequenceOutput]:
        """The `params.n` samples of `prompt`, once all have finished (ordered by sample)."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue(self._add, (prompt, params, keep, future), future)
        result = await future
        return result if params.n > 1 else [result]

    async def resume(
        self, seq_id: int, tokens: list[int], params: SamplingParams, keep: bool = False
    ) -> SequenceOutput:
        """The next turn of held sample `seq_id`: `tokens` appended (loss mask 0), then sampling."""
        future: asyncio.Future[SequenceOutput] = asyncio.get_running_loop().create_future()
        self._held.discard(seq_id)
        self._queue(self._resume, (seq_id, tokens, params, keep, future), future)
        return await future

    def release(self, seq_id: int) -> None:
        """Free held sample `seq_id`'s KV blocks (between steps, as every other engine call)."""
        self._held.discard(seq_id)
        self._queue(self.engine.release, (seq_id,), None)

    def close(self) -> None:
        """Stop the loop if no caller waits on it (it would wait for held turns that will not come
        back), and the worker thread (the engine itself stays usable)."""
        if self._loop_task is not None and not (self._waiters or self._queued):
            self._loop_task.cancel()
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------------------ internals
    def _add(self, prompt: list[int], params: SamplingParams, keep: bool, future: asyncio.Future) -> None:
        first = self.engine.add_request(prompt, params, keep)
        if params.n == 1:
            self._waiters[first] = future
            return
        samples = _Samples(future, first, params.n)
        for j in range(params.n):
            self._waiters[first + j] = samples

    def _resume(
        self, seq_id: int, tokens: list[int], params: SamplingParams, keep: bool, future: asyncio.Future
    ) -> None:
        self.engine.resume(seq_id, tokens, params, keep)
        self._waiters[seq_id] = future

    def _queue(self, method: Callable[..., None], args: tuple, future: asyncio.Future | None) -> None:
        """Hand `method(*args)` to the engine in the next gap between steps; its error fails `future`."""
        self._queued.append((method, args, future))
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        elif self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    async def _gather_calls(self) -> None:
        """Let the event loop run until QUIET_PASSES passes in a row bring no new call."""
        quiet = passes = 0
        while quiet < QUIET_PASSES and passes < MAX_PASSES:
            before = len(self._queued)
            await asyncio.sleep(0)
            quiet = quiet + 1 if len(self._queued) == before else 0
            passes += 1

    def _hand_over(self) -> None:
        """The queued calls, in the order they were made (a refused request fails its own caller)."""
        queued, self._queued = self._queued, []
        for method, args, future in queued:
            try:
                method(*args)
            except Exception as err:
                if future is None:
                    raise
                future.set_exception(err)

    async def _run(self) -> None:
        """Step while anything is queued or in flight; wait while turns are held; stop otherwise."""
        try:
            while True:
                await self._gather_calls()
                self._hand_over()
                if not self.engine.has_unfinished_requests():
                    if not self._held:
                        return
                    self._idle = asyncio.get_running_loop().create_future()
                    await self._idle  # every conversation awaits a tool: wait for its next call
                    self._idle = None
                    continue
                for out in await self._step():
                    if out.held:
                        self._held.add(out.seq_id)
                    waiter = self._waiters.pop(out.seq_id, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(out)
        except BaseException as err:
            failed = err if isinstance(err, Exception) else RuntimeError("stepping stopped")
            waiters = [w.future if isinstance(w, _Samples) else w for w in self._waiters.values()]
            for future in waiters + [f for _, _, f in self._queued if f is not None]:
                if not future.done():
                    future.set_exception(failed)
            self._waiters.clear()
            self._queued.clear()
            raise

    async def _step(self) -> list[SequenceOutput]:
        if self._executor is None:
            return self.engine.step()
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.step)
