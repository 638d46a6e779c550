"""Tensor parallelism for the rollout engine: which heads and MLP columns a rank holds, and its group.

Megatron's split of a decoder layer over `size` ranks, one all-reduce after each half:

    attention: q/k/v projections column-parallel (rank r holds heads [r·Hq/size, (r+1)·Hq/size) and
               the K/V heads they read), attention on local heads, o projection row-parallel → all-reduce
    MLP:       gate/up column-parallel (intermediate columns [r·I/size, (r+1)·I/size)), down row-parallel
               → all-reduce

The KV cache holds only the local K/V heads. With fewer K/V heads than ranks (GQA, e.g. 2 K/V heads
over 4 ranks), each K/V head is replicated on the size/Hkv ranks whose query heads read it, as vLLM
does. Ranks r·size .. r·size + size-1 form engine group r (`tensor_parallel_group`); the engine groups
are data-parallel to each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class HeadShard:
    """Rank's slice of the heads: query heads [q_start, q_stop), K/V heads [kv_start, kv_stop)."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int


def shard_heads(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadShard:
    """The query and K/V heads rank `rank` of `size` holds (see the module docstring).

    Hq % size == 0 is required; K/V heads are split when Hkv % size == 0, else replicated when
    size % Hkv == 0 (rank r reads K/V head ⌊r·Hkv/size⌋); other shapes cannot be split.
    """
    if num_heads % size:
        raise ValueError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={size} does not divide the model's "
            f"{num_heads} attention heads"
        )
    q_per_rank = num_heads // size
    if num_kv_heads % size == 0:
        kv_per_rank = num_kv_heads // size
        return HeadShard(
            rank * q_per_rank, (rank + 1) * q_per_rank, rank * kv_per_rank, (rank + 1) * kv_per_rank
        )
    if size % num_kv_heads == 0:
        kv = rank * num_kv_heads // size
        return HeadShard(rank * q_per_rank, (rank + 1) * q_per_rank, kv, kv + 1)
    raise ValueError(
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={size} neither divides nor is a multiple of "
        f"the model's {num_kv_heads} key/value heads"
    )


def shard_range(total: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """[start, stop) of an evenly split dimension (e.g. the MLP's intermediate columns)."""
    if total % size:
        raise ValueError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={size} does not divide the model's {what} "
            f"({total})"
        )
    step = total // size
    return rank * step, (rank + 1) * step


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its engine group; `size == 1` is no tensor parallelism."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed group of the engine's ranks

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum the row-parallel partial outputs of the group, in place (identity without TP)."""
        if self.size > 1:
            dist.all_reduce(partial, group=self.group)
        return partial

    def agree_min(self, value: int, device: torch.device) -> int:
        """The smallest `value` over the group: the ranks of one engine must size their KV caches alike
        (free memory differs per GPU), or their schedulers would diverge."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def agree_any(self, flag: bool, device: torch.device) -> bool:
        """Whether `flag` holds on any rank of the group: decisions that run collectives (recapturing the
        CUDA graphs, whose warm-up all-reduces) must be taken by every rank together."""
        if self.size == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def shared_seed(self, seed: int | None) -> int | None:
        """`seed`, or one drawn by the group's first rank: every rank of an engine samples alike."""
        if self.size == 1 or seed is not None:
            return seed
        box = [int(torch.randint(0, 2**31 - 1, (1,)).item())]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]


def tensor_parallel_group(size: int) -> TensorParallel:
    """Split the world into engine groups of `size` consecutive ranks; this rank's group.

    Every rank must call this (each group is created by all ranks, in the same order). `size == 1`,
    or a single process, creates nothing.
    """
    if size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return TensorParallel()
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={size} does not divide the world size {world}"
        )
    mine: Any = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    return TensorParallel(rank % size, size, mine)
