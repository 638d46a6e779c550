"""Qwen3-Next (`qwen3_next`): Qwen3.5's Gated DeltaNet and output-gated attention layers, with sparse MLPs
whose routed experts sit beside a shared expert scaled by its own sigmoid gate, and Gated DeltaNet
projections fused per key-head group (`in_proj_qkvz`, `in_proj_ba`), which the engine splits on load.
Native greedy = HF's generate; padded and packed log-probs within 1e-5 of HF's; the router's
load-balancing loss equal to HF's; one GRPO step on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from arch_checks import (
    CPU,
    GATED_DELTANET_SHAPE,
    arch_model,
    check_greedy_equals_hf_generate,
    check_grpo_step,
    check_hybrid_moe_parameter_counts,
    check_load_balancing_loss_equals_hf,
    check_training_log_probs_equal_hf,
    engine_config,
)
from transformers.models.qwen3_next.modeling_qwen3_next import load_balancing_loss_func

from fulcrum.rollout.native import NativeEngine

# Four layers (three Gated DeltaNet, one attention); every MLP sparse but layer 2's (`mlp_only_layers`):
# 4 experts (top 2) and a shared expert 48 wide. Two key heads of 8 serve four value heads of 12, so
# the fused projections interleave two groups.
SHAPE = dict(
    GATED_DELTANET_SHAPE,
    num_hidden_layers=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    mlp_only_layers=[2],
)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    # seed 1: seed 0's model greedily samples EOS within 64 tokens of a prompt, which HF's generate
    # (min_new_tokens) masks and the engine (ignore_eos) does not
    return arch_model("qwen3_next", SHAPE, seed=1, init_std=0.1)


def test_the_shape_counts_every_parameter_and_the_shared_expert(model: torch.nn.Module) -> None:
    idle_experts = 3 * (4 - 2) * 3 * 64 * 32  # 3 expert layers, 2 idle experts of 3 matrices 64 x 32
    shape = check_hybrid_moe_parameter_counts(model, idle_experts)
    assert (shape.linear_layers, shape.moe_layers, shape.shared_expert_intermediate) == (3, 3, 48)


def test_the_engine_loads_the_fused_projections_into_each_slot(model: torch.nn.Module) -> None:
    """Key head g's rows of in_proj_qkvz are [q | k | v | z] of its group: the engine's q, k and v
    projections (its conv's input) and its output gate hold HF's de-interleaved rows."""
    engine = NativeEngine(model, [1], 0, engine_config(), CPU)
    attn = model.model.layers[0].linear_attn
    groups = attn.in_proj_qkvz.weight.view(2, 2 * 8 + 2 * 2 * 12, 64)  # (Hk, [q k v z] rows, hidden)
    q, k, v, z = groups.split([8, 8, 24, 24], dim=1)
    layer = engine.model.layers[0]
    expected = torch.cat([q.reshape(-1, 64), k.reshape(-1, 64), v.reshape(-1, 64)])
    assert torch.equal(layer["lin_qkv"], expected) and torch.equal(layer["lin_z"], z.reshape(-1, 64))
    b, a = attn.in_proj_ba.weight.view(2, 4, 64).split([2, 2], dim=1)
    assert torch.equal(layer["lin_b"], b.reshape(-1, 64)) and torch.equal(layer["lin_a"], a.reshape(-1, 64))


def test_greedy_equals_hf_generate(model: torch.nn.Module) -> None:
    check_greedy_equals_hf_generate(model)


def test_training_log_probs_equal_hf_padded_and_packed(model: torch.nn.Module) -> None:
    check_training_log_probs_equal_hf(model)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_load_balancing_loss_equals_hugging_face(packed: bool) -> None:
    check_load_balancing_loss_equals_hf("qwen3_next", SHAPE, 4, load_balancing_loss_func, packed)


def test_a_grpo_step_on_the_cpu(model: torch.nn.Module, tmp_path: Path) -> None:
    check_grpo_step(model, tmp_path)
