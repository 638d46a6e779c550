"""How many parameters a model trains and how many it holds frozen, for the memory estimate.

A fully trained model trains every parameter (float32 master, gradient, AdamW's two moments). A LoRA
model (verl's `lora_rank` > 0, or a `lora_adapter_path`) trains only its adapters, r·(in + out) per
adapted Linear (`fulcrum.models.lora`), and holds its base once, frozen, in the compute dtype; the
critic's value head trains whole either way.

The adapted weights are found as peft (0.21 and 0.22, over transformers 5's models) finds them, on the module
paths of the family's decoder (`model.layers.{i}.self_attn.q_proj`, `...linear_attn.in_proj_qkv`, ...):
"all-linear" is every Linear but the LM head, a list matches module names (or path suffixes), a string
is a regular expression over the whole path, and `exclude_modules` takes Linears out the same way. A
Gated DeltaNet layer's Linears are its input projections (Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b,
in_proj_a; Qwen3-Next's fused in_proj_qkvz, in_proj_ba) and out_proj (its conv is no Linear); an
output-gated attention's q_proj is twice as wide. A mixture of experts (Qwen3-MoE, Qwen3-Next: the
Qwen2-MoE layout) keeps its experts as fused 3-D parameters and its router as a parameter, which peft
adapts as parameters: it reads the target names `gate`, `gate_proj`, `up_proj` and `down_proj` (a string
first resolved to the names of what it matches) as the router's `gate.weight` (r·(h + E)) and the
experts' `gate_up_proj` (2r·E·(h + 2I), its rank doubled for the two fused projections) and `down_proj`
(r·E·(I + h)). peft 0.22 also adapts the Linears of those names (a dense layer's MLP, Qwen3-Next's shared
expert), which 0.21 left without adapters (`peft_adapts_linears_of_expert_names`); the shared expert's gate
(a Linear h → 1) is adapted by both. No torch here: `fulcrum doctor` runs without it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fulcrum.models.arch import ModelShape

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# peft's renaming of a Qwen2-MoE-layout mixture of experts: target name -> the parameter it adapts.
MOE_TARGETS = {
    "gate": "gate.weight",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "down_proj": "down_proj",
}
FUSED_EXPERTS = ("gate_proj", "up_proj")  # fused into gate_up_proj: adapted together, at twice the rank


@dataclass(frozen=True)
class ModelParams:
    """One model's parameters: `trained` (float32 masters with AdamW state), `frozen` (held once in
    the compute dtype, no gradient or optimiser state: a LoRA base)."""

    trained: int
    frozen: int = 0

    @property
    def lora(self) -> bool:
        return self.frozen > 0


@dataclass(frozen=True)
class Weight:
    """A weight LoRA may adapt: a Linear (its module path) or an expert layer's parameter (its path),
    `fan_in` -> `fan_out`; `experts` > 0 for a 3-D parameter of that many experts, each adapted."""

    path: str
    fan_in: int
    fan_out: int
    experts: int = 0

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    def adapter_params(self, rank: int) -> int:
        """r·(in + out), per expert of a 3-D parameter."""
        return rank * (self.fan_in + self.fan_out) * max(1, self.experts)


def linear_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each Linear of an attention layer with a dense MLP, by module name."""
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return {
        "q_proj": (h, q * (2 if shape.attention_output_gate else 1)),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def _linear_mixer(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) of a Gated DeltaNet layer's Linears, by module name."""
    h, heads = shape.hidden, shape.linear_value_heads
    key, value = shape.linear_key_heads * shape.linear_key_dim, heads * shape.linear_value_dim
    if shape.linear_projections_fused:
        inputs = {"in_proj_qkvz": (h, 2 * key + 2 * value), "in_proj_ba": (h, 2 * heads)}
    else:
        inputs = {"in_proj_qkv": (h, 2 * key + value), "in_proj_z": (h, value)}
        inputs |= {"in_proj_b": (h, heads), "in_proj_a": (h, heads)}
    return inputs | {"out_proj": (value, h)}


def layer_weights(shape: ModelShape, layer: int) -> tuple[list[Weight], list[Weight]]:
    """(Linears, expert-layer parameters) of decoder layer `layer`. Expert layers are taken to be the
    last `moe_layers` (where they sit changes no count: peft adapts their names in every layer)."""
    base = f"model.layers.{layer}"
    linears = linear_shapes(shape)
    if layer in shape.linear_layer_ids:
        mixer = [Weight(f"{base}.linear_attn.{n}", *io) for n, io in _linear_mixer(shape).items()]
    else:
        mixer = [Weight(f"{base}.self_attn.{n}", *linears[n]) for n in ATTENTION]
    if layer < shape.layers - shape.moe_layers:
        return mixer + [Weight(f"{base}.mlp.{n}", *linears[n]) for n in MLP], []
    h, inter, experts = shape.hidden, shape.expert_intermediate, shape.experts
    params = [
        Weight(f"{base}.mlp.gate.weight", h, experts),
        Weight(f"{base}.mlp.experts.gate_up_proj", h, 2 * inter, experts),
        Weight(f"{base}.mlp.experts.down_proj", inter, h, experts),
    ]
    shared = shape.shared_expert_intermediate
    if shared:
        mixer += [Weight(f"{base}.mlp.shared_expert.{n}", *io) for n, io in _swiglu(h, shared).items()]
        mixer.append(Weight(f"{base}.mlp.shared_expert_gate", h, 1))
    return mixer, params


def _swiglu(hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    return {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def _matches(path: str, names: str | list[str] | set[str] | None, default: bool) -> bool:
    """peft's rule: a string is a regex over the whole path ("all-linear": every Linear), a list of
    names matches the path or its last parts; None matches as `default` says."""
    if names is None:
        return default
    if isinstance(names, str):
        return names == "all-linear" or re.fullmatch(names, path) is not None
    return any(path == n or path.endswith("." + n) for n in names)


def peft_adapts_linears_of_expert_names() -> bool:
    """Whether the installed peft adapts a Linear named like an expert projection (a dense layer's MLP,
    a shared expert) beside the experts' parameters: from 0.22 it does, 0.21 took those names for the
    parameters alone. Read from the package's metadata (no import: doctor runs without torch); the newer
    rule when peft is not installed."""
    try:
        found = re.findall(r"\d+", importlib.metadata.version("peft"))[:2]
    except importlib.metadata.PackageNotFoundError:
        return True
    return tuple(int(part) for part in found) >= (0, 22)


def _expert_targets(
    targets: str | list[str] | None, linears: list[Weight], params: list[Weight]
) -> tuple[set[str], set[str], int]:
    """peft's targets on a Qwen2-MoE-layout model: (Linear names, parameter names, gate_up_proj's rank
    factor). A string is first resolved to names: "all-linear" to every Linear's name and the four
    expert names; a regex to the names of the Linears, parameters and router it matches, and an expert
    name whose pre-fusion path (`...experts.gate_proj`) it matches."""
    if targets is None or targets == "all-linear":
        names = {w.name for w in linears} | set(MOE_TARGETS)
    elif isinstance(targets, str):
        paths = [w.path for w in linears + params] + [
            w.path[: -len(".weight")] for w in params if w.name == "weight"
        ]
        names = {p.rsplit(".", 1)[-1] for p in paths if re.fullmatch(targets, p)}
        for old, new in MOE_TARGETS.items():
            containers = [w.path.rsplit(".", 1)[0] for w in params if w.name == new]
            if any(re.fullmatch(targets, f"{c}.{old}") for c in containers):
                names.add(old)
    else:
        names = set(targets)
    modules, adapted, fused = set(), set(), set()
    linears_too = peft_adapts_linears_of_expert_names()
    for name in names:
        old = next((o for o in MOE_TARGETS if name == o or name.endswith("." + o)), None)
        if old is None or linears_too:
            modules.add(name)
        if old is not None:
            adapted.add(MOE_TARGETS[old])
            fused |= {old} & set(FUSED_EXPERTS)
    return modules, adapted, len(fused) if len(fused) == len(FUSED_EXPERTS) else 1


def adapter_param_count(
    shape: ModelShape, rank: int, targets: str | list[str] | None, exclude: str | list[str] | None = None
) -> int:
    """Σ r·(in + out) over the Linears that `targets` names and `exclude` does not, and (a mixture of
    experts) over the router and expert parameters peft reads `targets` as (module docstring)."""
    linears, params = [], []
    for layer in range(shape.layers):
        layer_linears, layer_params = layer_weights(shape, layer)
        linears += layer_linears
        params += layer_params
    if not params:
        chosen = [w for w in linears if _matches(w.path, targets, True)]
        return sum(w.adapter_params(rank) for w in chosen if not _matches(w.path, exclude, False))
    modules, adapted, factor = _expert_targets(targets, linears, params)
    chosen = [w for w in linears if _matches(w.path, modules, False) and not _matches(w.path, exclude, False)]
    total = sum(w.adapter_params(rank) for w in chosen)
    for w in params:  # exclude_modules takes out Linears only
        if _matches(w.path, adapted, False):
            total += w.adapter_params(rank * (factor if w.name == "gate_up_proj" else 1))
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
