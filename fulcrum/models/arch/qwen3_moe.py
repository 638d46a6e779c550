"""Qwen3-MoE: `model_type` qwen3_moe (Qwen3-30B-A3B, 235B-A22B). Qwen3's attention (QK-norm, head_dim
apart from hidden / heads) and, on the layers `moe_layers` picks, a mixture of experts in place of the
MLP: a router (`mlp.gate`, E × hidden) sends each token to its `num_experts_per_tok` most probable
experts (softmax in fp32, the top-k renormalised with `norm_topk_prob`), whose SwiGLU outputs are
summed weighted by those probabilities (`fulcrum.rollout.native.models.moe`).

Tensor parallelism shards every expert as the dense MLP is sharded: each rank holds all E experts,
each with its slice of `moe_intermediate_size` columns (gate/up rows, down columns), the router
whole. Every rank then routes every token alike and one all-reduce sums the slices, as for a dense
layer; nothing moves tokens between ranks. Expert parallelism (whole experts per rank, tokens sent to
them by all-to-all) holds fewer, larger matmuls per rank but needs that dispatch; with the engine's
rank counts (a few GPUs) the column split keeps every rank's share of the weights at 1 / tp.

The router's load-balancing loss is a training term (`fulcrum.models.router_loss`); the sampled
function does not depend on `output_router_logits` or `router_aux_loss_coef`.
"""

from __future__ import annotations

from typing import Any

from fulcrum.models.arch.spec import (
    COMMON,
    HARMLESS,
    HONOURED,
    LLAMA_LAYER_WEIGHTS,
    ModelSpec,
    attention_bias,
    config_value,
)


def moe_layers(config: Any) -> list[bool]:
    """Which layers route to experts: Hugging Face's Qwen3MoeDecoderLayer rule, every
    `decoder_sparse_step`-th layer (1-based) not listed in `mlp_only_layers`."""
    experts = int(config_value(config, "num_experts") or config_value(config, "num_local_experts") or 0)
    step = int(config_value(config, "decoder_sparse_step", 1) or 1)
    dense = set(config_value(config, "mlp_only_layers") or [])
    layers = int(config_value(config, "num_hidden_layers"))
    return [i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers)]


def moe_shape(config: Any) -> dict[str, int]:
    return {
        "moe_layers": sum(moe_layers(config)),
        "experts": int(config_value(config, "num_experts") or config_value(config, "num_local_experts")),
        "active_experts": int(config_value(config, "num_experts_per_tok")),
        "expert_intermediate": int(config_value(config, "moe_intermediate_size")),
    }


def window(config: Any) -> int | None:
    """Every layer slides `sliding_window` tokens when `use_sliding_window` is on."""
    return config_value(config, "sliding_window") if config_value(config, "use_sliding_window") else None


# The sparse MLP's config fields and weights, shared with Qwen3-Next's.
MOE_FIELDS = {
    "num_experts_per_tok": HONOURED,
    "moe_intermediate_size": HONOURED,
    "norm_topk_prob": HONOURED,
    "decoder_sparse_step": HONOURED,
    "mlp_only_layers": HONOURED,
    "output_router_logits": HARMLESS,  # training: whether the load-balancing loss is computed
    "router_aux_loss_coef": HARMLESS,  # training: its weight in the loss
}
MOE_LAYER_WEIGHTS: dict[str, str] = {
    "mlp.gate.weight": "router",  # (E, hidden)
    "mlp.experts.gate_up_proj": "experts_gate_up",  # (E, 2 · moe_intermediate, hidden)
    "mlp.experts.down_proj": "experts_down",  # (E, hidden, moe_intermediate)
}


SPEC = ModelSpec(
    model_type="qwen3_moe",
    fields={
        **COMMON,
        "attention_bias": HONOURED,
        "use_sliding_window": HONOURED,  # a window on every layer, which the engine applies
        "sliding_window": HONOURED,
        "num_local_experts": HONOURED,  # num_experts
        **MOE_FIELDS,
    },
    qkv_bias=attention_bias,
    o_bias=attention_bias,
    qk_norm=True,
    window=window,
    layer_weights={
        **LLAMA_LAYER_WEIGHTS,
        **MOE_LAYER_WEIGHTS,
    },
    moe_layers=moe_layers,
    moe_shape=moe_shape,
    grouped_mm=lambda config: any(moe_layers(config)),
)
