"""Mistral in the native engine and the training path: a sliding window on every layer, checked
with a window that covers every sequence (Mistral-7B v0.1's 4096) and with one shorter than them."""

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

SHAPE = dict(sliding_window=4096)  # Mistral-7B v0.1's window, longer than any sequence here


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    return arch_model("mistral", SHAPE)


def test_greedy_equals_hf_generate(model: torch.nn.Module) -> None:
    check_greedy_equals_hf_generate(model)


@pytest.mark.parametrize("window", [4096, 6], ids=["window-covers", "window-slides"])
def test_training_log_probs_equal_hf_padded_and_packed(window: int) -> None:
    """make_batch's sequences run to 21 tokens: a window of 6 slides over them."""
    check_training_log_probs_equal_hf(arch_model("mistral", dict(sliding_window=window)))


def test_a_window_shorter_than_the_sequences_samples_as_hf() -> None:
    """Prompts of up to 40 tokens and 64 new ones over a window of 16: prefill and decode slide."""
    check_greedy_equals_hf_generate(arch_model("mistral", dict(sliding_window=16)))


def test_tensor_parallel_shards_load() -> None:
    check_tensor_parallel_equals_one_rank("mistral", SHAPE)


@pytest.mark.gpu
def test_bf16_log_probs_on_gpu() -> None:
    check_bf16_gap_on_gpu("mistral", dict(SHAPE, hidden_size=256, num_attention_heads=8, num_hidden_layers=4))
