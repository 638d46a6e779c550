"""OLMo 3 in the native engine and the training path: norms only on the attention and MLP outputs
(none on their inputs), a QK-norm over all heads of a token before RoPE, local layers with a sliding
window and their own RoPE base among global ones. The window (6 or 16 tokens) is shorter than the
sequences here, so a layer that ignored it, or a table of the wrong base, would change the tokens."""

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

ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
}
SHAPE = dict(
    num_hidden_layers=3,
    sliding_window=16,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters=ROPE,
)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    return arch_model("olmo3", SHAPE)


def test_the_shape_counts_every_parameter_qk_norm_over_heads(model: torch.nn.Module) -> None:
    shape = model_shape(model.config)
    assert (shape.qk_norm, shape.qk_norm_over_heads) == (True, True)
    assert param_count(shape) == sum(p.numel() for p in model.parameters())


def test_greedy_equals_hf_generate(model: torch.nn.Module) -> None:
    check_greedy_equals_hf_generate(model)


def test_biases_and_a_tied_head_greedy_equals_hf_generate() -> None:
    check_greedy_equals_hf_generate(
        arch_model("olmo3", dict(SHAPE, attention_bias=True, tie_word_embeddings=True))
    )


@pytest.mark.parametrize("window", [16, 6])
def test_training_log_probs_equal_hf_padded_and_packed(window: int) -> None:
    """make_batch's sequences run to 21 tokens: both windows slide over them."""
    check_training_log_probs_equal_hf(arch_model("olmo3", dict(SHAPE, sliding_window=window)))


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
def test_tensor_parallel_shards_load(kv_heads: int) -> None:
    """The QK-norm spans heads that two ranks hold: each rank sums its share of the squares."""
    check_tensor_parallel_equals_one_rank("olmo3", dict(SHAPE, num_key_value_heads=kv_heads))


def test_a_grpo_step_samples_natively_and_updates(model: torch.nn.Module, tmp_path: Path) -> None:
    check_grpo_step(model, tmp_path)


def test_chunked_layers_are_named() -> None:
    config = AutoConfig.for_model(
        "olmo3", num_hidden_layers=2, layer_types=["chunked_attention", "full_attention"]
    )
    assert "chunked_attention" in (unsupported_reason(config) or "")


@pytest.mark.gpu
def test_bf16_log_probs_on_gpu() -> None:
    require_model_type("olmo3")
    check_bf16_gap_on_gpu(
        "olmo3",
        dict(SHAPE, hidden_size=256, num_attention_heads=8, num_hidden_layers=4, sliding_window=64)
        | {"layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
    )
