"""The request API on a CUDA device, with Triton kernels and CUDA graphs: a second turn over kept
blocks equals a fresh request over the whole prefix (fp32), only the new tokens are prefilled, and
conversations through the asyncio driver equal the engine driven by hand, graphs replayed throughout.

Run on the device machine: `pytest -q tests/test_rollout_requests_gpu.py`.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_rollout_requests import ids, run_to  # tests/ is on sys.path under pytest

from fulcrum.rollout import SamplingParams
from fulcrum.rollout.driver import AsyncRollout
from fulcrum.rollout.native import EngineConfig, NativeEngine
from fulcrum.rollout.testing import random_causal_lm

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def engine_for(model: torch.nn.Module, **overrides) -> NativeEngine:
    config = dict(max_num_seqs=16, max_num_batched_tokens=128, max_model_len=512, decode_steps=4)
    engine = NativeEngine(
        model, [1], 0, EngineConfig(**{**config, "dtype": torch.float32, **overrides}), CUDA
    )
    assert engine.runner.use_triton and engine.runner.use_graphs
    return engine


def test_a_second_turn_equals_a_fresh_request_with_graphs_and_kernels():
    model = random_causal_lm("qwen2", init_std=0.2).to(CUDA)
    engine = engine_for(model)
    prompt, tool = ids(0, 37), ids(1, 9)
    first = run_to(engine, engine.add_request(prompt, GREEDY, keep=True))
    before = engine.counters["prefill_tokens"]
    engine.resume(first.seq_id, tool, GREEDY)
    second = run_to(engine, first.seq_id)
    assert engine.counters["prefill_tokens"] - before == len(tool) + 1
    assert second.loss_mask == [1] * 12 + [0] * 9 + [1] * 12
    fresh = run_to(engine, engine.add_request(prompt + second.token_ids[:21], GREEDY))
    assert fresh.token_ids == second.last_turn
    torch.testing.assert_close(
        torch.tensor(second.logprobs[21:]), torch.tensor(fresh.logprobs), atol=1e-4, rtol=0
    )
    assert engine.runner.graphs, "decode ran through CUDA graphs"


def test_conversations_through_the_driver_equal_the_engine_driven_by_hand_on_cuda():
    model = random_causal_lm("llama", init_std=0.2).to(CUDA)
    plans = {i: [ids(10 * i + t, 2 + (i + t) % 5) for t in range(i % 4)] for i in range(12)}

    async def one(rollout: AsyncRollout, index: int) -> list[int]:
        [turn] = await rollout.generate(ids(50 + index, 5 + 7 * index), GREEDY, keep=True)
        for answer in plans[index]:
            await asyncio.sleep(0)
            turn = await rollout.resume(turn.seq_id, answer, GREEDY, keep=True)
        rollout.release(turn.seq_id)
        return turn.token_ids

    async def all_of(engine: NativeEngine) -> list[list[int]]:
        rollout = AsyncRollout(engine)
        return list(await asyncio.gather(*(one(rollout, i) for i in range(12))))

    together = asyncio.run(all_of(engine_for(model, num_kv_blocks=40, block_size=8)))
    for index in range(12):
        alone = engine_for(model)
        turn = run_to(alone, alone.add_request(ids(50 + index, 5 + 7 * index), GREEDY, keep=True))
        for answer in plans[index]:
            alone.resume(turn.seq_id, answer, GREEDY, keep=True)
            turn = run_to(alone, turn.seq_id)
        assert turn.token_ids == together[index], f"conversation {index}"


def test_seeded_generate_repeats_with_the_triton_sampler():
    model = random_causal_lm("qwen2", init_std=0.2).to(CUDA)
    engine = engine_for(model)
    prompts = [ids(i, 5 + 9 * i) for i in range(4)]
    params = SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=9, ignore_eos=True)
    assert engine.generate(prompts, params).token_ids == engine.generate(prompts, params).token_ids
