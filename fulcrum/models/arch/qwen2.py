"""Qwen2 / Qwen2.5: `model_type` qwen2. Biases on q/k/v (never on o); a sliding window that acts
only on the layers `layer_types` marks, which the engine refuses and the packed path leaves to
the padded forward."""

from __future__ import annotations

from typing import Any

from fulcrum.models.arch.spec import COMMON, QWEN_WINDOW_FIELDS, ModelSpec, config_value


def sliding_switch(config: Any) -> str | None:
    """The packed path runs full causal attention: it leaves a config with the window switched on to
    the padded forward, whose mask Hugging Face builds per layer."""
    return "use_sliding_window=True" if config_value(config, "use_sliding_window", False) else None


SPEC = ModelSpec(
    model_type="qwen2",
    fields={**COMMON, **QWEN_WINDOW_FIELDS},
    qkv_bias=lambda _config: True,
    packing_refused=sliding_switch,
)
