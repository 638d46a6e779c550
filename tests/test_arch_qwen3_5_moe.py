"""Qwen3.5-MoE (`qwen3_5_moe_text`, and the multimodal `qwen3_5_moe` its checkpoints ship): Qwen3.5's
Gated DeltaNet and output-gated attention layers with their separate projections, every MLP sparse (a
softmax top-k router that always renormalises, and a shared expert scaled by its own sigmoid gate).
Native greedy = HF's generate; padded and packed log-probs within 1e-5 of HF's; the router's
load-balancing loss equal to HF's; one GRPO step on the CPU; the multimodal folder read as its text
model; the bf16 gap on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from arch_checks import (
    CPU,
    EOS,
    GATED_DELTANET_SHAPE,
    arch_model,
    check_bf16_gap_on_gpu,
    check_greedy_equals_hf_generate,
    check_grpo_step,
    check_hybrid_moe_parameter_counts,
    check_load_balancing_loss_equals_hf,
    check_multimodal_folder_runs_as_its_text_model,
    check_training_log_probs_equal_hf,
    engine_config,
    require_model_type,
)

from fulcrum.rollout.native import NativeEngine

pytest.importorskip("transformers.models.qwen3_5_moe")
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

# Four layers (three Gated DeltaNet, one attention), each MLP 4 experts (top 2) of 32 and a shared
# expert of 48.
SHAPE = dict(
    GATED_DELTANET_SHAPE,
    num_hidden_layers=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    return arch_model("qwen3_5_moe_text", SHAPE, seed=1, init_std=0.1)


def test_the_shape_counts_every_parameter_and_every_layer_is_sparse(model: torch.nn.Module) -> None:
    idle_experts = 4 * (4 - 2) * 3 * 64 * 32  # 4 expert layers, 2 idle experts of 3 matrices 64 x 32
    shape = check_hybrid_moe_parameter_counts(model, idle_experts)
    assert (shape.linear_layers, shape.moe_layers, shape.shared_expert_intermediate) == (3, 4, 48)


def test_the_engine_renormalises_the_top_k_as_the_router_does(model: torch.nn.Module) -> None:
    """The config has no `norm_topk_prob`; HF's router divides the top k by their sum regardless."""
    assert not hasattr(model.config, "norm_topk_prob")
    assert NativeEngine(model, [EOS], 0, engine_config(), CPU).model.norm_topk


def test_greedy_equals_hf_generate(model: torch.nn.Module) -> None:
    check_greedy_equals_hf_generate(model)


def test_training_log_probs_equal_hf_padded_and_packed(model: torch.nn.Module) -> None:
    check_training_log_probs_equal_hf(model)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_load_balancing_loss_equals_hugging_face(packed: bool) -> None:
    check_load_balancing_loss_equals_hf("qwen3_5_moe_text", SHAPE, 4, load_balancing_loss_func, packed)


def test_a_grpo_step_on_the_cpu(model: torch.nn.Module, tmp_path: Path) -> None:
    check_grpo_step(model, tmp_path)


def test_a_multimodal_qwen3_5_moe_checkpoint_runs_as_its_text_model(tmp_path: Path) -> None:
    """`qwen3_5_moe` folders (Qwen3_5MoeForConditionalGeneration) load through AutoModelForCausalLM as the
    text model alone, and every part of fulcrum reads them so (`check_multimodal_folder_runs_as_its_text_model`)."""
    shape = check_multimodal_folder_runs_as_its_text_model(
        "qwen3_5_moe", dict(SHAPE, initializer_range=0.1), tmp_path
    )
    assert (shape.linear_layers, shape.moe_layers) == (3, 4)


@pytest.mark.gpu
def test_bf16_gap_on_gpu() -> None:
    require_model_type("qwen3_5_moe_text")
    check_bf16_gap_on_gpu("qwen3_5_moe_text", dict(SHAPE, hidden_size=256, num_attention_heads=8))
