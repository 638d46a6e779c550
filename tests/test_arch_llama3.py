"""Llama 3.x in the native engine and the training path: `rope_scaling` of type llama3 (frequencies
below a wavelength band stretched by `factor`, smoothly between the bands) and a tied head (3.2 1B/3B).
The engine takes the inverse frequencies from Hugging Face's rotary module, so the check here is that
they arrive: a small `original_max_position_embeddings` puts the head's frequencies in all three bands."""

from __future__ import annotations

import pytest
import torch
from arch_checks import (
    arch_model,
    check_bf16_gap_on_gpu,
    check_greedy_equals_hf_generate,
    check_tensor_parallel_equals_one_rank,
    check_training_log_probs_equal_hf,
)

from fulcrum.rollout.native import unsupported_reason
from fulcrum.rollout.native.engine import rotary_of

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
SHAPE = dict(rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True, rope_theta=500000.0)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    return arch_model("llama", SHAPE)


def test_the_llama3_frequencies_reach_the_engine(model: torch.nn.Module) -> None:
    assert unsupported_reason(model.config) is None
    inv_freq, _ = rotary_of(model)
    plain, _ = rotary_of(arch_model("llama", dict(SHAPE, rope_scaling=None)))
    stretched = ~torch.isclose(inv_freq, plain)
    assert 0 < int(stretched.sum()) < len(inv_freq)  # the long wavelengths only


def test_greedy_equals_hf_generate(model: torch.nn.Module) -> None:
    check_greedy_equals_hf_generate(model, lengths=(1, 80, 9))  # past original_max_position_embeddings


def test_training_log_probs_equal_hf_padded_and_packed(model: torch.nn.Module) -> None:
    check_training_log_probs_equal_hf(model)


def test_tensor_parallel_shards_load() -> None:
    check_tensor_parallel_equals_one_rank("llama", SHAPE)


@pytest.mark.gpu
def test_bf16_log_probs_on_gpu() -> None:
    check_bf16_gap_on_gpu("llama", dict(SHAPE, hidden_size=256, num_attention_heads=8, num_hidden_layers=4))
