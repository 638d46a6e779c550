"""The native engine split over 2 tensor-parallel ranks (gloo, CPU) gives TP=1's greedy output token for
token, with preemption, chunked prefill and n > 1; the head and column shards follow the rules."""

from __future__ import annotations

import pytest
import torch
from helpers_dist import run_ranks

from fulcrum.parallel.tensor_parallel import HeadShard, shard_heads, shard_range
from fulcrum.rollout.base import SamplingParams
from fulcrum.rollout.native import EngineConfig, NativeEngine
from fulcrum.rollout.testing import random_causal_lm

CPU = torch.device("cpu")
EOS = 1
LENGTHS = [1, 90, 7, 40, 16, 3]


def test_heads_split_and_kv_heads_replicate_when_fewer_than_ranks():
    # Qwen2.5-0.5B: 14 query heads, 2 K/V heads
    assert shard_heads(14, 2, 1, 2) == HeadShard(7, 14, 1, 2)
    # 2 K/V heads over 4 ranks: ranks 0-1 read head 0, ranks 2-3 head 1
    assert [shard_heads(8, 2, r, 4) for r in range(4)] == [
        HeadShard(0, 2, 0, 1),
        HeadShard(2, 4, 0, 1),
        HeadShard(4, 6, 1, 2),
        HeadShard(6, 8, 1, 2),
    ]
    assert shard_range(4864, 1, 2, "intermediate_size") == (2432, 4864)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=4 does not divide the model's 14"):
        shard_heads(14, 2, 0, 4)
    with pytest.raises(ValueError, match="neither divides nor is a multiple of the model's 3 key/value"):
        shard_heads(12, 3, 0, 2)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (n,), generator=generator).tolist() for n in LENGTHS]


def _generate_tp(rank: int, world: int, arch: str, kv_heads: int) -> dict:
    from fulcrum.parallel.tensor_parallel import tensor_parallel_group

    torch.set_num_threads(1)
    model = random_causal_lm(arch, init_std=0.2, num_key_value_heads=kv_heads)
    # 12 blocks of 16 tokens cannot hold 12 sequences of up to 110 tokens: preemption is forced.
    config = EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256, decode_steps=3, num_kv_blocks=12
    )
    params = SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True)
    engine = NativeEngine(model, [EOS], 0, config, CPU, tp=tensor_parallel_group(world))
    out = engine.generate(prompts(), params)
    single = NativeEngine(model, [EOS], 0, config, CPU).generate(prompts(), params)
    return {
        "tp": (engine.tp.rank, engine.tp.size, engine.model.num_heads, engine.model.num_kv_heads),
        "cache_heads": engine.runner._cache_shape()[3],
        "preemptions": engine.stats["preemptions"],
        "tokens": out.token_ids,
        "logprobs": out.logprobs,
        "single_tokens": single.token_ids,
        "single_logprobs": single.logprobs,
    }


@pytest.mark.parametrize(("arch", "kv_heads"), [("qwen2", 2), ("llama", 1)])
def test_tensor_parallel_greedy_equals_one_rank(arch: str, kv_heads: int):
    results = run_ranks(_generate_tp, 2, arch, kv_heads)
    for rank, out in enumerate(results):
        # TINY_SHAPE has 4 query heads: 2 per rank; K/V heads split (2) or replicated (1)
        assert out["tp"] == (rank, 2, 2, 1)
        assert out["cache_heads"] == 1
        assert out["preemptions"] > 0
        assert out["tokens"] == out["single_tokens"]
        for ours, theirs in zip(out["logprobs"], out["single_logprobs"], strict=True):
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-4, rtol=0)
    assert results[0]["tokens"] == results[1]["tokens"]
