"""Qwen3 in the native engine and the training path: QK-norm, and a head_dim set apart from
hidden / heads (here 4 heads of 24 over a hidden size of 64, as Qwen3-0.6B's 16 of 128 over 1024)."""

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

from fulcrum.models.arch import model_shape
from fulcrum.models.arch.spec import param_count

SHAPE = dict(head_dim=24)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    return arch_model("qwen3", SHAPE)


def test_the_shape_counts_every_parameter_qk_norm_included(model: torch.nn.Module) -> None:
    shape = model_shape(model.config)
    assert (shape.head_dim, shape.qk_norm, shape.qkv_bias) == (24, True, False)
    assert param_count(shape) == sum(p.numel() for p in model.parameters())


def test_greedy_equals_hf_generate(model: torch.nn.Module) -> None:
    check_greedy_equals_hf_generate(model)


def test_training_log_probs_equal_hf_padded_and_packed(model: torch.nn.Module) -> None:
    check_training_log_probs_equal_hf(model)


def test_tensor_parallel_shards_load() -> None:
    check_tensor_parallel_equals_one_rank("qwen3", SHAPE)


@pytest.mark.gpu
def test_bf16_log_probs_on_gpu() -> None:
    check_bf16_gap_on_gpu(
        "qwen3", dict(hidden_size=256, num_attention_heads=8, head_dim=64, num_hidden_layers=4)
    )
