"""Qwen2 / Qwen2.5: `model_type` qwen2. Biases on q/k/v (never on o); with `use_sliding_window`, the
layers from `max_window_layers` on slide `sliding_window` tokens (`layer_types` marks them) and the
others see everything: every path applies each layer's own window, as Gemma 3's local layers."""

from __future__ import annotations

from fulcrum.models.arch.spec import COMMON, QWEN_WINDOW_FIELDS, ModelSpec, windows_by_layer_type

SPEC = ModelSpec(
    model_type="qwen2",
    fields={**COMMON, **QWEN_WINDOW_FIELDS},
    qkv_bias=lambda _config: True,
    windows_by_layer_type=windows_by_layer_type,
)
