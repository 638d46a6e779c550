"""Gemma 4 (`model_type` gemma4_text, and the multimodal gemma4): refused by the native decoder, which
samples them through the `hf` backend. Gemma 4 keeps Gemma 3's layer (norms around attention and
MLP, (1 + w) norms, local and global layers) and adds what the decoder has no slot for:

- global layers of another head_dim and K/V head count than the local ones (`per_layer_config`,
  from the config's global_head_dim and num_global_key_value_heads): one KV-cache shape per layer type;
- RoPE of type `proportional` on the global layers (`rope_parameters`): it rotates part of a head;
- an RMSNorm without weight on v, and scores not scaled (scaling 1);
- per-layer input embeddings (`hidden_size_per_layer_input`, the E2B/E4B models), K/V reused from
  earlier layers (`num_kv_shared_layers`), keys reused as values (`attention_k_eq_v`), expert MLPs
  (`enable_moe_block`), double-width MLPs (`use_double_wide_mlp`), final-logit soft-capping.

The first two hold for every Gemma 4 config; the others are named with their values when set.
"""

from __future__ import annotations

from typing import Any

from fulcrum.models.arch.spec import config_value

MODEL_TYPES = ("gemma4_text", "gemma4")

# A field -> (is it set in this config, what the decoder would need for it).
_OPTIONAL: dict[str, tuple[Any, str]] = {
    "hidden_size_per_layer_input": (bool, "per-layer input embeddings"),
    "num_kv_shared_layers": (bool, "K/V shared across layers"),
    "attention_k_eq_v": (bool, "keys reused as values"),
    "enable_moe_block": (bool, "expert MLPs"),
    "use_double_wide_mlp": (bool, "double-width MLPs"),
    "final_logit_softcapping": (lambda value: value is not None, "final-logit soft-capping"),
}


def refused_reason(config: Any) -> str:
    """Why the decoder does not run this Gemma 4 config (object or config.json dict), naming its fields."""
    multimodal = config_value(config, "model_type") == "gemma4"
    text = config_value(config, "text_config") if multimodal else config
    named = [
        f"{field}={config_value(text, field)!r} ({what})"
        for field, (is_set, what) in _OPTIONAL.items()
        if text is not None and is_set(config_value(text, field))
    ]
    why = (
        "Gemma 4's global layers have their own head_dim and K/V heads (per_layer_config) and "
        "rotate part of each head (rope_parameters rope_type 'proportional'), and v is RMS-normed"
    )
    if named:
        why += "; this config also sets " + ", ".join(named)
    if multimodal:
        why = "the multimodal Gemma 4 (vision and audio towers before the decoder); " + why
    return why
