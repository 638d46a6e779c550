"""The paged decode kernel's split count (`decode_grid.decode_splits`): one program a (sequence, KV head) for
the rollout's wide batches of short contexts, several for few sequences of long contexts and for batches
too narrow to fill the SMs, and the split launch it picks computes the same attention (under Triton's
interpreter, where triton is installed)."""

from __future__ import annotations

import os

import pytest
import torch

from fulcrum.rollout.native import decode_grid, kernels, ops
from fulcrum.rollout.native.decode_grid import decode_launch, decode_splits
from fulcrum.rollout.native.kernels import HAVE_TRITON

H100_SMS = 132


def test_wide_batches_of_short_contexts_keep_one_program_a_pair() -> None:
    # The rollout benchmark's and the seed's decode: 512 sequences, block tables under 1k positions.
    assert decode_splits(512, 2, 640, H100_SMS) == 1
    assert decode_splits(512, 8, 800, H100_SMS) == 1
    assert decode_splits(128, 2, 800, H100_SMS) == 1  # 256 pairs: an SM's program at least


def test_batches_narrower_than_the_sms_are_split_at_any_context() -> None:
    # A rollout's tail of 16 sequences: 32 pairs at Qwen2.5-0.5B's 2 KV heads, 128 at Qwen3-0.6B's 8, left
    # on a quarter or all of an H100's SMs one program each; split to two programs an SM.
    assert decode_splits(16, 2, 1_024, H100_SMS) == 8
    assert decode_splits(16, 8, 1_024, H100_SMS) == 4
    assert decode_splits(8, 8, 800, H100_SMS) == 4  # 800 // 128 = 6 splits at most, a power of two: 4
    assert decode_splits(16, 2, 100, H100_SMS) == 1  # under two tiles of context: one program a pair
    assert decode_splits(66, 2, 1_024, H100_SMS) == 1  # 132 pairs fill the SMs


def test_few_sequences_of_long_contexts_are_split_over_more_programs() -> None:
    # Qwen3-0.6B's shape (8 KV heads) at 16k: 8 sequences are 64 (sequence, KV head) pairs, half an
    # H100's SMs; split 16 ways (1k positions each) they make 1,024 programs.
    assert decode_splits(8, 8, 16_448, H100_SMS) == 16
    assert decode_splits(36, 8, 16_448, H100_SMS) == 4  # as many as the KV cache holds at 16k
    assert decode_splits(512, 8, 16_448, H100_SMS) == 1  # already 4,096 programs


def test_splits_grow_as_the_batch_shrinks_and_stay_within_the_bounds() -> None:
    for max_context in (2_048, 8_192, 16_384, 131_072):
        previous = None
        for batch in (512, 256, 128, 64, 32, 16, 8, 4, 2, 1):
            splits = decode_splits(batch, 2, max_context, H100_SMS)
            assert splits & (splits - 1) == 0  # a power of two: few compiled variants
            assert 1 <= splits <= decode_grid.MAX_SPLITS
            least = (
                decode_grid.SPLIT_MIN_POSITIONS if batch * 2 >= H100_SMS else decode_grid.TAIL_MIN_POSITIONS
            )
            assert splits == 1 or max_context // splits >= least
            if previous is not None:
                assert splits >= previous
            previous = splits
        assert previous > 1  # one sequence of a long context is split


def test_an_explicit_split_count_wins_and_a_sliding_window_bounds_the_context() -> None:
    cpu = torch.device("cpu")
    assert decode_launch(1, 2, 16_384, cpu)["SPLITS"] == 16
    assert decode_launch(1, 2, 16_384, cpu, {"SPLITS": 1})["SPLITS"] == 1
    assert decode_launch(512, 2, 1_024, cpu)["SPLITS"] == 1  # e.g. a 1k sliding window over a 16k table
    assert decode_launch(1, 2, 200, cpu)["SPLITS"] == 1  # a 200-position window: under two tiles a split


def test_a_narrow_batch_split_by_the_tail_rule_runs_more_warps_a_program() -> None:
    cpu = torch.device("cpu")
    tail = decode_launch(16, 2, 1_024, cpu)
    assert (tail["SPLITS"], tail["num_warps"]) == (8, decode_grid.TAIL_NUM_WARPS)
    assert decode_launch(16, 2, 1_024, cpu, {"num_warps": 2})["num_warps"] == 2  # named: kept
    # Long contexts: the wide rule's 16 splits already; its one-warp programs stay.
    long = decode_launch(1, 2, 16_384, cpu)
    assert (long["SPLITS"], long["num_warps"]) == (16, decode_grid.DECODE_LAUNCH["num_warps"])
    wide = decode_launch(512, 2, 1_024, cpu)
    assert (wide["SPLITS"], wide["num_warps"]) == (1, decode_grid.DECODE_LAUNCH["num_warps"])


@pytest.mark.skipif(
    not HAVE_TRITON or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton and a CUDA device (or TRITON_INTERPRET=1)",
)
def test_the_chosen_split_launch_matches_gather_sdpa_over_long_contexts() -> None:
    """Three sequences of 4k-position block tables: `decode_splits` picks 8 splits (six pairs: the tail
    rule), the rows' own lengths (1, 1,500 and 4,000 positions) shared out over them, some splits reading
    nothing; and the 4-warp launch it runs there."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    batch, heads, kv_heads, dim, block, width = 3, 4, 2, 32, 16, 256
    assert decode_splits(batch, kv_heads, width * block, H100_SMS) == 8
    k_cache = torch.randn(batch * width * block + block, kv_heads, dim, device=device)
    v_cache = torch.randn_like(k_cache)
    tables = (torch.randperm(batch * width, device=device).view(batch, width) + 1).int()
    context = torch.tensor([1, 1_500, 4_000], device=device, dtype=torch.int32)
    q = torch.randn(batch, heads, dim, device=device)
    expected = ops.decode_attention_gather(q, k_cache, v_cache, tables, context, width * block, block, 0.125)
    got = kernels.paged_decode_attention(q, k_cache, v_cache, tables, context, block, 0.125)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(
    not HAVE_TRITON or os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
    reason="the engine's Triton path on the CPU needs triton and TRITON_INTERPRET=1",
)
def test_an_engine_with_a_long_max_model_len_decodes_as_the_torch_path() -> None:
    """A batch of two sequences splits (8 programs a pair: the tail rule); the greedy tokens are the torch
    path's."""
    import dataclasses

    from fulcrum.rollout import SamplingParams
    from fulcrum.rollout.native import EngineConfig, NativeEngine
    from fulcrum.rollout.testing import random_causal_lm

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (1_100, 200)]
    config = EngineConfig(
        max_num_seqs=2, max_model_len=2_100, num_kv_blocks=160, decode_steps=2, dtype=torch.float32
    )
    model = random_causal_lm("qwen2", init_std=0.2)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    expected = NativeEngine(
        model, [1], 0, dataclasses.replace(config, triton_kernels=False), torch.device("cpu")
    )
    engine = NativeEngine(
        model, [1], 0, dataclasses.replace(config, triton_kernels=True), torch.device("cpu")
    )
    width = engine.runner.max_blocks_per_seq * engine.runner.block_size
    assert decode_splits(2, model.config.num_key_value_heads, width, decode_grid.DEFAULT_SM_COUNT) == 8
    assert engine.generate(prompts, params).token_ids == expected.generate(prompts, params).token_ids


def test_the_decode_order_takes_the_rows_longest_context_first() -> None:
    context_lens = torch.tensor([70, 1, 8_192, 300, 8_192, 64], dtype=torch.int32)
    order = decode_grid.decode_order(context_lens)
    assert order.dtype == torch.int32
    assert sorted(order.tolist()) == list(range(6))  # every row once
    assert context_lens[order].tolist() == [8_192, 8_192, 300, 70, 64, 1]
