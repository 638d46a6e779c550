"""Qwen3.5-MoE (`model_type` qwen3_5_moe_text; the text model of Qwen3.5-35B-A3B, 122B-A10B, ..., whose
`qwen3_5_moe` checkpoints load as it through `AutoModelForCausalLM`). Qwen3.5's hybrid layers with
their separate Gated DeltaNet projections (`qwen3_5.py`) and Qwen3-Next's sparse MLP on every layer
(`qwen3_next.py`: Qwen3-MoE's softmax top-k router and experts, and a shared expert scaled by its own
sigmoid gate). Its config has no `norm_topk_prob`, `decoder_sparse_step` or `mlp_only_layers`: its router
always renormalises the top k, and every layer is sparse, which is what the shared code reads from their
absence.
"""

from __future__ import annotations

from fulcrum.models.arch import qwen3_5, qwen3_moe, qwen3_next
from fulcrum.models.arch.spec import COMMON, HONOURED, ModelSpec, attention_bias

SPEC = ModelSpec(
    model_type="qwen3_5_moe_text",
    fields={
        **COMMON,
        "attention_bias": HONOURED,
        **qwen3_5.LINEAR_FIELDS,
        **qwen3_next.SHARED_EXPERT_MOE_FIELDS,
    },
    qkv_bias=attention_bias,
    o_bias=attention_bias,
    qk_norm=True,
    layer_weights={**qwen3_5.QWEN3_5_LAYER_WEIGHTS, **qwen3_next.SHARED_EXPERT_MOE_WEIGHTS},
    norm_offset=1.0,
    moe_layers=qwen3_moe.moe_layers,
    moe_shape=qwen3_next.moe_shape,
    grouped_mm=lambda config: any(qwen3_moe.moe_layers(config)),
    linear_layers=qwen3_5.linear_layers,
    linear_shape=qwen3_5.linear_shape,
)
