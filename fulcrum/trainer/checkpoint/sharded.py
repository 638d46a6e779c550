"""Checkpoints across world sizes: FSDP-sharded roles are gathered on every rank and written by rank 0
with the one-process writer; any optimiser state loads into any world size.

`gather_roles(roles)` (called on every rank: it all-gathers) returns, for each role whose model is
sharded, a stand-in whose `model.state_dict()` and `optimizer.state_dict()` are the whole CPU state on
rank 0 (the optimiser's keyed by parameter name, so it loads into any world size); of a LoRA role only
the adapters and the tensors trained beside them are gathered, never the frozen base. Rank 0 hands the
stand-ins to `CheckpointManager.save`, which writes the usual Hugging Face folder and `optimizer.pt`:
the checkpoint is the one a single process writes, atomic and verified as always, and `fulcrum
export` reads it unchanged. Loading goes the other way in `hf_folder.load_model_weights` and
`manager` (whole tensors into shards), on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fulcrum.parallel.fsdp import (
    full_optimizer_state_dict,
    full_state_dict,
    is_sharded,
    load_full_optimizer_state_dict,
    name_keyed_optimizer_state,
)
from fulcrum.trainer.checkpoint.adapters import trained_outside_adapters
from fulcrum.trainer.checkpoint.layout import CheckpointError


class GatheredModel:
    """A sharded model seen through its gathered state: `state_dict()` and `named_parameters()` give the
    whole tensors gathered (every one of a fully trained model; none of a LoRA role's, whose checkpoint
    reads `GatheredRole.adapter_state` and `trained_weights`); everything else (`config`,
    `save_pretrained`, `score`) is the model's own."""

    def __init__(self, module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        self._module = module
        self._state = state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, _ in self._module.named_parameters():
            if name in self._state:
                yield name, self._state[name]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class GatheredOptimizer:
    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state


class GatheredRole:
    """What `CheckpointManager.save` reads of a role: model, optimiser, schedule, tokenizer.

    A LoRA role gathers only what its checkpoint holds (`adapters.py`): the adapters, the trained
    tensors outside them (the critic's value head) and their optimiser state; its frozen base, most
    of the model, never leaves the shards (`model.state_dict()` is empty)."""

    def __init__(self, role: Any) -> None:
        model = role.model
        optimizer = getattr(role, "optimizer", None)
        # LoRA: the adapters' whole tensors (every rank gathers them; rank 0 writes them).
        self.adapters = getattr(role, "adapters", None)
        self.adapter_state = self.adapters.state_dict() if self.adapters is not None else None
        self.trained_weights = (
            trained_outside_adapters(model, self.adapters) if self.adapters is not None else None
        )
        self.model = GatheredModel(model, full_state_dict(model) if self.adapters is None else {})
        self.optimizer = (
            GatheredOptimizer(full_optimizer_state_dict(model, optimizer)) if optimizer is not None else None
        )
        self.lr_scheduler = getattr(role, "lr_scheduler", None)
        # What the gather may have returned as it is (snapshot.copy_rule copies only those).
        self.live_model = model
        self.live_optimizer = optimizer
        self.tokenizer = getattr(role, "tokenizer", None)


def gather_roles(roles: dict[str, Any]) -> dict[str, Any]:
    """Each sharded role replaced by its gathered stand-in (whole on rank 0); the others as they are.
    Every rank must call it, in the same order of roles."""
    return {name: GatheredRole(role) if is_sharded(role.model) else role for name, role in roles.items()}


def keyed_by_name(optimizer_state: Any) -> bool:
    """Whether an optimiser state dict names its parameters (N ranks wrote it) or numbers them (one)."""
    groups = optimizer_state.get("param_groups", []) if isinstance(optimizer_state, dict) else []
    return bool(groups and groups[0].get("params") and isinstance(groups[0]["params"][0], str))


def load_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], path: Path
) -> None:
    """The optimiser state read from `path`, numbered or named, into `optimizer` of `model` (sharded or
    not; every rank read the same file); an error naming the file when it does not fit."""
    try:
        if is_sharded(model) or keyed_by_name(state):
            named = name_keyed_optimizer_state(state, model)
            load_full_optimizer_state_dict(model, optimizer, named, from_rank0=False)
        else:
            optimizer.load_state_dict(state)
    except (ValueError, KeyError, RuntimeError, IndexError) as exc:
        raise CheckpointError(f"{path}: does not match this {type(optimizer).__name__}: {exc}") from exc
