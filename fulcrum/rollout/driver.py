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
is touched by one caller at a time. Before each step the loop yields once to the event loop, so that
every conversation ready to ask for a turn joins that step. Whether two runs give the same tokens
under a seed depends on the same turns joining the same steps: with tools that answer without real
waiting (coroutines, functions) the event loop's order is fixed and so are the tokens; with tools
that take wall-clock time (a process, a network call) a turn joins whichever step follows its answer,
and the tokens of every conversation sharing those steps can change from run to run.

`step_in_thread=True` runs each step in a worker thread, so that the event loop keeps serving tool
coroutines while the device works; the default runs it on the loop (tools in other processes run
concurrently either way, and are seen between steps).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from fulcrum.rollout.base import RequestEngine, SamplingParams, SequenceOutput


class AsyncRollout:
    """Awaitable turns over a `RequestEngine` (the native engine), batched by one stepping loop."""

    def __init__(self, engine: RequestEngine, step_in_thread: bool = False) -> None:
        self.engine = engine
        self._queued: list[Callable[[], None]] = []  # engine calls made before the next step
        self._waiters: dict[int, asyncio.Future[SequenceOutput]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1) if step_in_thread else None

    async def generate(
        self, prompt: list[int], params: SamplingParams, keep: bool = False
    ) -> list[SequenceOutput]:
        """The `params.n` samples of `prompt`, once all have finished (ordered by sample)."""
        box: list[asyncio.Future[SequenceOutput]] = []

        def add() -> None:
            request_id = self.engine.add_request(prompt, params, keep)
            box.extend(self._wait_for(request_id + j) for j in range(params.n))

        await self._submit(add)
        return list(await asyncio.gather(*box))

    async def resume(
        self, seq_id: int, tokens: list[int], params: SamplingParams, keep: bool = False
    ) -> SequenceOutput:
        """The next turn of held sample `seq_id`: `tokens` appended (loss mask 0), then sampling."""
        box: list[asyncio.Future[SequenceOutput]] = []

        def add() -> None:
            self.engine.resume(seq_id, tokens, params, keep)
            box.append(self._wait_for(seq_id))

        await self._submit(add)
        return await box[0]

    def release(self, seq_id: int) -> None:
        """Free held sample `seq_id`'s KV blocks (between steps, as every other engine call)."""
        self._queued.append(lambda: self.engine.release(seq_id))
        self._ensure_loop()

    def close(self) -> None:
        """Stop the worker thread (the engine itself stays usable)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------------------ internals
    def _wait_for(self, seq_id: int) -> asyncio.Future[SequenceOutput]:
        future: asyncio.Future[SequenceOutput] = asyncio.get_running_loop().create_future()
        self._waiters[seq_id] = future
        return future

    async def _submit(self, add: Callable[[], None]) -> None:
        """Queue `add` for the next gap between steps and wait until it ran (its error is the caller's)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def call() -> None:
            try:
                add()
            except Exception as err:  # a refused request fails its own caller, not the loop
                done.set_exception(err)
            else:
                done.set_result(None)

        self._queued.append(call)
        self._ensure_loop()
        await done

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        """Step while anything is queued or in flight; stops when idle (the next call restarts it)."""
        try:
            while True:
                await asyncio.sleep(0)  # conversations ready to ask for a turn do so before the step
                queued, self._queued = self._queued, []
                for call in queued:
                    call()
                if not self.engine.has_unfinished_requests():
                    if self._queued:
                        continue
                    return
                for out in await self._step():
                    waiter = self._waiters.pop(out.seq_id, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(out)
        except BaseException as err:
            for waiter in self._waiters.values():
                if not waiter.done():
                    waiter.set_exception(
                        err if isinstance(err, Exception) else RuntimeError("stepping stopped")
                    )
            self._waiters.clear()
            raise

    async def _step(self) -> list[SequenceOutput]:
        if self._executor is None:
            return self.engine.step()
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.step)
