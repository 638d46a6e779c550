"""Qwen3-MoE in the native engine and the training path: top-k routing over 8 experts (2 a token),
a dense layer among the expert ones (`mlp_only_layers`), the grouped expert matmul, experts sharded
over tensor-parallel ranks by their intermediate columns; and the router's load-balancing loss the
actor adds (`fulcrum.models.router_loss`), equal to Hugging Face's on the padded and packed paths."""

from __future__ import annotations

import pytest
import torch
from arch_checks import (
    arch_model,
    check_bf16_gap_on_gpu,
    check_greedy_equals_hf_generate,
    check_load_balancing_loss_equals_hf,
    check_tensor_parallel_equals_one_rank,
    check_training_log_probs_equal_hf,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from fulcrum.models.arch import model_shape
from fulcrum.models.arch.spec import matmul_param_count, param_count
from fulcrum.rollout.native.models.moe import grouped_matmul

SHAPE = dict(
    num_hidden_layers=3,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    mlp_only_layers=[1],
    norm_topk_prob=True,
    head_dim=24,
)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    return arch_model("qwen3_moe", SHAPE)


def test_the_shape_counts_every_parameter_and_the_active_experts(model: torch.nn.Module) -> None:
    shape = model_shape(model.config)
    assert (shape.moe_layers, shape.experts, shape.active_experts) == (2, 8, 2)
    assert param_count(shape) == sum(p.numel() for p in model.parameters())
    # verl's N (the FLOPs' count): the matmul weights, of the experts only the 2 a token runs
    idle_experts = 2 * (8 - 2) * 3 * 64 * 32  # 2 expert layers, 6 idle experts of 3 matrices 64 x 32
    matmuls = sum(p.numel() for name, p in model.named_parameters() if "norm" not in name)
    assert matmul_param_count(shape) == matmuls - idle_experts


@pytest.mark.parametrize("normalize", [True, False], ids=["norm_topk_prob", "raw_top_k"])
def test_greedy_equals_hf_generate(model: torch.nn.Module, normalize: bool) -> None:
    check_greedy_equals_hf_generate(
        model if normalize else arch_model("qwen3_moe", dict(SHAPE, norm_topk_prob=False))
    )


def test_every_second_layer_sparse_greedy_equals_hf_generate() -> None:
    check_greedy_equals_hf_generate(
        arch_model("qwen3_moe", dict(SHAPE, decoder_sparse_step=2, mlp_only_layers=[]))
    )


def test_training_log_probs_equal_hf_padded_and_packed(model: torch.nn.Module) -> None:
    check_training_log_probs_equal_hf(model)


def test_tensor_parallel_shards_load() -> None:
    check_tensor_parallel_equals_one_rank("qwen3_moe", SHAPE)


@pytest.mark.parametrize(
    "width", [16, 6], ids=["grouped-gemm", "per-expert"]
)  # 6 fp32: rows not 16-byte aligned
def test_grouped_matmul_equals_one_matmul_per_expert(width: int) -> None:
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(11, width, generator=generator), torch.randn(4, 5, width, generator=generator)
    offsets = torch.tensor([3, 3, 9, 11], dtype=torch.int32)  # expert 1 gets no row
    expected = torch.cat([x[:3] @ weight[0].T, x[3:9] @ weight[2].T, x[9:] @ weight[3].T])
    torch.testing.assert_close(grouped_matmul(x, weight, offsets), expected)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_load_balancing_loss_equals_hugging_face(packed: bool) -> None:
    check_load_balancing_loss_equals_hf("qwen3_moe", SHAPE, 8, load_balancing_loss_func, packed)


@pytest.mark.gpu
def test_bf16_log_probs_on_gpu() -> None:
    check_bf16_gap_on_gpu(
        "qwen3_moe",
        dict(
            SHAPE,
            hidden_size=256,
            num_attention_heads=8,
            head_dim=64,
            num_hidden_layers=4,
            moe_intermediate_size=128,
        ),
    )
