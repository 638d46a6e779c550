"""The asyncio driver over the native engine: conversations await their own turns while one loop
steps the engine; tools awaited in one conversation run while the others decode, the results equal
the engine driven by hand, a seed repeats when the tools answer without real waiting, every turn
whose tool has answered joins the next step, and the loop waits for slow tools without spinning."""

from __future__ import annotations

import asyncio
import time

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


def test_sampled_conversations_equal_the_engine_driven_by_hand_with_answers_in_the_next_step(model):
    """A coroutine tool's answer joins the step right after the turn it answers, as when the engine is
    driven by hand: the same calls between the same steps, so the same sampled tokens."""
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=4)
    engine = engine_for(model)
    engine.seed_requests(params)
    by_hand = run_conversations(engine, 7, params)
    assert drive(model, 7, params) == [(out.token_ids, out.loss_mask) for _, out in sorted(by_hand.items())]


async def two_passes() -> None:
    """A coroutine tool that yields to the event loop twice before it answers."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


async def one_millisecond() -> None:
    """A tool that answers after 1 ms of wall clock, while the next step runs (each step here blocks
    for 20 ms): its timer fires during that step."""
    await asyncio.sleep(0.001)


@pytest.mark.parametrize(("tool", "answered_by"), [(two_passes, 0), (one_millisecond, 1)])
def test_every_turn_whose_tool_answered_joins_the_next_step(model, tool, answered_by):
    """While a long turn keeps the engine stepping, short conversations' tools answer: each answer is
    prefilled in the first step that starts after it came, all of them together.

    `answered_by`: the steps run after a turn's step before its tool has answered (0: between steps)."""
    engine = engine_for(model)
    step = engine.step
    log: list[tuple[set[int], set[int]]] = []  # per step: (seq ids waiting before it, ids it finished)

    def logged_step() -> list[SequenceOutput]:
        waiting = {seq.output_index for seq in engine.scheduler.waiting}
        time.sleep(0.02)
        outs = step()
        log.append((waiting, {out.seq_id for out in outs}))
        return outs

    engine.step = logged_step

    async def short(rollout: AsyncRollout, index: int) -> int:
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        [turn] = await rollout.generate(ids(index, 5 + index), params, keep=True)
        for _ in range(2):
            await tool()
            turn = await rollout.resume(turn.seq_id, [5, 6], params, keep=True)
        rollout.release(turn.seq_id)
        return turn.seq_id

    async def main() -> list[int]:
        rollout = AsyncRollout(engine)
        long_turn = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        *shorts, _ = await asyncio.gather(
            *(short(rollout, i) for i in range(4)), rollout.generate(ids(9, 7), long_turn)
        )
        return shorts

    shorts = set(asyncio.run(main()))
    turns_ended = [k for k, (_, done) in enumerate(log) if shorts & done]
    assert len(turns_ended) == 3 and all(log[k][1] >= shorts for k in turns_ended)  # in step, together
    for k in turns_ended[:-1]:
        assert all(not shorts & waiting for waiting, _ in log[k + 1 : k + 1 + answered_by])
        assert log[k + 1 + answered_by][0] == shorts


def test_the_loop_waits_for_a_slow_tool_without_spinning_and_stops_after_the_last_release(model):
    engine = engine_for(model)

    async def main() -> tuple[float, int, int]:
        rollout = AsyncRollout(engine)
        [turn] = await rollout.generate(ids(3, 8), GREEDY, keep=True)
        cpu = time.process_time()
        await asyncio.sleep(0.3)  # the tool; the loop stays, waiting for the next call
        cpu = time.process_time() - cpu
        tasks_while_held = len(asyncio.all_tasks())
        turn = await rollout.resume(turn.seq_id, [5, 6], GREEDY, keep=True)
        rollout.release(turn.seq_id)
        for _ in range(10):
            await asyncio.sleep(0)
        return cpu, tasks_while_held, len(asyncio.all_tasks())

    cpu, tasks_while_held, tasks_at_end = asyncio.run(main())
    assert cpu < 0.1  # a spinning loop would take the whole 0.3 s
    assert tasks_while_held == 2 and tasks_at_end == 1  # main, and the loop until the release
    assert engine.counters["held"] == 0 and engine.counters["blocks_in_use"] == 0


def test_closing_stops_a_loop_that_waits_for_held_turns_that_will_not_come_back(model):
    async def main() -> int:
        rollout = AsyncRollout(engine_for(model))
        await rollout.generate(ids(4, 8), GREEDY, keep=True)  # held, never resumed nor released
        rollout.close()
        await asyncio.sleep(0)
        return len(asyncio.all_tasks())

    assert asyncio.run(main()) == 1
