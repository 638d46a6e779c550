"""OLMo 3: `model_type` olmo3 (Olmo-3-7B and 32B, base and instruct). Its layer differs from Llama's
in three places, each a `ModelSpec` feature the decoder implements:
- no norm on the layer's or the MLP's input: the attention and MLP outputs are normed before each
  residual sum (`post_attention_layernorm`, `post_feedforward_layernorm`; `pre_norms` False);
- the QK-norm spans all heads of a token, q_norm H·d wide and k_norm K·d wide, taken before the
  heads are split and before RoPE (`qk_norm_over_heads`; under tensor parallelism the ranks sum
  their squares);
- `layer_types` interleaves local layers (a sliding window of `sliding_window` tokens) with global
  ones, each type with its own RoPE table (rope_parameters by layer type).

Biases with `attention_bias` (q/k/v and o). Its RMSNorms take the weight's product in fp32 and round
once; the engine's residual norms round before the product as Llama's do, which differs only in
bf16, by one rounding.
"""

from __future__ import annotations

from fulcrum.models.arch.spec import (
    COMMON,
    HONOURED,
    LLAMA_LAYER_WEIGHTS,
    LOCAL_AND_GLOBAL_LAYERS,
    ModelSpec,
    attention_bias,
    windows_by_layer_type,
)

# Llama's names without the input norms; post_attention_layernorm normalises the attention output here.
OLMO_LAYER_WEIGHTS: dict[str, str] = {
    **{name: slot for name, slot in LLAMA_LAYER_WEIGHTS.items() if slot not in ("input_norm", "post_norm")},
    "post_attention_layernorm.weight": "attn_out_norm",
    "post_feedforward_layernorm.weight": "mlp_out_norm",
}

SPEC = ModelSpec(
    model_type="olmo3",
    fields={
        **COMMON,
        "attention_bias": HONOURED,  # q/k/v and o biases
        "layer_types": LOCAL_AND_GLOBAL_LAYERS,
        "sliding_window": HONOURED,
    },
    qkv_bias=attention_bias,
    o_bias=attention_bias,
    qk_norm=True,
    qk_norm_over_heads=True,
    windows_by_layer_type=windows_by_layer_type,
    layer_weights=OLMO_LAYER_WEIGHTS,
    pre_norms=False,
)
