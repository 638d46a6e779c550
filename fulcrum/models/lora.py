"""LoRA adapters on a Hugging Face model, built on peft: the base frozen, the adapters trained.

`Adapters(model, settings)` injects peft's LoRA layers into `model` in place: the module keeps its
class, its `config` and its module paths (each adapted `nn.Linear` becomes a peft `LoraLayer` that
holds it as `base_layer`), so the workers' packed and padded forwards, gradient checkpointing and
bf16 compute weights run on it unchanged. The frozen base is held once, in the compute dtype (bf16
on CUDA: `freeze_base`), with no float32 master, gradient or optimiser state; the adapters are float32
masters with bf16 compute copies, as a fully trained model's weights. What LoRA adds:

- `disabled()`: the adapters switched off (peft's `disable_adapter`): the base model's log-probs,
  which are the reference policy's, from the same weights (no second model in memory);
- `merged_weights()`: the adapted modules' weights as the engine must see them, W + scale·B·A under
  their Hugging Face names, one module at a time (the frozen rest never changes, so it is not sent);
  a parameter peft adapts in place (a router's weight, a fused expert stack) the same, per expert;
- `state_dict()` / `load_state_dict()` / `save()`: the adapters alone, as a PEFT adapter folder.

`base_view(module)` is the base model under its Hugging Face names, sharing the base's tensors: what
an engine that copies a plain model's weights starts from before the merged weights arrive.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fulcrum.models.precision import compute_dtype

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_POINTER = "base_model.json"  # which base model the adapters were trained on, and its checksum
# The files of a Hugging Face folder that make up a model's weights and shape (hashed for the pointer).
BASE_FILES = ("config.json", "*.safetensors", "*.bin")


@dataclass(frozen=True)
class LoraSettings:
    """verl's LoRA keys of one model (`actor_rollout_ref.model.*` or `critic.model.*`)."""

    rank: int
    alpha: float
    target_modules: str | tuple[str, ...]
    exclude_modules: str | tuple[str, ...] | None = None
    adapter_path: str | None = None
    key: str = "actor_rollout_ref.model"  # where the keys live, for messages

    @property
    def enabled(self) -> bool:
        """verl's rule: LoRA when a rank is given or an adapter folder is named."""
        return self.rank > 0 or self.adapter_path is not None

    def base_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype to load the model in: LoRA's frozen base in the compute dtype, else float32 masters."""
        return compute_dtype(device) if self.enabled else torch.float32

    @classmethod
    def of(cls, model_cfg: Any, key: str) -> LoraSettings:
        def names(value: Any) -> str | tuple[str, ...] | None:
            if value is None or isinstance(value, str):
                return value
            return tuple(str(v) for v in value)

        # The critic's section has no exclude_modules nor lora_adapter_path: absent reads as unset.
        return cls(
            rank=int(model_cfg.lora_rank or 0),
            alpha=float(model_cfg.lora_alpha),
            target_modules=names(model_cfg.target_modules) or "all-linear",
            exclude_modules=names(getattr(model_cfg, "exclude_modules", None)),
            adapter_path=getattr(model_cfg, "lora_adapter_path", None),
            key=key,
        )


def adapter_folder_problems(path: str, key: str) -> list[str]:
    """What keeps `path` from being a PEFT adapter folder (empty: it is one)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return [f"{key}.lora_adapter_path: {path} is not a folder"]
    missing = [name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (folder / name).is_file()]
    if missing:
        return [f"{key}.lora_adapter_path: {path} has no {' or '.join(missing)} (not a PEFT adapter folder)"]
    return []


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) parameter's whole value; a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class Adapters:
    """peft LoRA adapters injected into `model` (see the module docstring); `module` is the adapted model."""

    def __init__(
        self,
        model: nn.Module,
        settings: LoraSettings,
        base_path: str,
        base_dtype: torch.dtype | None = None,
    ) -> None:
        """`base_dtype`: the frozen base's dtype (default: the compute dtype of the model's device)."""
        from peft import LoraConfig, PeftModel, get_peft_model

        self.settings = settings
        self.base_path = base_path
        self._pointer: dict[str, Any] | None = None
        with warnings.catch_warnings():
            # peft asks transformers whether gradient checkpointing is on under a deprecated name.
            warnings.simplefilter("ignore", FutureWarning)
            if settings.adapter_path is not None:
                problems = adapter_folder_problems(settings.adapter_path, settings.key)
                if problems:
                    raise ValueError(problems[0])
                path = str(Path(settings.adapter_path).expanduser())
                self.peft = PeftModel.from_pretrained(model, path, is_trainable=True)
            else:
                config = LoraConfig(
                    r=settings.rank,
                    lora_alpha=settings.alpha,
                    target_modules=_peft_names(settings.target_modules),
                    exclude_modules=_peft_names(settings.exclude_modules),
                    lora_dropout=0.0,
                    bias="none",
                )
                try:
                    self.peft = get_peft_model(model, config)
                except ValueError as exc:  # peft's own message, without the key that set the modules
                    raise ValueError(
                        f"{settings.key}.target_modules={settings.target_modules!r}: {exc}"
                    ) from exc
        self.module: nn.Module = self.peft.get_base_model()
        device = next(self.module.parameters()).device
        freeze_base(self.module, base_dtype or compute_dtype(device))
        self.layers = adapted_layers(self.module)
        if not self.layers:
            raise ValueError(
                f"{settings.key}.target_modules={settings.target_modules!r} matches no Linear layer of "
                f"{type(model).__name__}"
            )

    def base_pointer(self) -> dict[str, Any]:
        """`base_checksum` of the base folder, computed once (about 1 s per GB)."""
        if self._pointer is None:
            self._pointer = base_checksum(self.base_path)
        return self._pointer

    def disabled(self) -> contextlib.AbstractContextManager[None]:
        """The adapters switched off inside: the frozen base model's forwards."""
        return self.peft.disable_adapter()

    def parameters(self) -> Iterator[nn.Parameter]:
        """The trained parameters (the adapters; the rest is frozen)."""
        return (p for p in self.module.parameters() if p.requires_grad)

    def merged_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, W + scale·B·A) of every adapted module, computed one at a time; a parameter
        peft adapts in place (its `ParamWrapper`: a fused expert stack, a router's weight) under its own
        name, W + `param_lora_delta`.

        An adapted embedding (peft's `lora_embedding_A/B`) is refused: sending its base weight would leave
        the engine sampling from the untrained embedding while the actor trains it
        (fulcrum.config.validate_signal refuses the usual spelling before the run)."""
        from peft.tuners.lora.layer import ParamWrapper

        with torch.no_grad():
            for name, layer in self.layers:
                if any(
                    adapter in getattr(layer, "lora_embedding_A", {}) for adapter in layer.active_adapters
                ):
                    raise ValueError(
                        f"{self.settings.key}.target_modules={self.settings.target_modules!r}: {name} is an "
                        "embedding; its adapter cannot be merged into the rollout engine's weights"
                    )
                adapters = [adapter for adapter in layer.active_adapters if adapter in layer.lora_A]
                if isinstance(layer, ParamWrapper):
                    # Summed in float32 (the base may be bf16): the engine rounds W + delta once.
                    weight = _whole(layer.get_param()).float()
                    for adapter in adapters:
                        weight = weight + param_lora_delta(
                            _whole(layer.lora_A[adapter].weight).float(),
                            _whole(layer.lora_B[adapter].weight).float(),
                            layer.scaling[adapter],
                            layer.num_experts,
                            experts_out_first=layer._did_swap_in_out_features,
                        ).reshape(weight.shape)
                    yield f"{_plain_path(name)}.{layer.parameter_name}", weight
                    continue
                base = layer.get_base_layer()
                # Summed in float32 (the base may be bf16): the engine rounds W + scale·B·A once.
                weight = _whole(base.weight).float()
                delta = torch.zeros_like(weight)
                for adapter in adapters:
                    a = _whole(layer.lora_A[adapter].weight).float()
                    b = _whole(layer.lora_B[adapter].weight).float()
                    delta += (b @ a) * layer.scaling[adapter]
                if getattr(layer, "fan_in_fan_out", False):
                    delta = delta.T
                yield f"{_plain_path(name)}.weight", weight + delta

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The adapters' tensors under PEFT's names (as in `adapter_model.safetensors`), copies on the
        CPU: a later step does not change them (a snapshot can be written while training goes on)."""
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.peft)
        return {k: _whole(v).detach().to("cpu", copy=True) for k, v in state.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], where: str) -> None:
        """Put adapters saved by `state_dict` back in place; an error naming `where` when they do not fit."""
        from peft import set_peft_model_state_dict

        own = self.state_dict()
        if set(own) != set(state):
            extra, missing = sorted(set(state) - set(own)), sorted(set(own) - set(state))
            raise ValueError(
                f"{where}: adapters do not match this model (extra {extra[:3]}, missing {missing[:3]})"
            )
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(
                    f"{where}: {name} has shape {tuple(tensor.shape)}, the model {tuple(own[name].shape)}"
                )
        result = set_peft_model_state_dict(self.peft, state)
        unexpected = getattr(result, "unexpected_keys", None)
        if unexpected:
            raise ValueError(f"{where}: adapters {unexpected[:3]} were not loaded")

    def save(self, folder: Path, state: dict[str, torch.Tensor] | None = None) -> None:
        """`folder` as a PEFT adapter folder (adapter_config.json, adapter_model.safetensors)."""
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        config = self.peft.peft_config["default"]
        config.save_pretrained(str(folder))
        tensors = {k: v.contiguous() for k, v in (state if state is not None else self.state_dict()).items()}
        save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})


@torch.no_grad()
def freeze_base(module: nn.Module, dtype: torch.dtype) -> None:
    """Frozen floating-point parameters cast to `dtype` in place (their only copy: no float32 master,
    the reference pass and the engine read them too); trained ones (adapters, a value head) kept as
    float32 masters. Buffers (rotary tables) are left as they are."""
    for p in module.parameters():
        if not p.is_floating_point():
            continue
        target = torch.float32 if p.requires_grad else dtype
        if p.dtype != target:
            p.data = p.data.to(target)  # the Parameter object stays: tied weights stay tied


def param_lora_delta(
    a: torch.Tensor, b: torch.Tensor, scaling: float, num_experts: int, experts_out_first: bool
) -> torch.Tensor:
    """peft's LoRA delta of one adapted parameter (`ParamWrapper.get_delta_weight`): `a` (r·E, in), `b`
    (out, r·E) hold E experts' rank-r factors, expert e's A_e = a.reshape(E, r, in)[e] and
    B_e = b.reshape(out, r, E)[:, :, e]; delta_e = scaling · B_e @ A_e, stacked (E, out, in) when the
    parameter is stored experts x out x in (`experts_out_first`), else (E, in, out). One expert (a 2-D
    parameter, a router's weight) is the plain scaling · b @ a, (out, in)."""
    if num_experts == 1:
        return (b @ a) * scaling
    a_e = a.reshape(num_experts, -1, a.shape[-1])  # (E, r, in)
    b_e = b.reshape(b.shape[0], -1, num_experts)  # (out, r, E)
    layout = "e o i" if experts_out_first else "e i o"
    return torch.einsum(f"o r e, e r i -> {layout}", b_e, a_e) * scaling


def _plain_path(path: str) -> str:
    """A module's path in the plain model: peft's `base_layer` steps removed (nested wrappers, when peft
    adapts two parameters of one module, add one each)."""
    return ".".join(part for part in path.split(".") if part != "base_layer")


def _peft_names(value: str | tuple[str, ...] | None) -> str | list[str] | None:
    """peft's spelling: a string (a regex, or peft's "all-linear") or a list of module names."""
    return list(value) if isinstance(value, tuple) else value


def adapted_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(module path, peft LoRA layer) of every adapted layer of `module`."""
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in module.named_modules() if isinstance(m, LoraLayer)]


def hf_name(name: str) -> str | None:
    """A parameter's name in the plain model (peft's `.base_layer.` removed); None for adapter tensors."""
    if ".lora_" in name:
        return None
    return name.replace(".base_layer.", ".")


def names_outside_base(model: nn.Module, base: nn.Module) -> list[str]:
    """Names of `model`'s parameters that are not `base`'s (the adapted model, `Adapters.module`): what a
    LoRA role trains besides its adapters (the critic's value head, `score`).

    Decided by where a parameter lives, not by its `requires_grad`: peft freezes every base parameter
    but the LoRA tensors, so the rest of the trained state is whatever the role built around the base,
    and a gathered or snapshot copy of a parameter has no flags to read."""
    owned = {id(p) for p in base.parameters()}
    return [name for name, p in model.named_parameters() if id(p) not in owned]


def base_view(module: nn.Module) -> nn.Module:
    """A plain model of `module`'s class whose tensors are `module`'s base tensors (shared, not copied).

    Built on the meta device and given the adapted model's tensors under their Hugging Face names, so
    it costs no memory; its weights are the base model's (adapters not applied). Never train it or
    copy into it: the tensors are the adapted model's own.
    """
    config = module.config
    with torch.device("meta"):
        plain = type(module)(config)
    state = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        plain_name = hf_name(name)
        if plain_name is not None:
            state[plain_name] = tensor
    plain.load_state_dict(state, strict=True, assign=True)
    for name, buffer in module.named_buffers():  # the non-persistent ones (rotary tables) are not in state
        owner, _, leaf = (hf_name(name) or name).rpartition(".")
        target = plain.get_submodule(owner) if owner else plain
        target.register_buffer(leaf, buffer, persistent=leaf not in target._non_persistent_buffers_set)
    plain.generation_config = getattr(module, "generation_config", None)
    plain.requires_grad_(False)
    return plain.eval()


def base_checksum(path: str) -> dict[str, Any]:
    """The base model folder's pointer: its path and each weight/config file's size and SHA-256."""
    folder = Path(path).expanduser()
    files: dict[str, dict[str, Any]] = {}
    for pattern in BASE_FILES:
        for file in sorted(folder.glob(pattern)):
            digest = hashlib.sha256()
            with file.open("rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 24), b""):
                    digest.update(chunk)
            files[file.name] = {"bytes": file.stat().st_size, "sha256": digest.hexdigest()}
    return {"path": str(folder.resolve()), "files": files}


def read_base_pointer(folder: Path) -> dict[str, Any]:
    return json.loads((folder / BASE_POINTER).read_text())


def base_pointer_problems(pointer: dict[str, Any], where: str) -> list[str]:
    """What differs between the base model the pointer names and the folder at its path now."""
    path = pointer.get("path")
    if not path or not Path(path).is_dir():
        return [f"{where}: the base model {path} is not there (the adapters need it)"]
    now = base_checksum(path)["files"]
    problems = []
    for name, entry in pointer.get("files", {}).items():
        if name not in now:
            problems.append(f"{where}: the base model's {name} is missing from {path}")
        elif now[name]["sha256"] != entry["sha256"]:
            problems.append(
                f"{where}: the base model's {name} in {path} changed since the adapters were trained"
            )
    return problems
