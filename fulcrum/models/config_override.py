"""verl's `model.override_config`: fields set on a model's Hugging Face config before it is built.

verl (`fsdp_workers.py`, `verl.utils.model.update_model_config`) reads the folder's config, then sets
every key of `actor_rollout_ref.model.override_config` (actor, reference and rollout alike) or
`critic.model.override_config` on it, recursing into nested mappings; `attn_implementation` it takes
out first and hands to the loader. fulcrum applies the same keys wherever it builds a model from the
folder (`fulcrum.models.load`), so the actor, the reference, the critic and the engine's copy all
see one config. Examples: `{attention_dropout: 0.0}`, `{output_router_logits: true}` (an MoE model's
router loss, `fulcrum.models.router_loss`), `{rope_scaling: {type: yarn, factor: 4.0}}`.

Where fulcrum departs from verl: a key the config does not have is an error naming the key, the
config path and the closest field. verl's `setattr` accepts it, and as modelling code reads only the
fields its config defines, a misspelt key would change nothing, silently. The exceptions are the few
fields Hugging Face's decoders read with a default when a config leaves them out (`OPTIONAL_FIELDS`,
from `getattr(config, ...)` in transformers 5.24's Qwen2/3, Llama, Mistral, Gemma 3 and Qwen3-MoE
modelling files): those are set as verl sets them. A nested mapping merges into a mapping field (`rope_scaling`: verl's recursion
would `setattr` on a dict and fail) or recurses into a sub-config (`text_config`).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

# Keys verl's loader reads itself and passes to `from_pretrained`, not set as config fields.
LOADER_KEYS = ("attn_implementation",)
# Fields a config may leave out that the modelling code reads with a default (see the module docstring).
OPTIONAL_FIELDS = ("head_dim", "sliding_window", "layer_types", "attention_chunk_size")


def override_key(path_key: str) -> str:
    """The override's config path from the model path's: `critic.model.path` → `critic.model.override_config`."""
    return path_key.rsplit(".", 1)[0] + ".override_config"


def _fields(config: Any) -> list[str]:
    """The config's field names, for a 'did you mean'."""
    return sorted(config.to_dict()) if hasattr(config, "to_dict") else sorted(vars(config))


def override_problems(config: Any, override: Mapping[str, Any], key: str, top: bool = True) -> list[str]:
    """Why `override` cannot be applied to `config` (empty: it can); `key` is its config path, `top`
    whether `override` is the whole override (where the loader's keys live) or a nested part."""
    problems = []
    for name, value in override.items():
        if top and name in LOADER_KEYS:
            continue
        where = f"{key}.{name}"
        if not hasattr(config, name) and name not in OPTIONAL_FIELDS:
            close = difflib.get_close_matches(name, _fields(config), n=1)
            hint = f"; did you mean {key}.{close[0]}?" if close else ""
            kind = getattr(config, "model_type", None) or type(config).__name__
            problems.append(f"{where}: the {kind} model config has no field {name!r}{hint}")
        elif isinstance(value, Mapping) and _is_config(getattr(config, name, None)):
            problems += override_problems(getattr(config, name), value, where, top=False)
    return problems


def _is_config(value: Any) -> bool:
    """A nested Hugging Face config (`text_config`), which an override recurses into."""
    return hasattr(value, "to_dict") and not isinstance(value, Mapping)


def apply_override(config: Any, override: Mapping[str, Any], key: str) -> Any:
    """`config` with `override` set on it (in place; returned for chaining); a ValueError listing every
    key it does not have (see the module docstring)."""
    problems = override_problems(config, override, key)
    if problems:
        raise ValueError("; ".join(problems))
    _set(config, override, top=True)
    return config


def _set(config: Any, override: Mapping[str, Any], top: bool) -> None:
    for name, value in override.items():
        if top and name in LOADER_KEYS:
            continue
        current = getattr(config, name, None)
        if isinstance(value, Mapping) and _is_config(current):
            _set(current, value, top=False)
        elif isinstance(value, Mapping) and (current is None or isinstance(current, Mapping)):
            setattr(config, name, {**(current or {}), **_plain(value)})
        else:
            setattr(config, name, _plain(value))


def _plain(value: Any) -> Any:
    """Lists and mappings as plain Python ones (an OmegaConf container is not JSON-serialisable)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [_plain(v) for v in value]
    return value


def loader_kwargs(override: Mapping[str, Any]) -> dict[str, Any]:
    """The keys verl hands to `from_pretrained` rather than the config (`attn_implementation`)."""
    return {name: override[name] for name in LOADER_KEYS if name in override}
