"""Seeded sampling of the native engine gives the same tokens as it always has: the tokens below were
sampled by `NativeEngine.generate` before it ran on the per-request scheduler API, on the CPU in fp32
(tiny random qwen2, init std 0.2). A change to the sampler's call order, the batch composition of a
step or the preemption policy shows here as a changed token. Each case runs with the decode windows
read in turn and overlapped (`overlap_windows`, the default): a sampled token's noise follows its row
in the step, and where a sequence stops inside a window the overlapped path keeps the rows of the
window it launched ahead (the filtered case's last token, pinned on its own)."""

from __future__ import annotations

import pytest
import torch

from fulcrum.rollout import SamplingParams
from fulcrum.rollout.native import EngineConfig, NativeEngine
from fulcrum.rollout.testing import random_causal_lm

CPU = torch.device("cpu")

PLAIN = [
    [98, 51, 116, 39, 125, 133],
    [77, 152, 116, 30, 243, 131],
    [9, 168, 136, 92, 97, 155],
    [225, 227, 231, 41, 230, 87],
    [57, 67, 144, 23, 231, 100],
    [116, 17, 206, 61, 66, 137],
]
FILTERED = [
    [74, 211, 96, 148, 180, 212],
    [156, 18, 184, 124, 166, 191],
    [192, 156, 126, 46, 124, 164],
    [192, 221, 154, 167, 124, 164],
    [90, 1],
    [206, 57, 247, 111, 156, 55],
]
# overlap_windows: the last sequence's sixth token is drawn in a window launched before the fifth
# sequence's stop was read, in the row it had then.
FILTERED_OVERLAPPED = [*FILTERED[:5], [206, 57, 247, 111, 156, 196]]
PREEMPTED = [
    [77, 194, 30, 221, 179, 74, 49, 34, 201, 246, 1, 18],
    [77, 179, 18, 112, 88, 46, 212, 179, 229, 124, 242, 176],
    [77, 174, 3, 174, 221, 42, 110, 65, 30, 171, 168, 45],
    [141, 7, 122, 33, 253, 99, 204, 195, 250, 99, 215, 171],
    [193, 153, 131, 151, 15, 20, 153, 40, 73, 24, 53, 215],
    [200, 64, 33, 71, 146, 185, 11, 126, 49, 247, 199, 92],
    [187, 36, 104, 242, 199, 98, 74, 227, 222, 135, 45, 190],
    [156, 252, 182, 159, 32, 231, 33, 50, 148, 27, 147, 5],
    [124, 66, 20, 105, 62, 154, 49, 89, 224, 113, 100, 235],
]

CASES = {
    "plain": ({}, SamplingParams(n=2, temperature=0.9, max_tokens=6, seed=11), PLAIN, 0),
    "filtered": (
        {},
        SamplingParams(n=2, temperature=1.0, top_k=20, top_p=0.9, max_tokens=6, seed=12),
        FILTERED,
        0,
    ),
    "preempted": (
        dict(num_kv_blocks=8, max_num_batched_tokens=32, block_size=8),
        SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=13, ignore_eos=True),
        PREEMPTED,
        3,
    ),
}


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    return random_causal_lm("qwen2", init_std=0.2)


@pytest.mark.parametrize("overlap", [False, True], ids=["in_turn", "overlapped"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_seeded_tokens_are_the_pinned_ones(model, case, overlap):
    overrides, params, expected, preemptions = CASES[case]
    if overlap and case == "filtered":
        expected = FILTERED_OVERLAPPED
    config = dict(
        max_num_seqs=16,
        max_num_batched_tokens=128,
        max_model_len=512,
        decode_steps=4,
        overlap_windows=overlap,
    )
    engine = NativeEngine(model, [1], 0, EngineConfig(**{**config, **overrides}), CPU)
    generator = torch.Generator().manual_seed(21)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (5, 40, 17)]
    out = engine.generate(prompts, params)
    assert out.token_ids == expected
    assert engine.stats["preemptions"] == preemptions
