"""Mistral: `model_type` mistral. Llama's layout without biases, and a sliding window on every layer
(a token sees the `sliding_window` latest positions, itself included; Mistral-7B v0.1's is 4096,
v0.2 and later have none).

Every path applies the window: the engine's attention (prefill masks, the decode kernels start at the
window's first key), the padded training forward in its mask (`fulcrum.models.logprob.no_empty_rows_mask`),
the packed one in its attention (`fulcrum.models.packed_attention.packed_attention`).
"""

from __future__ import annotations

from fulcrum.models.arch.spec import COMMON, HONOURED, ModelSpec, config_value, never

SPEC = ModelSpec(
    model_type="mistral",
    fields={**COMMON, "sliding_window": HONOURED},
    qkv_bias=never,
    window=lambda config: config_value(config, "sliding_window"),
)
