"""How many parameters a model trains and how many it holds frozen, for the memory estimate.

A fully trained model trains every parameter (float32 master, gradient, AdamW's two moments). A LoRA
model (verl's `lora_rank` > 0, or a `lora_adapter_path`) trains only its adapters, r·(in + out) per
adapted Linear (`fulcrum.models.lora`), and holds its base once, frozen, in the compute dtype; the
critic's value head trains whole either way.

The adapted Linears are found as peft finds them, on the module paths of a Llama-style decoder
(`model.layers.{i}.self_attn.q_proj`, ...): "all-linear" is every Linear but the LM head, a list
matches module names (or path suffixes), a string is a regular expression over the whole path.
Experts of a mixture-of-experts layer are not Linear modules in transformers' fused layout and get no
adapters; their layers count their attention only. No torch here: `fulcrum doctor` runs without it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fulcrum.models.arch import ModelShape

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelParams:
    """One model's parameters: `trained` (float32 masters with AdamW state), `frozen` (held once in
    the compute dtype, no gradient or optimiser state: a LoRA base)."""

    trained: int
    frozen: int = 0

    @property
    def lora(self) -> bool:
        return self.frozen > 0


def linear_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each Linear of a decoder layer, by module name."""
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def _matches(path: str, names: str | list[str] | None, default: bool) -> bool:
    """peft's rule: a string is a regex over the whole path ("all-linear": every Linear), a list of
    names matches the path or its last parts; None matches as `default` says."""
    if names is None:
        return default
    if isinstance(names, str):
        return names == "all-linear" or re.fullmatch(names, path) is not None
    return any(path == n or path.endswith("." + n) for n in names)


def adapter_param_count(
    shape: ModelShape, rank: int, targets: str | list[str] | None, exclude: str | list[str] | None = None
) -> int:
    """Σ r·(in + out) over the decoder's Linears that `targets` names and `exclude` does not."""
    total = 0
    linears = linear_shapes(shape)
    for layer in range(shape.layers):
        dense = layer < shape.layers - shape.moe_layers  # where the MLP is a plain SwiGLU
        for name in ATTENTION + (MLP if dense else ()):
            part = "self_attn" if name in ATTENTION else "mlp"
            path = f"model.layers.{layer}.{part}.{name}"
            if _matches(path, targets, True) and not _matches(path, exclude, False):
                fan_in, fan_out = linears[name]
                total += rank * (fan_in + fan_out)
    return total


def _names(value: Any) -> str | list[str] | None:
    if value is None or isinstance(value, str):
        return value
    return [str(v) for v in value]


def adapter_settings(model_cfg: Any) -> tuple[int, str | list[str] | None, str | list[str] | None]:
    """(rank, target_modules, exclude_modules) of a model section; from its `lora_adapter_path`'s
    adapter_config.json when it names a readable one (the adapters' own), else the section's keys."""
    rank = int(model_cfg.lora_rank or 0)
    targets = _names(model_cfg.target_modules) or "all-linear"
    exclude = _names(getattr(model_cfg, "exclude_modules", None))  # the critic's section has none
    path = getattr(model_cfg, "lora_adapter_path", None)
    if path:
        try:
            saved = json.loads((Path(os.path.expanduser(path)) / "adapter_config.json").read_text())
            return int(saved["r"]), _names(saved.get("target_modules")), _names(saved.get("exclude_modules"))
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return rank, targets, exclude


def model_params(model_cfg: Any, shape: ModelShape, total: int, head: int = 0) -> ModelParams:
    """The trained and frozen parameters of a model of `total` parameters (`head` of them a value head
    that trains whole) under the section's LoRA keys."""
    rank, targets, exclude = adapter_settings(model_cfg)
    if rank <= 0 and not getattr(model_cfg, "lora_adapter_path", None):
        return ModelParams(trained=total)
    adapters = adapter_param_count(shape, max(rank, 1), targets, exclude)
    return ModelParams(trained=adapters + head, frozen=total - head)
