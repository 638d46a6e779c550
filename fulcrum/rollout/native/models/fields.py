"""Which Hugging Face config fields the native decoder (qwen2.py) honours, per architecture.

Every field of transformers' `LlamaConfig` and `Qwen2Config` is classified here, so that a model is
never sampled by a function other than the one the trainer differentiates:

- HONOURED: the decoder reads the field and computes what Hugging Face computes with it;
- HARMLESS: the field does not change what Hugging Face computes at inference (names, token ids,
  dtype, training-only dropout, output switches);
- `Runs(...)`: the decoder does not implement the field, and runs only the values for which Hugging
  Face computes what the decoder does (usually the default); any other value is refused.

`unsupported_reason(config)` names the first field refused, or a field of the config class this list
does not classify (a newer transformers), and `fulcrum.rollout.build_rollout` then samples with the
`hf` backend, with one log line. Fields that the config class does not declare (a checkpoint's own
extras such as SmolLM2's `rope_interleaved`) are ignored by Hugging Face's model too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HONOURED = "honoured"
HARMLESS = "harmless"

# RoPE variants whose frequencies are fixed: the decoder takes inv_freq and the attention scaling from
# the Hugging Face rotary module, so these match. `dynamic` and `longrope` change with the sequence
# length, `proportional` rotates part of a head: the decoder's one fixed table cannot follow them.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class Runs:
    """A field the decoder does not implement: `accepts(value, config)` is True for the values it runs
    as Hugging Face does; `supported` says which, for the message."""

    accepts: Callable[[Any, Any], bool]
    supported: str


def _static_rope(value: Any, _config: Any) -> bool:
    """rope_parameters (or the older rope_scaling): null, one variant's dict, or a dict per layer type."""
    if not value:
        return True
    if not isinstance(value, dict):
        return False
    if all(isinstance(v, dict) for v in value.values()):
        return all(_static_rope(v, _config) for v in value.values())
    return value.get("rope_type", value.get("type", "default")) in STATIC_ROPE_TYPES


def _full_attention(layer_types: Any, _config: Any) -> bool:
    return layer_types is None or all(kind == "full_attention" for kind in layer_types)


def _no_sliding_layer(use_sliding_window: Any, config: Any) -> bool:
    """Qwen2 slides only on the layers `layer_types` marks (from max_window_layers on)."""
    return not use_sliding_window or _full_attention(getattr(config, "layer_types", None), config)


COMMON: dict[str, str | Runs] = {
    # the decoder's shapes and arithmetic
    "model_type": HONOURED,  # checked first: one of CONFIG_FIELDS
    "vocab_size": HONOURED,
    "hidden_size": HONOURED,
    "intermediate_size": HONOURED,
    "num_hidden_layers": HONOURED,
    "num_attention_heads": HONOURED,
    "num_key_value_heads": HONOURED,
    "head_dim": HONOURED,
    "rms_norm_eps": HONOURED,
    "max_position_embeddings": HONOURED,  # the RoPE table's first size (it grows past it as HF's does)
    "tie_word_embeddings": HONOURED,  # the head is the embedding
    "rope_theta": HONOURED,  # older transformers' spelling, inside inv_freq
    "hidden_act": Runs(lambda value, _c: value in ("silu", "swish"), "silu"),
    "rope_parameters": Runs(_static_rope, f"rope_type one of {list(STATIC_ROPE_TYPES)}"),
    "rope_scaling": Runs(_static_rope, f"rope_type one of {list(STATIC_ROPE_TYPES)}"),  # older name
    "quantization_config": Runs(lambda value, _c: not value, "no quantization"),
    # what does not change the function sampled
    "_name_or_path": HARMLESS,
    "architectures": HARMLESS,
    "transformers_version": HARMLESS,
    "dtype": HARMLESS,  # the engine has its own (rollout.dtype)
    "torch_dtype": HARMLESS,
    "id2label": HARMLESS,
    "label2id": HARMLESS,
    "problem_type": HARMLESS,
    "return_dict": HARMLESS,
    "output_attentions": HARMLESS,
    "output_hidden_states": HARMLESS,
    "chunk_size_feed_forward": HARMLESS,  # not read by the Llama / Qwen2 modules
    "is_encoder_decoder": HARMLESS,  # never true for these decoders
    "use_cache": HARMLESS,
    "initializer_range": HARMLESS,  # initialisation only
    "attention_dropout": HARMLESS,  # training mode only; sampling never drops
    "pad_token_id": HARMLESS,
    "bos_token_id": HARMLESS,
    "eos_token_id": HARMLESS,  # stop ids come from the tokenizer and generation_config
}

CONFIG_FIELDS: dict[str, dict[str, str | Runs]] = {
    "llama": {
        **COMMON,
        "attention_bias": HONOURED,  # q/k/v and o biases
        "mlp_bias": Runs(lambda value, _c: not value, "mlp_bias=False"),
        "pretraining_tp": HARMLESS,  # Hugging Face's model no longer reads it (it only split matmuls)
    },
    "qwen2": {
        **COMMON,
        "layer_types": Runs(_full_attention, "full_attention on every layer"),
        "use_sliding_window": Runs(_no_sliding_layer, "no sliding-window layer"),
        "sliding_window": HARMLESS,  # acts only on the layers layer_types marks
        "max_window_layers": HARMLESS,  # the same: it only decides layer_types
    },
}


def _shown(value: Any) -> str:
    """A value for a one-line message: a long per-layer list as counts ([28 x 'full_attention', ...])."""
    if isinstance(value, list) and len(value) > 4:
        counts = Counter(map(repr, value))
        return "[" + ", ".join(f"{n} x {item}" for item, n in counts.items()) + "]"
    return repr(value)


def unclassified_fields(config: Any) -> list[str]:
    """Fields the config's class declares that CONFIG_FIELDS does not classify (a newer transformers)."""
    fields = CONFIG_FIELDS[config.model_type]
    return sorted(set(type(config)().to_dict()) - set(fields))


def unsupported_reason(config: Any) -> str | None:
    """Why the native decoder cannot run this Hugging Face config (naming the field), or None."""
    model_type = getattr(config, "model_type", None)
    if model_type not in CONFIG_FIELDS:
        return f"model_type={model_type!r}"
    missing = object()
    for name, rule in CONFIG_FIELDS[model_type].items():
        if not isinstance(rule, Runs):
            continue
        value = getattr(config, name, missing)
        if value is not missing and not rule.accepts(value, config):
            return f"{name}={_shown(value)} (it runs {rule.supported})"
    unknown = unclassified_fields(config)
    if unknown:
        return f"the {model_type} config field(s) {unknown}, which it does not know"
    return None
