"""A LoRA role's checkpoint folder: the adapters and the other trained tensors, never the frozen base.

    actor/
        adapter_config.json, adapter_model.safetensors   a PEFT adapter folder (peft loads it as is)
        base_model.json          the base model's path and each of its files' size and SHA-256
        trained_weights.safetensors   trained tensors outside the adapters (the critic's value head)
        tokenizer files, optimizer.pt, lr_scheduler.pt

Resume puts the adapters back into a model built on the same base, and refuses a base whose files
differ from the pointer's checksums: adapters are only meaningful on the weights they were trained on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fulcrum.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_POINTER, Adapters, names_outside_base
from fulcrum.parallel.fsdp import is_sharded, load_full_state_dict
from fulcrum.trainer.checkpoint.layout import CheckpointError

TRAINED_WEIGHTS = "trained_weights.safetensors"


def is_adapter_folder(folder: Path) -> bool:
    return (folder / ADAPTER_CONFIG).is_file() and (folder / BASE_POINTER).is_file()


def trained_outside_adapters(model: torch.nn.Module, adapters: Adapters) -> dict[str, torch.Tensor]:
    """The trained parameters that are not LoRA tensors (`names_outside_base`: the critic's value
    head), whole, on the CPU. Under FSDP every rank calls it (each sharded tensor is all-gathered)."""
    params = dict(model.named_parameters())
    out = {}
    for name in names_outside_base(model, adapters.module):
        param = params[name]
        whole = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[name] = whole.detach().cpu().contiguous()
    return out


def save_adapter_folder(
    role_dir: Path,
    adapters: Adapters,
    adapter_state: dict[str, torch.Tensor] | None,
    trained: dict[str, torch.Tensor],
) -> None:
    """The adapters (`adapter_state`, or theirs now), the base pointer and the other trained tensors
    (`trained_outside_adapters`, taken with the snapshot) into `role_dir` (see the module docstring).
    The tokenizer's files are written beside them by the caller."""
    adapters.save(role_dir, adapter_state)
    (role_dir / BASE_POINTER).write_text(json.dumps(adapters.base_pointer(), indent=2) + "\n")
    if trained:
        save_file(trained, str(role_dir / TRAINED_WEIGHTS), metadata={"format": "pt"})


def load_adapter_folder(role_dir: Path, role: Any) -> None:
    """The adapters and other trained tensors of `role_dir` into `role`, after checking the base."""
    adapters: Adapters = role.adapters
    if not is_adapter_folder(role_dir):
        raise CheckpointError(
            f"{role_dir}: holds whole weights, not LoRA adapters; this run trains adapters "
            f"({adapters.settings.key}.lora_rank): resume it with lora_rank=0, or start a new run directory"
        )
    saved = json.loads((role_dir / BASE_POINTER).read_text())
    now = adapters.base_pointer()
    if saved.get("files") != now["files"]:
        raise CheckpointError(
            f"{role_dir}: the adapters were trained on the base model {saved.get('path')}, whose files differ "
            f"from this run's {now['path']}; point {adapters.settings.key}.path at the same base"
        )
    try:
        adapters.load_state_dict(load_file(str(role_dir / ADAPTER_WEIGHTS)), str(role_dir))
    except ValueError as exc:
        raise CheckpointError(str(exc)) from exc
    extra_file = role_dir / TRAINED_WEIGHTS
    extra = load_file(str(extra_file)) if extra_file.is_file() else {}
    own = names_outside_base(role.model, adapters.module)
    if set(extra) != set(own):
        raise CheckpointError(
            f"{role_dir}: trained tensors {sorted(extra)} do not match the model's {sorted(own)}"
        )
    if extra and is_sharded(role.model):  # whole tensors into this rank's shards (every rank read them)
        load_full_state_dict(role.model, extra, from_rank0=False, strict=False)
    elif extra:
        role.model.load_state_dict(extra, strict=False)
