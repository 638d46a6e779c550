"""Sequence parallelism's share of a packed stream: which tokens and which response predictors one rank of
an Ulysses group takes (`shard_stream`), apart from the packing itself (`fulcrum.models.packed`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fulcrum.models.packed import PackedMicroBatch, fields_on


@dataclass
class StreamShard:
    """One rank's slice of a packed stream under sequence parallelism (`shard_stream`): n = N' / sp
    consecutive tokens of the stream padded to N' (a multiple of sp), and the M_r response predictors
    that fall in it."""

    input_ids: torch.Tensor  # (n,) long
    position_ids: torch.Tensor  # (n,) long
    cu_seqlens: torch.Tensor  # (S + 1,) or (S + 2,) int32: the whole padded stream's sequences
    max_seqlen: int
    predictor: torch.Tensor  # (M_r,) long: index in this rank's slice
    labels: torch.Tensor  # (M_r,) long
    counts: list[int]  # M_r of every rank of the group, in rank order (Σ = M)

    def to(self, device: torch.device) -> StreamShard:
        return StreamShard(**fields_on(self, device))


def shard_stream(packed: PackedMicroBatch, sp_size: int, sp_rank: int) -> StreamShard:
    """Rank `sp_rank`'s share of `packed` for a group of `sp_size` (index work, on the host).

    The stream is padded to a multiple of `sp_size` with pad tokens (id 0) that form a sequence of their
    own at the end, so no real token attends to them (`real_tokens` tells them apart); rank r takes
    tokens r·n … (r+1)·n - 1. The predictors are in stream order, so each rank's are a contiguous run
    of the M, and gathering the ranks' results in rank order gives the M in order.
    """
    n_real = packed.input_ids.numel()
    n = tokens_per_rank(n_real, sp_size)
    pad = n * sp_size - n_real
    ids = torch.cat([packed.input_ids, packed.input_ids.new_zeros(pad)])  # (N',)
    positions = torch.cat([packed.position_ids, torch.arange(pad, dtype=packed.position_ids.dtype)])
    cu = packed.cu_seqlens
    if pad:
        cu = torch.cat([cu, cu.new_tensor([n * sp_size])])
    owner = torch.div(packed.predictor, n, rounding_mode="floor")  # (M,)
    mine = owner == sp_rank
    start = sp_rank * n
    return StreamShard(
        input_ids=ids[start : start + n],
        position_ids=positions[start : start + n],
        cu_seqlens=cu,
        max_seqlen=max(packed.max_seqlen, pad),
        predictor=packed.predictor[mine] - start,
        labels=packed.labels[mine],
        counts=torch.bincount(owner, minlength=sp_size).tolist(),
    )


def tokens_per_rank(n_real: int, sp_size: int) -> int:
    """n: the tokens of each rank's slice of a stream of `n_real` real tokens padded to a multiple of
    `sp_size`."""
    return -(-n_real // sp_size)


def real_tokens(n_real: int, sp_size: int, sp_rank: int) -> torch.Tensor:
    """(n,) bool: which tokens of rank `sp_rank`'s slice (`shard_stream`) of a stream of `n_real` real
    tokens are real; the positions of the padded stream at `n_real` or beyond are its pad tokens."""
    n = tokens_per_rank(n_real, sp_size)
    return torch.arange(sp_rank * n, (sp_rank + 1) * n) < n_real
