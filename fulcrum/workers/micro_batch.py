"""Micro-batches: how a batch is split (a fixed count of rows, or packed by a token budget) and what one
micro-batch is on the device (`MicroInputs`), the only thing a step or a forward reads.

Two layouts. Padded (`use_remove_padding=False`): rows of (B, P + R) with all-padding columns trimmed.
Packed (`use_remove_padding=True`): only the real tokens, one stream per micro-batch
(`fulcrum.models.packed`); packed micro-batches are cut by tokens, not rows: a fixed size of n rows
becomes a budget of n × (P + R) tokens, the most that n padded rows could hold, so a packed micro-batch
never needs more activation memory than the padded one the user sized.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from fulcrum.batch import Batch, host_to_device
from fulcrum.models.packed import PackedMicroBatch
from fulcrum.models.stream_shard import StreamShard
from fulcrum.parallel import max_over_ranks
from fulcrum.parallel.fsdp import is_sharded


def sequence_lengths(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt tokens, response tokens) per sample, from the attention mask: two (B,) long tensors."""
    p = batch.prompt_length
    mask = batch["attention_mask"]
    return mask[:, :p].sum(-1).long(), mask[:, p:].sum(-1).long()


def token_budget_groups(
    prompt_len: list[int], response_len: list[int], max_token_len: int
) -> list[list[int]]:
    """Pack sample indices into groups whose padded cost fits the token budget.

    A group's cost is `len(group) × (max prompt + max response)`: what the padded path's trimmed
    forward really processes (every row is as wide as the group's widest), so the budget bounds
    memory honestly. (Packed micro-batches are cut by `packed_token_groups` instead.) Samples
    are taken longest first, which keeps the padding inside each group small. A sample over the budget
    takes a group alone: the configuration refuses a budget below one full-length sequence
    (`fulcrum.config.validate_sizes`).
    """
    order = sorted(range(len(prompt_len)), key=lambda i: prompt_len[i] + response_len[i], reverse=True)
    groups: list[list[int]] = []
    current: list[int] = []
    max_p = max_r = 0
    for i in order:
        p, r = max(max_p, prompt_len[i]), max(max_r, response_len[i])
        if current and (len(current) + 1) * (p + r) > max_token_len:
            groups.append(current)
            current, p, r = [], prompt_len[i], response_len[i]
        current.append(i)
        max_p, max_r = p, r
    if current:
        groups.append(current)
    return groups


def packed_token_groups(lengths: list[int], max_token_len: int) -> list[list[int]]:
    """Sample indices in groups of at most `max_token_len` real tokens (first-fit decreasing).

    Longest first, each into the first group with room: few groups (close to Σ lengths / budget),
    hence few micro-batches. A sample over the budget takes a group alone (see `token_budget_groups`).
    """
    groups: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for g, free in enumerate(room):
            if lengths[i] <= free:
                groups[g].append(i)
                room[g] -= lengths[i]
                break
        else:
            groups.append([i])
            room.append(max_token_len - lengths[i])
    return groups


def packed_budget(
    batch: Batch, size: int | None, use_dynamic_bsz: bool, max_token_len: int | None, key: str
) -> int:
    """Tokens per packed micro-batch: the dynamic budget, or `size` rows of the batch's padded width."""
    if use_dynamic_bsz:
        assert max_token_len, f"{key}: use_dynamic_bsz=True needs a token budget"
        return int(max_token_len)
    assert size, f"{key}: a micro-batch size is needed"
    return int(size) * (batch.prompt_length + batch.response_length)


def make_micro_batches(
    batch: Batch,
    size: int | None,
    use_dynamic_bsz: bool,
    max_token_len: int | None,
    key: str,
    sort_by_length: bool = False,
    packed: bool = False,
    model: nn.Module | None = None,
) -> tuple[list[Batch], list[int] | None]:
    """Micro-batches and, when samples were reordered, the order they hold (to undo it).

    `sort_by_length` (for no-grad passes, where grouping cannot change the result) puts samples of
    similar length together so each trimmed micro-batch carries little padding. `packed` cuts by
    real tokens (`packed_budget`, `packed_token_groups`) for the padding-free forwards. When FSDP
    shards `model`, the micro-batches are cut further (`split_to_count`) to the largest count of any
    rank: each forward gathers the layers' shards, a collective every rank must join.

    The sizes are the configuration's, checked once there (`fulcrum.config.validate_sizes` and the keys'
    domains name `key` to the user); the asserts only catch a direct caller that passes none.
    """
    groups: list[list[int]] | None = None  # None: consecutive rows, in the batch's order
    if packed:
        budget = packed_budget(batch, size, use_dynamic_bsz, max_token_len, key)
        groups = packed_token_groups(batch["attention_mask"].sum(-1).tolist(), budget)
    elif use_dynamic_bsz:
        assert max_token_len, f"{key}: use_dynamic_bsz=True needs a token budget"
        p, r = sequence_lengths(batch)
        groups = token_budget_groups(p.tolist(), r.tolist(), int(max_token_len))
    else:
        assert size, f"{key}: a micro-batch size is needed"
        if sort_by_length and len(batch) > size:
            p, r = sequence_lengths(batch)
            ranked = sorted(range(len(batch)), key=lambda i: (int(p[i]) + int(r[i]), i), reverse=True)
            groups = [ranked[i : i + size] for i in range(0, len(batch), size)]
    micro = batch.split(int(size or 0)) if groups is None else [batch.select(g) for g in groups]
    order = None if groups is None else [i for g in groups for i in g]
    if model is not None and is_sharded(model):
        micro = split_to_count(micro, max_over_ranks(len(micro)))
    return micro, order


def split_to_count(micro: list[Batch], count: int) -> list[Batch]:
    """`micro` cut further, in order, until it holds `count` micro-batches: the one with the most rows is
    halved each time (so each still fits its size or token budget). Under FSDP every rank must run as
    many forwards as the others (each is a collective), whatever its rows' lengths."""
    micro = list(micro)
    while len(micro) < count:
        widest = max(range(len(micro)), key=lambda i: len(micro[i]))
        rows = len(micro[widest])
        if rows < 2:
            raise RuntimeError(f"cannot cut {len(micro)} micro-batches of one row into {count}")
        micro[widest : widest + 1] = [
            micro[widest].select(list(range(rows // 2))),
            micro[widest].select(list(range(rows // 2, rows))),
        ]
    return micro


def restore_order(parts: list[torch.Tensor], order: list[int] | None) -> torch.Tensor:
    """Concatenate per-micro-batch results and undo the token-budget permutation.

    The inverse permutation goes to the device as an asynchronous copy: a plain `.to(device)` would
    make the host wait for every queued micro-batch (`host_to_device`)."""
    out = torch.cat(parts)
    if order is None:
        return out
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.as_tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return out[host_to_device(inverse, out.device)]


class PaddedTokens(NamedTuple):
    """A padded micro-batch's tokens on the device, all-padding columns trimmed
    (`fulcrum.models.logprob.trim_padding`): (B, T') ids, mask and positions, the R' response columns
    kept and their (B, R') labels."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    r_kept: int
    labels: torch.Tensor


@dataclass
class MicroInputs:
    """One micro-batch on the device: everything a step or a forward reads.

    `rows`: its (B, R) columns (the response mask always); `agg`: the mini-batch's `agg_loss` counts
    (floats, or 0-d device tensors when the step is replayed as a CUDA graph); its tokens in the model's
    layout: packed (`packed`, the (B, R) layout results scatter into, and `stream`, what this rank runs:
    `packed` itself, or its sequence-parallel `StreamShard`) or `padded`."""

    rows: dict[str, torch.Tensor]
    agg: Mapping[str, float | torch.Tensor] = field(default_factory=dict)
    packed: PackedMicroBatch | None = None
    stream: PackedMicroBatch | StreamShard | None = None
    padded: PaddedTokens | None = None
