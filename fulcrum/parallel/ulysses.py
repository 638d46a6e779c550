"""Ulysses sequence parallelism: one micro-batch's packed token stream split over the `sp` ranks of a
sequence-parallel group, by tokens.

Everything outside attention is per token, so each rank runs it on its own slice of the stream. Attention
needs every token of a sequence: before it an all-to-all over heads gives each rank all tokens for
Hq / sp of the heads (`gather_seq_scatter_heads`), after it the reverse all-to-all gives each rank its
tokens back with every head (`gather_heads_scatter_seq`), as verl's `verl/utils/ulysses.py` does.
Per-token outputs (log-probs, values) are gathered at the end (`gather_rows`), so every rank of the group
holds the micro-batch's whole result and computes the same loss; per-token sums that a loss is formed from
(the router's load-balancing statistics) are added up over the group (`sum_over_group`) to the same end.

The world is dp × sp: ranks g·sp … g·sp + sp - 1 form sequence-parallel group g and share one
micro-batch; the data splits over the dp = world / sp groups (group g takes share g). Gradients then add up
over all ranks as without SP: within a group, each rank's backward carries its own tokens' part of the
group's loss gradient (`gather_rows` passes back only the rank's slice, the all-to-alls pass it on
exactly), so the group's sum is that loss's gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel group: `size` ranks, this one at `rank` in it."""

    group: ProcessGroup | None
    size: int
    rank: int


_GROUPS: dict[int, SequenceParallel] = {}


def sequence_parallel_group(sp_size: int, key: str) -> SequenceParallel | None:
    """This rank's group of `sp_size` consecutive ranks (made once per size; every rank must call this,
    since making a group is itself collective); None for `sp_size` 1. `key` names the setting in errors."""
    if sp_size == 1:
        return None
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if sp_size < 1 or world % sp_size != 0:
        raise ValueError(
            f"{key}={sp_size} must divide the number of processes ({world}): the world is data-parallel "
            f"groups × {sp_size} ranks of sequence parallelism"
        )
    if sp_size not in _GROUPS:
        rank = dist.get_rank()
        mine = None
        for start in range(0, world, sp_size):  # every rank makes every group, in the same order
            group = dist.new_group(list(range(start, start + sp_size)))
            if start <= rank < start + sp_size:
                mine = SequenceParallel(group, sp_size, rank - start)
        assert mine is not None
        _GROUPS[sp_size] = mine
    return _GROUPS[sp_size]


def check_heads(num_attention_heads: int, sp_size: int, key: str) -> None:
    """Attention heads are split over the group: their count must divide by `sp_size`."""
    if num_attention_heads % sp_size != 0:
        raise ValueError(
            f"{key}={sp_size} must divide the model's num_attention_heads ({num_attention_heads}): "
            "Ulysses gives each rank an equal share of the heads"
        )


def kv_repeats(num_attention_heads: int, num_key_value_heads: int, sp_size: int) -> int:
    """How many times each key/value head is repeated so the group splits them evenly: the least r with
    (Hkv · r) divisible by `sp_size` and dividing Hq (1 when Hkv already divides by `sp_size`)."""
    group = num_attention_heads // num_key_value_heads  # query heads per key/value head
    for r in range(1, group + 1):
        if group % r == 0 and (num_key_value_heads * r) % sp_size == 0:
            return r
    raise ValueError(f"{num_key_value_heads} key/value heads cannot be split over {sp_size} ranks")


def all_to_all(x: torch.Tensor, sp: SequenceParallel, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """`x` cut into `sp.size` blocks along `scatter_dim`, block j sent to rank j; the blocks received,
    in rank order, concatenated along `gather_dim`. Differentiable (the backward is the reverse exchange)."""
    return _AllToAll.apply(x, sp, scatter_dim, gather_dim)


def _exchange(x: torch.Tensor, sp: SequenceParallel, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    moved = x.movedim(scatter_dim, 0).contiguous()  # block j is rows j·k … (j+1)·k - 1
    out = torch.empty_like(moved)
    dist.all_to_all_single(out, moved, group=sp.group)  # out's block j came from rank j
    return torch.cat([part.movedim(0, scatter_dim) for part in out.chunk(sp.size, 0)], dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        sp: SequenceParallel,
        scatter_dim: int,
        gather_dim: int,
    ) -> torch.Tensor:
        ctx.sp, ctx.dims = sp, (scatter_dim, gather_dim)  # type: ignore[attr-defined]
        return _exchange(x, sp, scatter_dim, gather_dim)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        scatter_dim, gather_dim = ctx.dims  # type: ignore[attr-defined]
        return _exchange(grad, ctx.sp, gather_dim, scatter_dim), None, None, None  # type: ignore[attr-defined]


def gather_seq_scatter_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """(1, H, n, D) for this rank's n tokens → (1, H / sp, sp · n, D): every token, this rank's heads."""
    return all_to_all(x, sp, scatter_dim=1, gather_dim=2)


def gather_heads_scatter_seq(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """(sp · n, H / sp, D) → (n, H, D): this rank's tokens back, every head."""
    return all_to_all(x, sp, scatter_dim=0, gather_dim=1)


def gather_rows(x: torch.Tensor, counts: list[int], sp: SequenceParallel) -> torch.Tensor:
    """Each rank's `x` ((counts[rank], ...)) concatenated in rank order: (Σ counts, ...) on every rank.

    The backward passes back only this rank's rows of the gradient, not their sum over the group: every
    rank computes the same loss from the gathered rows, so its own rows' gradient is already whole."""
    return _GatherRows.apply(x, counts, sp)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, counts: list[int], sp: SequenceParallel
    ) -> torch.Tensor:
        ctx.bounds = (sum(counts[: sp.rank]), sum(counts[: sp.rank + 1]))  # type: ignore[attr-defined]
        top = max(counts)
        padded = x.new_zeros((top, *x.shape[1:]))  # all_gather needs equal shapes
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(sp.size)]
        dist.all_gather(parts, padded, group=sp.group)
        return torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)])

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        start, stop = ctx.bounds  # type: ignore[attr-defined]
        return grad[start:stop], None, None


def sum_over_group(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """`x` summed over the ranks of the group: each rank's sum over its own tokens becomes the whole
    stream's, on every rank.

    The backward passes the gradient back unchanged, not summed over the group: every rank computes the
    same loss from the sum, so the gradient each receives is already the whole loss's, and its own
    tokens' part of it is what flows on from its own `x` (summing would count it `sp.size` times)."""
    return _SumOverGroup.apply(x, sp)


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, sp: SequenceParallel
    ) -> torch.Tensor:
        total = x.clone()
        dist.all_reduce(total, group=sp.group)
        return total

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return grad, None


def sequence_parallel_heads(
    query: torch.Tensor,  # (1, Hq, n, D): this rank's n tokens
    key: torch.Tensor,  # (1, Hkv, n, D)
    value: torch.Tensor,  # (1, Hkv, n, D)
    sp: SequenceParallel,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ulysses' first all-to-all: every token of the stream for this rank's share of the heads,
    (1, Hq / sp, N', D) and (1, Hkv' / sp, N', D). Key/value heads are repeated first when their count
    does not divide by sp (`kv_repeats`), so that query head h and its key/value head land on one rank."""
    heads, kv_heads = query.shape[1], key.shape[1]
    check_heads(heads, sp.size, "ulysses_sequence_parallel_size")
    repeats = kv_repeats(heads, kv_heads, sp.size)
    if repeats > 1:
        key, value = key.repeat_interleave(repeats, 1), value.repeat_interleave(repeats, 1)
    return tuple(gather_seq_scatter_heads(x, sp) for x in (query, key, value))  # type: ignore[return-value]
