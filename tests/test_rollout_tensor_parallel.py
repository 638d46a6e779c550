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
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=256,
        decode_steps=3,
        num_kv_blocks=12,
        headroom_tokens=0,
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


def _generate_tp_cuda(rank: int, world: int) -> dict:
    from fulcrum.parallel import shutdown
    from fulcrum.parallel.tensor_parallel import tensor_parallel_group

    cuda = torch.device("cuda", rank)
    # Qwen2.5-0.5B's attention and MLP shapes (14 query heads, 2 K/V heads, 4864 columns), 4 layers.
    shape = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=4, num_attention_heads=14)
    shape |= dict(num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=True)
    model = random_causal_lm("qwen2", init_std=0.2, **shape).to(cuda)
    lengths = [1, 300, 7, 64, 16, 150, 33, 2, 95, 17]
    generator = torch.Generator().manual_seed(0)
    batch = [torch.randint(3, 4096, (n,), generator=generator).tolist() for n in lengths]
    config = EngineConfig(
        max_num_seqs=16, max_num_batched_tokens=64, max_model_len=512, num_kv_blocks=24, headroom_tokens=0, decode_steps=4,
        dtype=torch.float32,
    )  # fmt: skip
    params = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)
    engine = NativeEngine(model, [EOS], 0, config, cuda, tp=tensor_parallel_group(world))
    out = engine.generate(batch, params)
    single = NativeEngine(model, [EOS], 0, config, cuda).generate(batch, params)
    # New weights land as shards in place; the graphs captured with the all-reduces replay them.
    changed = random_causal_lm("qwen2", seed=1, init_std=0.2, **shape).to(cuda)
    engine.update_weights(changed.named_parameters())
    engine.sleep()
    after = engine.generate(batch, params)
    single_after = NativeEngine(changed, [EOS], 0, config, cuda).generate(batch, params)
    # The end of a run: the engine is still referenced (as the trainer holds it) and its graphs captured
    # the group's all-reduces; after `close` the process group can be left (pytorch/pytorch#115388).
    engine.close()
    left = shutdown(timeout_s=60)
    return {
        "left": left,
        "uses": (engine.runner.use_triton, engine.runner.use_graphs, engine.stats["preemptions"] > 0),
        "equal": (out.token_ids == single.token_ids, after.token_ids == single_after.token_ids),
        "gap": max(
            abs(a - b)
            for x, y in zip(out.logprobs, single.logprobs, strict=True)
            for a, b in zip(x, y, strict=True)
        ),
        "tokens": out.token_ids,
    }


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tensor_parallel_greedy_equals_one_gpu_with_graphs_and_kernels():
    results = run_ranks(_generate_tp_cuda, 2, device="cuda")
    for out in results:
        assert out["left"] is True  # the group was left with the engine alive, graphs released
        assert out["uses"] == (True, True, True)
        assert out["equal"] == (True, True)
        assert out["gap"] < 1e-3
    assert results[0]["tokens"] == results[1]["tokens"]
