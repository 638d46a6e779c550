"""The architecture registry: one `ModelSpec` per Hugging Face `model_type` (spec.py says what one holds).

Adding a family: its module here (a `SPEC`) and one line in `SPECS`. The native engine
(`fulcrum.rollout.native`), the packed training path (`fulcrum.models.packed`), the MFU
(`fulcrum.trainer.metrics`) and the memory estimate (`fulcrum.tools.memory_estimate`) ask it.
"""

from __future__ import annotations

from typing import Any

from fulcrum.models.arch import (
    gemma3,
    gemma4,
    llama,
    mistral,
    olmo3,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
    smollm3,
)
from fulcrum.models.arch.spec import ModelShape, ModelSpec, attention_bias, config_value, dense_shape

SPECS: dict[str, ModelSpec] = {
    "gemma3_text": gemma3.SPEC,
    "llama": llama.SPEC,
    "mistral": mistral.SPEC,
    "olmo3": olmo3.SPEC,
    "qwen2": qwen2.SPEC,
    "qwen3": qwen3.SPEC,
    "qwen3_5_text": qwen3_5.SPEC,
    "qwen3_5_moe_text": qwen3_5_moe.SPEC,
    "qwen3_moe": qwen3_moe.SPEC,
    "qwen3_next": qwen3_next.SPEC,
    "smollm3": smollm3.SPEC,
}

__all__ = [
    "SPECS",
    "ModelShape",
    "ModelSpec",
    "causal_lm_config",
    "model_shape",
    "spec_for",
    "unsupported_reason",
]


def causal_lm_config(config: Any) -> Any:
    """The config of the model `AutoModelForCausalLM` builds from `config` (object or config.json dict).

    A multimodal config (a `text_config` inside) whose causal-LM class is its text model's loads as that
    text model alone, vision tower left out: Qwen3.5's `qwen3_5` (Qwen3_5ForConditionalGeneration
    checkpoints) gives Qwen3_5ForCausalLM over its `qwen3_5_text` config. Any other config is its own
    (Gemma 3's causal-LM class of `gemma3` is the multimodal one)."""
    text = config_value(config, "text_config")
    if text is None:
        return config
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LM

    outer = CAUSAL_LM.get(config_value(config, "model_type"))
    return text if outer is not None and outer == CAUSAL_LM.get(config_value(text, "model_type")) else config


def spec_for(config: Any) -> ModelSpec | None:
    """The spec of a config's `model_type` (config object or config.json dict; a multimodal one read as
    the text model it loads as, `causal_lm_config`), None when unknown."""
    return SPECS.get(config_value(causal_lm_config(config), "model_type"))


def model_shape(config: Any) -> ModelShape:
    """The shape that FLOPs and bytes are computed from; a family without a spec is read as a plain
    Llama-style decoder (biases from `attention_bias`)."""
    config = causal_lm_config(config)
    spec = spec_for(config)
    if spec is None:
        return dense_shape(config, attention_bias(config), attention_bias(config))
    return spec.shape(config)


def unsupported_reason(config: Any, max_model_len: int | None = None) -> str | None:
    """Why the native decoder cannot run this Hugging Face config (naming the field), or None.

    `max_model_len`: the longest sequence the engine will run (a sliding window that covers it is
    no window); None when unknown.
    """
    config = causal_lm_config(config)
    spec = spec_for(config)
    if spec is None:
        model_type = config_value(config, "model_type")
        if model_type in gemma4.MODEL_TYPES:
            why = gemma4.refused_reason(config)
        else:
            why = gemma3.REFUSED.get(model_type)
        return f"model_type={model_type!r} ({why if why else 'it runs ' + ', '.join(sorted(SPECS))})"
    return spec.unsupported_reason(config, max_model_len)
