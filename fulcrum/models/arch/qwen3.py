"""Qwen3 (dense): `model_type` qwen3. Llama's layout with an RMSNorm over each head's q and k before
RoPE (`self_attn.q_norm`, `k_norm`, head_dim wide), `head_dim` set apart from hidden / heads
(Qwen3-0.6B: 16 heads of 128 over a hidden size of 1024), biases only with `attention_bias`, and
Qwen2's per-layer sliding window."""

from __future__ import annotations

from fulcrum.models.arch.spec import (
    COMMON,
    HONOURED,
    QWEN_WINDOW_FIELDS,
    ModelSpec,
    attention_bias,
    windows_by_layer_type,
)

SPEC = ModelSpec(
    model_type="qwen3",
    fields={**COMMON, **QWEN_WINDOW_FIELDS, "attention_bias": HONOURED},
    qkv_bias=attention_bias,
    o_bias=attention_bias,
    qk_norm=True,
    windows_by_layer_type=windows_by_layer_type,
)
