"""Qwen3.5 (dense text): `model_type` qwen3_5_text (the text model of Qwen3.5-0.8B, 2B, ...; Qwen3.5
checkpoints load as it through `AutoModelForCausalLM`). A hybrid of two token mixers, `layer_types`:

- `linear_attention` layers (three of four by default): Gated DeltaNet. q, k, v from one projection go
  through a causal depthwise conv1d (kernel `linear_conv_kernel_dim`, SiLU), q and k are L2-normalised
  per head, and a recurrent state S (value heads × Dk × Dv) per sequence is stepped by the gated delta
  rule S_t = exp(g_t) S_{t-1} + k_t β_t (v_t - exp(g_t) S_{t-1}ᵀ k_t)ᵀ, read as o_t = S_tᵀ q_t / sqrt(Dk);
  the output is RMS-normed per head, gated by SiLU(z) and projected back. Each sequence carries the
  state and the conv's last K - 1 inputs instead of a KV cache;
- `full_attention` layers: Qwen3's attention (QK-norm, GQA) whose q projection also yields a per-head
  output gate (sigmoid), with RoPE on the first `partial_rotary_factor` of each head.

Every RMSNorm but the gated one computes x / rms(x) · (1 + w) (weights stored as w - 1). A training
forward over a packed stream resets the state and the conv window at each sequence start
(`fulcrum.models.packed_recurrent`).
"""

from __future__ import annotations

from typing import Any

from fulcrum.models.arch.spec import (
    COMMON,
    HONOURED,
    LLAMA_LAYER_WEIGHTS,
    ModelSpec,
    Runs,
    attention_bias,
    config_value,
)

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


def _hybrid_layers(layer_types: Any, _config: Any = None, _max_len: int | None = None) -> bool:
    return layer_types is None or set(layer_types) <= {LINEAR_ATTENTION, FULL_ATTENTION}


def linear_layers(config: Any) -> list[bool]:
    """Which layers are Gated DeltaNet (a recurrent state per sequence) rather than attention."""
    layers = int(config_value(config, "num_hidden_layers"))
    return [kind == LINEAR_ATTENTION for kind in config_value(config, "layer_types")[:layers]]


def linear_shape(config: Any) -> dict[str, Any]:
    """ModelShape's Gated DeltaNet sizes: which layers, their key/value heads, head dims, conv."""
    layers = linear_layers(config)
    return {
        "linear_layers": sum(layers),
        "linear_layer_ids": tuple(i for i, linear in enumerate(layers) if linear),
        "linear_key_heads": int(config_value(config, "linear_num_key_heads")),
        "linear_value_heads": int(config_value(config, "linear_num_value_heads")),
        "linear_key_dim": int(config_value(config, "linear_key_head_dim")),
        "linear_value_dim": int(config_value(config, "linear_value_head_dim")),
        "linear_conv_kernel": int(config_value(config, "linear_conv_kernel_dim")),
        "attention_output_gate": 1,
    }


# The hybrid layers' config fields, shared with Qwen3-Next's.
LINEAR_FIELDS = {
    "layer_types": Runs(_hybrid_layers, f"{LINEAR_ATTENTION} and {FULL_ATTENTION} layers"),
    "linear_conv_kernel_dim": HONOURED,
    "linear_key_head_dim": HONOURED,
    "linear_value_head_dim": HONOURED,
    "linear_num_key_heads": HONOURED,
    "linear_num_value_heads": HONOURED,
    # transformers before 5.2x keeps it beside `rope_parameters`; its rotary module's table is as narrow
    # (the engine rotates what the table covers)
    "partial_rotary_factor": HONOURED,
}

# Llama's names for the attention layers, and the Gated DeltaNet's under `linear_attn.`.
QWEN3_5_LAYER_WEIGHTS: dict[str, str] = {
    **LLAMA_LAYER_WEIGHTS,
    "linear_attn.in_proj_qkv.weight": "lin_qkv",  # (2 Hk Dk + Hv Dv, hidden), the conv's input
    "linear_attn.in_proj_z.weight": "lin_z",  # (Hv Dv, hidden): the output gate
    "linear_attn.in_proj_b.weight": "lin_b",  # (Hv, hidden): β = sigmoid(b)
    "linear_attn.in_proj_a.weight": "lin_a",  # (Hv, hidden): g = -exp(A_log) softplus(a + dt_bias)
    "linear_attn.conv1d.weight": "lin_conv",  # (conv channels, 1, K)
    "linear_attn.dt_bias": "lin_dt_bias",
    "linear_attn.A_log": "lin_a_log",
    "linear_attn.norm.weight": "lin_norm",  # (Dv,), plain w (not 1 + w)
    "linear_attn.out_proj.weight": "lin_out",  # (hidden, Hv Dv)
}

SPEC = ModelSpec(
    model_type="qwen3_5_text",
    fields={
        **COMMON,
        "attention_bias": HONOURED,
        **LINEAR_FIELDS,
    },
    qkv_bias=attention_bias,
    o_bias=attention_bias,
    qk_norm=True,
    layer_weights=QWEN3_5_LAYER_WEIGHTS,
    norm_offset=1.0,
    linear_layers=linear_layers,
    linear_shape=linear_shape,
)
