"""Qwen3-Next (`model_type` qwen3_next; Qwen3-Next-80B-A3B). Qwen3.5's hybrid layers (`qwen3_5.py`:
Gated DeltaNet in three layers of four beside output-gated attention with partial RoPE, (1 + w) norms)
with Qwen3-MoE's sparse MLP (`qwen3_moe.py`: softmax top-k router, `moe.py`), and two differences:

- each sparse MLP adds a shared expert, a SwiGLU of width `shared_expert_intermediate_size` that every
  token runs, scaled by a sigmoid gate of its own: y = Σ_j p_j · expert_j(x) + σ(w_g · x) · shared(x);
- the Gated DeltaNet input projections are fused and interleaved per key-head group: `in_proj_qkvz`
  holds, for each of the Hk key heads in turn, [q (Dk) | k (Dk) | v (r·Dv) | z (r·Dv)] rows, r = Hv / Hk
  the value heads a key head serves, and `in_proj_ba` [b (r) | a (r)]. The engine keeps Qwen3.5's
  separate projections; loading copies each group's rows into them (the decoder's `lin_qkvz`, `lin_ba`).
"""

from __future__ import annotations

from typing import Any

from fulcrum.models.arch import qwen3_5, qwen3_moe
from fulcrum.models.arch.spec import (
    COMMON,
    HONOURED,
    ModelSpec,
    attention_bias,
    config_value,
)


def moe_shape(config: Any) -> dict[str, int]:
    """Qwen3-MoE's expert sizes and the shared expert's width."""
    shared = int(config_value(config, "shared_expert_intermediate_size") or 0)
    return qwen3_moe.moe_shape(config) | {"shared_expert_intermediate": shared}


# Qwen3-MoE's router and experts and the shared expert beside them (Qwen3.5-MoE's too).
SHARED_EXPERT_MOE_WEIGHTS: dict[str, str] = {
    **qwen3_moe.MOE_LAYER_WEIGHTS,
    "mlp.shared_expert.gate_proj.weight": "shared_gate",  # (shared_intermediate, hidden)
    "mlp.shared_expert.up_proj.weight": "shared_up",
    "mlp.shared_expert.down_proj.weight": "shared_down",  # (hidden, shared_intermediate)
    "mlp.shared_expert_gate.weight": "shared_expert_gate",  # (1, hidden)
}
SHARED_EXPERT_MOE_FIELDS = {
    "num_experts": HONOURED,
    "shared_expert_intermediate_size": HONOURED,
    **qwen3_moe.MOE_FIELDS,
}

_FUSED_LINEAR = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

SPEC = ModelSpec(
    model_type="qwen3_next",
    fields={
        **COMMON,
        "attention_bias": HONOURED,
        **qwen3_5.LINEAR_FIELDS,
        **SHARED_EXPERT_MOE_FIELDS,
    },
    qkv_bias=attention_bias,
    o_bias=attention_bias,
    qk_norm=True,
    layer_weights={
        **{
            name: slot
            for name, slot in qwen3_5.QWEN3_5_LAYER_WEIGHTS.items()
            if name.split(".")[1] not in _FUSED_LINEAR
        },
        "linear_attn.in_proj_qkvz.weight": "lin_qkvz",  # (2 Hk Dk + 2 Hv Dv, hidden), per key-head group
        "linear_attn.in_proj_ba.weight": "lin_ba",  # (2 Hv, hidden), per key-head group
        **SHARED_EXPERT_MOE_WEIGHTS,
    },
    norm_offset=1.0,
    moe_layers=qwen3_moe.moe_layers,
    moe_shape=moe_shape,
    grouped_mm=lambda config: any(qwen3_moe.moe_layers(config)),
    linear_layers=qwen3_5.linear_layers,
    linear_shape=lambda config: qwen3_5.linear_shape(config) | {"linear_projections_fused": True},
)
