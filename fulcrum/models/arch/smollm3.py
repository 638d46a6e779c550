"""SmolLM3: `model_type` smollm3 (SmolLM3-3B). Llama's layer, with layers that rotate nothing: in
`no_rope_layers` a 0 marks a layer without positions (NoPE; every fourth layer by default,
`no_rope_layer_interval`), whose q and k reach attention as projected. The engine gives those layers
a RoPE table of zero frequencies, which leaves q and k unchanged (`ModelSpec.rotary_layers`).

Biases with `attention_bias` (q/k/v and o). `layer_types` may mark sliding layers when
`use_sliding_window` and a `sliding_window` are set (SmolLM3-3B has none); a sliding layer without
them is refused, since Hugging Face's SDPA mask would slide where its flash path would not.
"""

from __future__ import annotations

from typing import Any

from fulcrum.models.arch.spec import (
    COMMON,
    HARMLESS,
    HONOURED,
    ModelSpec,
    Runs,
    attention_bias,
    config_value,
    windows_by_layer_type,
)


def _layers_it_runs(layer_types: Any, config: Any, _max_len: int | None = None) -> bool:
    kinds = set(layer_types or [])
    if kinds <= {"full_attention"}:
        return True
    windowed = config_value(config, "use_sliding_window") and config_value(config, "sliding_window")
    return kinds <= {"sliding_attention", "full_attention"} and bool(windowed)


def rotary_layers(config: Any) -> list[bool]:
    """Which layers rotate q and k: `no_rope_layers[i]` 1 (RoPE) or 0 (NoPE)."""
    layers = int(config_value(config, "num_hidden_layers"))
    return [bool(flag) for flag in config_value(config, "no_rope_layers")[:layers]]


SPEC = ModelSpec(
    model_type="smollm3",
    fields={
        **COMMON,
        "attention_bias": HONOURED,  # q/k/v and o biases
        "mlp_bias": Runs(lambda value, _c, _m: not value, "mlp_bias=False"),
        "no_rope_layers": HONOURED,
        "no_rope_layer_interval": HARMLESS,  # it only decides no_rope_layers
        "layer_types": Runs(
            _layers_it_runs,
            "full_attention layers, and sliding_attention ones with use_sliding_window and a sliding_window",
        ),
        "use_sliding_window": HONOURED,  # through layer_types, which it decides with sliding_window
        "sliding_window": HONOURED,
    },
    qkv_bias=attention_bias,
    o_bias=attention_bias,
    windows_by_layer_type=windows_by_layer_type,
    rotary_layers=rotary_layers,
)
