"""How a model is laid out over several ranks: sharded by FSDP2, or replicated on every rank.

Replicated (as DDP lays a model out): every rank holds the whole model and its optimiser state, runs
its micro-batches exactly as one process does (bf16 compute copies, compiled layers, no collective in
a forward or backward), and the ranks sum their gradients once per optimiser step
(`all_reduce_gradients`); every rank then takes the same step, so the replicas stay equal. Sharded
(`fulcrum.parallel.fsdp`): each rank holds 1/N of the weights, gradients and optimiser state, and every
layer of every micro-batch is gathered and its gradients reduce-scattered.

Sharding saves memory and costs collectives and host work per layer and micro-batch; for a model whose
training state is small beside the device, replication is faster and the memory is there
(`choose_layout`). The result is the same either way: each rank's loss is its share of the global
mini-batch loss, so the summed gradient is the one-process gradient.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

Layout = Literal["replicated", "sharded"]

# Bytes a trained parameter holds: fp32 weight, fp32 gradient, Adam's two fp32 moments.
TRAINING_STATE_BYTES = 16
# Replicate (with fsdp_size=-1) when a model's training state takes at most this share of the device:
# the rollout's KV cache (gpu_memory_utilization, 0.65 in verl's recipes), the other models and the
# activations need the rest.
REPLICATE_MAX_SHARE = 1 / 16


def training_state_bytes(model: torch.nn.Module) -> int:
    """Resident training state of `model`: 16 B per trained parameter (`TRAINING_STATE_BYTES`), its own
    size for a frozen one (a LoRA base held in bf16: 2 B); tied tensors once."""
    return sum(
        TRAINING_STATE_BYTES * p.numel() if p.requires_grad else p.numel() * p.element_size()
        for p in model.parameters()
    )


def choose_layout(fsdp_size: int, state_bytes: int, device_bytes: int | None, param_offload: bool) -> Layout:
    """The layout of one model over the ranks, from verl's `fsdp_config.fsdp_size`:

    - 1: replicated (verl: shard groups of one device, i.e. no sharding);
    - -1 (verl's default, "all devices"): replicated when the model's training state (`state_bytes`,
      `training_state_bytes`) ≤ `REPLICATE_MAX_SHARE` × `device_bytes` (a CUDA device's memory), else
      sharded; sharded on the CPU (`device_bytes` None);
    - any other size: sharded over every rank (verl shards over all from the world size up; below it,
      its hybrid groups have no counterpart here: `fulcrum.config.compat.fsdp_size_note` says so at start);
    - `param_offload` (FSDP's CPU offload) always shards.
    """
    if param_offload or fsdp_size not in (-1, 1):
        return "sharded"
    if fsdp_size == 1:
        return "replicated"
    if device_bytes is None:
        return "sharded"
    fits = state_bytes <= REPLICATE_MAX_SHARE * device_bytes
    return "replicated" if fits else "sharded"


@torch.no_grad()
def all_reduce_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Sum every parameter's gradient over the ranks, in as few collectives as the gradients allow.

    Gradients that are views of one buffer (`fulcrum.models.precision.ComputeWeights` keeps the masters'
    so) are reduced as that buffer, in one call; the others are flattened per dtype, reduced and copied
    back. A parameter without a gradient gets zeros first: every rank must reduce the same tensors.
    """
    grads = []
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    views: dict[int, list[torch.Tensor]] = {}
    loose: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        if g._base is not None:
            views.setdefault(id(g._base), []).append(g)
        else:
            loose.setdefault(g.dtype, []).append(g)
    for group in views.values():
        base = group[0]._base
        if sum(g.numel() for g in group) == base.numel():  # the buffer is these gradients, nothing else
            dist.all_reduce(base)
        else:
            for g in group:
                loose.setdefault(g.dtype, []).append(g)
    for group in loose.values():
        flat = _flatten_dense_tensors(group)
        dist.all_reduce(flat)
        for g, reduced in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
            g.copy_(reduced)
