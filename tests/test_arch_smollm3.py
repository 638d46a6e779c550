"""SmolLM3 in the native engine and the training path: layers without RoPE (NoPE) among rotating
ones (`no_rope_layers`), biases with `attention_bias`, sliding layers when the config turns them on.
Positions matter in every check here, so a NoPE layer that rotated, or a RoPE layer that did not,
would change the tokens and the log-probs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from arch_checks import (
    arch_model,
    check_bf16_gap_on_gpu,
    check_greedy_equals_hf_generate,
    check_grpo_step,
    check_tensor_parallel_equals_one_rank,
    check_training_log_probs_equal_hf,
    require_model_type,
)
from transformers import AutoConfig

from fulcrum.models.arch import model_shape, unsupported_reason
from fulcrum.models.arch.spec import param_count

SHAPE = dict(num_hidden_layers=4, no_rope_layers=[1, 0, 1, 0], tie_word_embeddings=True)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    return arch_model("smollm3", SHAPE)


def test_the_shape_counts_every_parameter(model: torch.nn.Module) -> None:
    assert param_count(model_shape(model.config)) == sum(p.numel() for p in model.parameters())


def test_greedy_equals_hf_generate(model: torch.nn.Module) -> None:
    check_greedy_equals_hf_generate(model)


def test_biases_greedy_equals_hf_generate() -> None:
    check_greedy_equals_hf_generate(arch_model("smollm3", dict(SHAPE, attention_bias=True)))


def test_sliding_nope_layers_sample_as_hf() -> None:
    """use_sliding_window marks the NoPE layers sliding (SmolLM3's config); a window of 16 slides."""
    model = arch_model("smollm3", dict(SHAPE, use_sliding_window=True, sliding_window=16))
    assert model.config.layer_types.count("sliding_attention") == 2
    check_greedy_equals_hf_generate(model)


def test_training_log_probs_equal_hf_padded_and_packed(model: torch.nn.Module) -> None:
    check_training_log_probs_equal_hf(model)


def test_tensor_parallel_shards_load() -> None:
    check_tensor_parallel_equals_one_rank("smollm3", SHAPE)


def test_a_grpo_step_samples_natively_and_updates(model: torch.nn.Module, tmp_path: Path) -> None:
    check_grpo_step(model, tmp_path)


def test_what_it_does_not_run_is_named() -> None:
    # a sliding layer without use_sliding_window: HF's SDPA mask would slide where its attention would not
    config = AutoConfig.for_model(
        "smollm3", num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=8
    )
    assert "layer_types=['sliding_attention', 'full_attention'] (it runs full_attention" in (
        unsupported_reason(config) or ""
    )
    assert "mlp_bias=True" in (unsupported_reason(AutoConfig.for_model("smollm3", mlp_bias=True)) or "")


@pytest.mark.gpu
def test_bf16_log_probs_on_gpu() -> None:
    require_model_type("smollm3")
    check_bf16_gap_on_gpu(
        "smollm3", dict(SHAPE, hidden_size=256, num_attention_heads=8, no_rope_layers=[1, 1, 1, 0])
    )
