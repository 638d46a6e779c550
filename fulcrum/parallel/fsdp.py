"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for the actor, critic and reference models.

Each decoder layer is one FSDP unit and the root (embeddings, final norm, head) another: parameters
are float32 shards (the master weights) on each rank, gathered a layer at a time for compute. On
CUDA, `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` computes in bf16 and reduces
gradients in fp32. verl's `fsdp_config.param_offload` keeps the shards (and the optimiser step) on the
CPU (`CPUOffloadPolicy`); `optimizer_offload` moves the optimiser state to the CPU between updates;
`reshard_after_forward=False` keeps each layer gathered from its forward to its backward.

Gradients are summed over ranks (divide factor 1): each rank's loss is its share of the global
mini-batch loss (the token and sequence counts of `loss_agg_mode` are the global mini-batch's), so
the summed gradient is the one-process gradient.

The full (unsharded) weights leave FSDP two ways: `full_named_tensors` all-gathers one tensor at a
time on every rank (the rollout engine's in-memory weight sync), `full_state_dict` gathers every
tensor to rank 0's CPU (checkpoints, export); `load_full_state_dict` broadcasts rank 0's back.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

T = TypeVar("T")
ROOT_METHOD = "fulcrum_run"  # registered as an FSDP forward method on every sharded root (run_in_root)


@dataclass(frozen=True)
class FSDPSettings:
    """verl's `fsdp_config` keys that act here."""

    param_offload: bool = False
    optimizer_offload: bool = False
    # False keeps each unit's gathered parameters from its forward to its backward: no second
    # all-gather (nor a third for gradient checkpointing's recomputation), at the cost of the whole
    # model's bf16 parameters resident on every rank during a micro-batch.
    reshard_after_forward: bool = True


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a Hugging Face decoder (`model.model.layers` and alike): one FSDP unit each."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks"):
            return list(module)
    raise ValueError(f"{type(model).__name__}: no decoder layer list (layers / h / blocks) to shard")


def mixed_precision_for(device: torch.device) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 gradient reduction on CUDA; float32 throughout on the CPU (exact tests)."""
    if device.type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_model(
    model: nn.Module,
    device: torch.device,
    settings: FSDPSettings = FSDPSettings(),
    keep_fp32: tuple[str, ...] = (),
) -> nn.Module:
    """Apply FSDP2 in place (layers, then the root) over the default process group; returns `model`.

    `keep_fp32` names submodules that compute in float32 (the critic's value head, `score`): each is
    a unit of its own without the bf16 cast."""
    # On the CPU the shards are there already (and CPUOffloadPolicy wants an accelerator).
    offload = CPUOffloadPolicy() if settings.param_offload and device.type == "cuda" else OffloadPolicy()
    kwargs: dict[str, Any] = {
        "mp_policy": mixed_precision_for(device),
        "offload_policy": offload,
        "reshard_after_forward": settings.reshard_after_forward,
    }
    for name in keep_fp32:
        fully_shard(model.get_submodule(name), mp_policy=MixedPrecisionPolicy(), offload_policy=offload)
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    setattr(model, ROOT_METHOD, types.MethodType(_as_forward, model))
    register_fsdp_forward_method(model, ROOT_METHOD)
    for unit in model.modules():  # each unit reduces its own gradients
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)  # summed: each rank's loss is its share of the global loss
            unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    return model


def run_in_root(model: nn.Module, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` as if it were the model's forward: under FSDP the root unit's parameters
    (embeddings, final norm, LM head) are gathered around it and their gradients reduced
    after backward, so code that reaches them directly (the packed forward's `embed_tokens` call, the
    chunked LM head over `lm_head.weight`) works on a sharded model. A plain call otherwise."""
    method = getattr(model, ROOT_METHOD, None)
    return method(fn, *args, **kwargs) if method is not None else fn(*args, **kwargs)


def _as_forward(self: nn.Module, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def full_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, whole tensor) for every state-dict entry, all-gathered one at a time on every rank.

    Every rank must consume the whole iterator in the same order (each item is a collective).
    """
    for name, tensor in model.state_dict().items():
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def whole_norm(norm: torch.Tensor) -> torch.Tensor:
    """`clip_grad_norm_`'s result as a plain tensor on its device (a DTensor over sharded gradients made
    whole); no wait for the device."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


_FULL_TO_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model state on rank 0's CPU (an empty dict on the other ranks); every rank calls it.

    Each tensor owns its storage (a gathered tensor may be a view into a larger buffer, which
    safetensors refuses to write)."""
    state = get_model_state_dict(model, options=_FULL_TO_RANK0)
    return {name: _own_storage(tensor) for name, tensor in state.items()}


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return tensor if whole and tensor.is_contiguous() else tensor.clone()


def load_full_state_dict(
    model: nn.Module, state: dict[str, torch.Tensor], from_rank0: bool = True, strict: bool = True
) -> None:
    """A whole `state` into every rank's shards: rank 0's, broadcast (`from_rank0`; the other ranks pass
    an empty dict), or each rank's own (every rank read the same file); `strict=False` for a part of
    the model (a LoRA critic's value head). The loaders take ownership of `state`: torch puts its
    tensors into the model and optimiser as they are."""
    set_model_state_dict(  # it replaces the dict's values with shards: hand it a copy
        model,
        state,
        options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=from_rank0 and several_processes(), strict=strict
        ),
    )


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimiser state keyed by parameter name, whole, on rank 0's CPU (empty elsewhere).

    Keyed by name, not by position, so that it loads into any world size. Entries that are not
    sharded (Adam's step count) are the live tensors: write the dict out before the next step."""
    return get_optimizer_state_dict(model, optimizer, options=_FULL_TO_RANK0)


def load_full_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], from_rank0: bool = True
) -> None:
    set_optimizer_state_dict(
        model,
        optimizer,
        state,
        options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=from_rank0 and several_processes()
        ),
    )


def several_processes() -> bool:
    """Whether this process is one of several of an initialised process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move the optimiser's state tensors (Adam's moments, shards under FSDP) to `device` in place:
    to the CPU after an update under `optimizer_offload`, back before the next step."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)
    if device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()


def name_keyed_optimizer_state(state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """`torch.optim.Optimizer.state_dict()` (parameters numbered in the optimiser's order: the model's
    trainable parameters) keyed by parameter name instead, as FSDP's whole optimiser state is; a
    state already keyed by name is returned as it is."""
    groups = state.get("param_groups", [])
    if not groups or not groups[0].get("params") or isinstance(groups[0]["params"][0], str):
        return state
    names = [name for name, param in model.named_parameters() if param.requires_grad]
    return {
        "state": {names[int(i)]: value for i, value in state.get("state", {}).items()},
        "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in groups],
    }
