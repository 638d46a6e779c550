"""The asyncio driver over the native engine: conversations await their own turns while one loop
steps the engine; tools awaited in one conversation run while the others decode, the results equal
the engine driven by hand, and a seed repeats when the tools answer without real waiting."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_rollout_requests import GREEDY, conversation_plan, engine_for, ids, run_conversations

from fulcrum.rollout import SamplingParams
from fulcrum.rollout.base import SequenceOutput
from fulcrum.rollout.driver import AsyncRollout
from fulcrum.rollout.testing import random_causal_lm


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    return random_causal_lm("qwen2", init_std=0.2)


async def conversation(rollout: AsyncRollout, index: int, params: SamplingParams) -> SequenceOutput:
    """The conversations of `run_conversations`: each tool answer comes after one pass of the event loop."""
    [turn] = await rollout.generate(ids(7 + index, 3 + 11 * index % 40), params, keep=True)
    for answer in conversation_plan(index):
        await asyncio.sleep(0)  # the tool
        turn = await rollout.resume(turn.seq_id, answer, params, keep=True)
    rollout.release(turn.seq_id)
    return turn


def drive(model: torch.nn.Module, count: int, params: SamplingParams, step_in_thread: bool = False) -> list:
    engine = engine_for(model)

    async def main() -> list[SequenceOutput]:
        rollout = AsyncRollout(engine, step_in_thread=step_in_thread)
        try:
            return list(await asyncio.gather(*(conversation(rollout, i, params) for i in range(count))))
        finally:
            rollout.close()

    outputs = asyncio.run(main())
    assert engine.counters["held"] == 0 and engine.counters["blocks_in_use"] == 0
    return [(out.token_ids, out.loss_mask) for out in outputs]


@pytest.mark.parametrize("step_in_thread", [False, True])
def test_conversations_through_the_driver_equal_the_engine_driven_by_hand(model, step_in_thread):
    by_hand = run_conversations(engine_for(model), 7, GREEDY)
    expected = [(out.token_ids, out.loss_mask) for _, out in sorted(by_hand.items())]
    assert drive(model, 7, GREEDY, step_in_thread) == expected


def test_a_seed_repeats_through_the_driver(model):
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=4)
    first = drive(model, 5, params)
    assert first == drive(model, 5, params)
    assert len({tuple(tokens) for tokens, _ in first}) == 5


def test_a_waiting_tool_does_not_hold_up_the_other_conversations(model):
    """Conversation 0's tool answers only when conversation 1 has finished all its turns: the loop
    keeps stepping the others while a tool waits (a blocking driver would never return)."""
    engine = engine_for(model)

    async def main() -> list[str]:
        rollout = AsyncRollout(engine)
        other_done = asyncio.Event()
        order: list[str] = []

        async def slow() -> None:
            [turn] = await rollout.generate(ids(1, 9), GREEDY, keep=True)
            await asyncio.wait_for(other_done.wait(), timeout=30)  # the slow tool
            order.append("slow tool answered")
            turn = await rollout.resume(turn.seq_id, [5, 6, 7], GREEDY)
            assert turn.loss_mask == [1] * 6 + [0] * 3 + [1] * 6

        async def fast() -> None:
            [turn] = await rollout.generate(ids(2, 13), GREEDY, keep=True)
            for answer in ([8], [9, 10]):
                turn = await rollout.resume(turn.seq_id, answer, GREEDY, keep=True)
            rollout.release(turn.seq_id)
            order.append("fast conversation done")
            other_done.set()

        await asyncio.gather(slow(), fast())
        return order

    assert asyncio.run(main()) == ["fast conversation done", "slow tool answered"]


def test_a_refused_turn_fails_its_own_caller_only(model):
    engine = engine_for(model, max_model_len=40)

    async def main() -> tuple[BaseException | None, list[SequenceOutput]]:
        rollout = AsyncRollout(engine)
        results = await asyncio.gather(
            rollout.generate(ids(0, 39), GREEDY), rollout.generate(ids(1, 8), GREEDY), return_exceptions=True
        )
        return results[0], results[1]

    error, ok = asyncio.run(main())
    assert isinstance(error, ValueError) and "max_model_len=40" in str(error)
    assert len(ok) == 1 and len(ok[0].token_ids) == 6
