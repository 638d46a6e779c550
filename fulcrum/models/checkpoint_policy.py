"""What the compiled layers' selective checkpointing keeps for the backward, and the `context_fn` that
hands the policy to `torch.utils.checkpoint`.

The policy saves the attention kernels' outputs and, optionally, the outputs of the expanding matmuls (the
MLP's gate and up projections); everything else in a layer is recomputed in the backward. The two switches
are `fulcrum.models.packed.SAVE_ATTENTION_OUTPUTS` and `SAVE_MLP_PROJECTIONS`, read where the layer is
called; `CHECKPOINT_CONTEXTS` holds a context function for each setting of the pair.

Each context function carries a `cache_hash`, the key under which AOTAutograd caches a selectively
checkpointed graph on disk: without one it bypasses its cache, and every new process (a run's first step
after an earlier run, each `fulcrum tune` trial, a resume) traces and partitions the checkpointed update's
joint graph again. The hash is this module's source and the setting, so an edit of the policy never
reuses a graph partitioned under the old one; the torch and Python versions are in the cache's key
already. The functions are a partial of module-level functions and booleans: the cache key pickles them,
and dynamo keeps a partial's `cache_hash`.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

ATTENTION_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in (
        "_flash_attention_forward",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(torch.ops.aten, name)
)

MATMUL_OPS = frozenset((torch.ops.aten.mm.default, torch.ops.aten.addmm.default))


def selective_checkpoint_policy(
    save_attention: bool, save_mlp: bool, ctx: object, op: object, *args: object, **kwargs: object
) -> CheckpointPolicy:
    """Selective-checkpointing policy: save what the attention kernels return (`save_attention`) and, with
    `save_mlp`, what the expanding projections return; recompute the rest."""
    if op in ATTENTION_OPS and save_attention:
        return CheckpointPolicy.MUST_SAVE
    if op in MATMUL_OPS and save_mlp and expanding_matmul(op, args):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def expanding_matmul(op: object, args: tuple[object, ...]) -> bool:
    """mm(a, b) or addmm(bias, a, b) whose output is wider than its input: b (K, N) with N > K."""
    weight = args[2] if op is torch.ops.aten.addmm.default else args[1]
    shape = getattr(weight, "shape", None)
    return shape is not None and len(shape) == 2 and shape[1] > shape[0]


def selective_checkpoint_contexts(save_attention: bool, save_mlp: bool) -> tuple[object, object]:
    """The checkpoint's `context_fn` for one setting of the two switches: the policy's contexts."""
    policy = functools.partial(selective_checkpoint_policy, save_attention, save_mlp)
    return create_selective_checkpoint_contexts(policy)


SOURCE_HASH = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def _bound_contexts(save_attention: bool, save_mlp: bool) -> Callable[[], tuple[object, object]]:
    bound = functools.partial(selective_checkpoint_contexts, save_attention, save_mlp)
    setting = f"attention{int(save_attention)}-mlp{int(save_mlp)}"
    bound.cache_hash = f"fulcrum-sac-{SOURCE_HASH}-{setting}"  # type: ignore[attr-defined]
    return bound


# (save_attention, save_mlp) -> the checkpoint's context function for that setting.
CHECKPOINT_CONTEXTS = {(a, m): _bound_contexts(a, m) for a in (False, True) for m in (False, True)}
