"""Llama 1-3.x (and SmolLM2 and other Llama-shaped checkpoints): `model_type` llama.

Llama 3.x's `rope_scaling` (rope_type llama3) changes only the inverse frequencies, which the engine
takes from the Hugging Face rotary module; `attention_bias` puts biases on q/k/v and o.
"""

from __future__ import annotations

from fulcrum.models.arch.spec import COMMON, HARMLESS, HONOURED, ModelSpec, Runs, attention_bias

SPEC = ModelSpec(
    model_type="llama",
    fields={
        **COMMON,
        "attention_bias": HONOURED,  # q/k/v and o biases
        "mlp_bias": Runs(lambda value, _c, _m: not value, "mlp_bias=False"),
        "pretraining_tp": HARMLESS,  # Hugging Face's model no longer reads it (it only split matmuls)
    },
    qkv_bias=attention_bias,
    o_bias=attention_bias,
)
