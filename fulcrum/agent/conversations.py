"""A batch of conversations through the native engine: the multi-turn counterpart of `generate`.

`run_conversations(engine, loop, requests, params)` seeds the engine's sampler with `params.seed` (the
same requests under the same seed give the same conversations, as long as the tools answer without
real waiting: see fulcrum.rollout.driver), runs every prompt's `n` conversations at once on one
`AsyncRollout`, and returns them prompt-major (sample j of prompt i at i * n + j), as `generate` orders
its samples. Like `generate`, it leaves nothing in flight (an error aborts what was running) and frees
the KV cache at the end under `rollout.free_cache_engine`. The engine's figures for the rollout
(prefill and decode time, prefilled tokens, preemptions, evictions of held conversations, the decode's
memory floor) are left in its `metrics()`, as `generate` leaves its own.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from fulcrum.agent.loop import Conversation, ConversationRequest, ToolAgentLoop
from fulcrum.rollout.base import SamplingParams
from fulcrum.rollout.driver import AsyncRollout
from fulcrum.rollout.native.pipeline import figures_between

if TYPE_CHECKING:
    from fulcrum.rollout.native import NativeEngine


async def _all(
    engine: NativeEngine, loop: ToolAgentLoop, requests: list[ConversationRequest], params: SamplingParams
) -> list[Conversation]:
    rollout = AsyncRollout(engine)
    try:
        groups = await asyncio.gather(*(loop.run(rollout, r, params, i) for i, r in enumerate(requests)))
    finally:
        rollout.close()
    return [conversation for group in groups for conversation in group]


def run_conversations(
    engine: NativeEngine, loop: ToolAgentLoop, requests: list[ConversationRequest], params: SamplingParams
) -> list[Conversation]:
    """Every request's `params.n` conversations, prompt-major (see the module docstring)."""
    if not requests:
        return []
    engine.seed_requests(params)
    before = engine.counters
    start = time.perf_counter()
    try:
        conversations = asyncio.run(_all(engine, loop, requests, params))
    except BaseException:
        engine.close()  # drops what was in flight and the cache; the next rollout takes them again
        raise
    if engine.config.free_cache_engine:
        engine.sleep()
    after = engine.counters
    engine.stats.update(figures_between(before, after))
    engine.stats["generate_s"] = time.perf_counter() - start
    return conversations
