"""Gemma 3 (text): `model_type` gemma3_text (Gemma-3-270m and 1b; the text model of the larger ones).

Its layer differs from Llama's in five places, each a `ModelSpec` feature the decoder implements:
- RMSNorm computes x / rms(x) · (1 + w) in fp32 (weights are stored as w - 1), on the layer input,
  the attention output, the MLP input and the MLP output (four norms a layer), and on q and k per head;
- embeddings are scaled by sqrt(hidden), the scale rounded to the embedding dtype (a tied LM head
  reads the unscaled table);
- attention scores are scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- `layer_types` interleaves local layers (a sliding window of `sliding_window` tokens, RoPE base
  rope_parameters["sliding_attention"], the older rope_local_base_freq) with global ones (full
  causal attention, their own RoPE base): the engine keeps one RoPE table per layer type;
- the MLP gate is GELU with the tanh approximation (`gelu_pytorch_tanh`).

Soft-capping of attention scores or final logits (Gemma 2's, null in every Gemma 3 config) is refused,
as is bidirectional attention (the embedding variant). The multimodal `gemma3` (a vision tower in front
of this decoder, weights under other names) is refused with a line pointing at its text model.
"""

from __future__ import annotations

import math
from typing import Any

from fulcrum.models.arch.spec import (
    COMMON,
    HARMLESS,
    HONOURED,
    LLAMA_LAYER_WEIGHTS,
    LOCAL_AND_GLOBAL_LAYERS,
    ModelSpec,
    Runs,
    attention_bias,
    config_value,
    windows_by_layer_type,
)

# Refused `model_type`s of this family -> why, for the one-line message.
REFUSED = {
    "gemma3": "the multimodal Gemma 3 (vision tower and projector in front of the decoder); fulcrum runs "
    "its text model, model_type gemma3_text (Gemma-3-270m and 1b are text-only checkpoints)",
}

# Llama's names, and two more norms; post_attention_layernorm normalises the attention output here.
GEMMA_LAYER_WEIGHTS: dict[str, str] = {
    **LLAMA_LAYER_WEIGHTS,
    "post_attention_layernorm.weight": "attn_out_norm",  # on the attention output, before the residual
    "pre_feedforward_layernorm.weight": "post_norm",  # the MLP input's, as Llama's post_attention_layernorm
    "post_feedforward_layernorm.weight": "mlp_out_norm",
}


def _is_none(value: Any, _config: Any, _max_len: int | None) -> bool:
    return value is None


SPEC = ModelSpec(
    model_type="gemma3_text",
    fields={
        **{name: rule for name, rule in COMMON.items() if name != "hidden_act"},
        "attention_bias": HONOURED,  # q/k/v and o biases
        "hidden_activation": Runs(lambda value, _c, _m: value == "gelu_pytorch_tanh", "gelu_pytorch_tanh"),
        "query_pre_attn_scalar": HONOURED,
        "layer_types": LOCAL_AND_GLOBAL_LAYERS,
        "sliding_window": HONOURED,
        "_sliding_window_pattern": HARMLESS,  # it only decides layer_types
        "attn_logit_softcapping": Runs(_is_none, "no attention soft-capping"),
        "final_logit_softcapping": Runs(_is_none, "no final-logit soft-capping"),
        "use_bidirectional_attention": Runs(lambda value, _c, _m: not value, "causal attention"),
    },
    qkv_bias=attention_bias,
    o_bias=attention_bias,
    qk_norm=True,
    windows_by_layer_type=windows_by_layer_type,
    layer_weights=GEMMA_LAYER_WEIGHTS,
    norm_offset=1.0,
    sandwich_norms=True,
    embed_scale=lambda config: math.sqrt(config_value(config, "hidden_size")),
    attention_scale=lambda config: config_value(config, "query_pre_attn_scalar") ** -0.5,
    activation=lambda _config: "gelu_tanh",
)
