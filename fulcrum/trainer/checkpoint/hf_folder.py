"""A model as a Hugging Face folder (config.json + safetensors + tokenizer), and its weights back in place.

The actor is a `PreTrainedModel` and uses its own `save_pretrained`. The critic
(`fulcrum.models.value_head.CriticModel`) names its parts as `XxxForTokenClassification` does
(`model.*`, `score.weight`, `score.bias`), so it is written in that layout with `num_labels=1` and
`AutoModelForTokenClassification` loads it. A backbone whose model type transformers gives no token
classifier (OLMo 3, Gemma 3's text model, Qwen3.5's text model alone) is written in the same layout with
its own config (`architectures` = the backbone's class, `num_labels=1`, `fulcrum_value_head = "score"`):
fulcrum's resume reads it back in place, and `AutoModel` loads its backbone.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fulcrum.parallel.fsdp import full_named_tensors, is_sharded, load_full_state_dict
from fulcrum.trainer.checkpoint.layout import CheckpointError


def check_weights_finite(model: torch.nn.Module, where: str) -> None:
    """Refuse to write a checkpoint whose weights hold NaN/Inf: it would poison every resume."""
    check_tensors_finite(model.named_parameters(), where)


def check_tensors_finite(named: Iterable[tuple[str, torch.Tensor]], where: str) -> None:
    """`check_weights_finite` over (name, tensor) pairs (sharded ones gathered)."""
    for name, param in named:
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
        if not bool(torch.isfinite(tensor.detach()).all()):
            raise CheckpointError(
                f"{where}: parameter {name!r} holds NaN/Inf; not saving a corrupt checkpoint"
            )


def token_classification_config(config: Any) -> Any:
    """A copy of a backbone's config that `AutoModelForTokenClassification` loads as backbone + 1-output head.
    Where transformers has no token classifier of `config.model_type`, the copy names the backbone's
    class (the one `AutoModel` builds) as its architecture and `score` as its value head
    (`fulcrum_value_head`)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
        MODEL_MAPPING_NAMES,
    )

    arch = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES.get(config.model_type)
    backbone = MODEL_MAPPING_NAMES.get(config.model_type)
    if arch is None and backbone is None:
        raise CheckpointError(
            f"model_type {config.model_type!r} has neither a token-classification nor a base model class "
            "in transformers: the critic cannot be written as a Hugging Face folder"
        )
    out = copy.deepcopy(config)
    out.architectures = [arch or backbone]
    out.num_labels = 1
    if arch is None:
        out.fulcrum_value_head = "score"  # the Linear(hidden, 1) beside the backbone's `model.*` weights
    return out


def save_model_folder(model: torch.nn.Module, tokenizer: Any, out_dir: Path) -> None:
    """Write `model` (and `tokenizer`) as a Hugging Face folder: config.json + *.safetensors + tokenizer."""
    state = dict(full_named_tensors(model))  # DTensor shards gathered into whole tensors
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(str(out_dir), state_dict=state)
    elif hasattr(model, "folder_config") and hasattr(model, "score"):
        # a critic (fulcrum.models.value_head): its folder's config and names (a text critic of a
        # multimodal folder: the multimodal model's), the gathered tensors
        token_classification_config(model.folder_config()).save_pretrained(str(out_dir))
        named = {model.folder_name(name): tensor.contiguous() for name, tensor in state.items()}
        save_file(named, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    else:
        raise CheckpointError(
            f"{type(model).__name__} is neither a Hugging Face PreTrainedModel nor a critic "
            "(fulcrum.models.value_head.CriticModel): cannot write it as a Hugging Face folder"
        )
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))


def load_safetensors_folder(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face folder's safetensors files (one file or shards)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weights file")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file), device="cpu"))
    return state


def _storage_ptr(tensor: torch.Tensor) -> int:
    """Where a tensor's data lives (a sharded tensor's local shard): tied weights share it."""
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).data_ptr()


def load_model_weights(model: torch.nn.Module, folder: Path) -> None:
    """Copy the folder's weights into `model` in place. Tied weights (saved once) are allowed to be absent.
    A model sharded by FSDP takes its shards of the whole tensors (every rank calls this)."""
    state = load_safetensors_folder(folder)
    if hasattr(model, "own_name"):  # a critic's folder may name its backbone as a multimodal model does
        state = {model.own_name(name): tensor for name, tensor in state.items()}
    own = model.state_dict()  # a sharded model's entries are DTensors: their shapes are the whole ones
    unexpected = sorted(set(state) - set(own))
    if unexpected:
        raise CheckpointError(f"{folder}: weights {unexpected[:5]} do not exist in {type(model).__name__}")
    loaded_ptrs = {_storage_ptr(own[k]) for k in state}
    missing = [k for k in own if k not in state and _storage_ptr(own[k]) not in loaded_ptrs]
    if missing:
        raise CheckpointError(f"{folder}: weights {missing[:5]} of {type(model).__name__} are missing")
    for key, value in state.items():
        if own[key].shape != value.shape:
            raise CheckpointError(
                f"{folder}: {key} has shape {tuple(value.shape)}, model has {tuple(own[key].shape)}"
            )
    if is_sharded(model):
        load_full_state_dict(model, state, from_rank0=False)
    else:
        model.load_state_dict(state, strict=False)
