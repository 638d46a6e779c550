"""Linear-attention (recurrent) layers over a packed stream: each sequence starts from a zero state.

A Gated DeltaNet layer (Qwen3.5's `linear_attn`) carries a recurrent state and a causal conv window
along its input; over a packed stream of S sequences laid end to end, its own forward would carry both
across sequence boundaries. `enable_packed_recurrence` gives each such module an instance `forward`
that, for a packed call (one carrying `fulcrum_cu_seqlens`), lays the sequences side by side in an
(S, L) grid, right-padded to the longest, and runs the module's own forward over that batch: every row
starts from a zero state and zero conv history, and the padding lies after each row's tokens, where a
causal layer never reads it. Hugging Face's forward picks its kernels (flash-linear-attention and
causal-conv1d where installed and on their device, its torch reference otherwise), so this module
re-implements nothing. Other calls (padded batches) go to the module's forward unchanged; the state
dict is unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn


def is_recurrent_mixer(module: nn.Module) -> bool:
    """Whether `module` is a linear-attention token mixer with a recurrent state (Gated DeltaNet)."""
    return type(module).__name__.endswith("GatedDeltaNet")


def enable_packed_recurrence(model: nn.Module) -> int:
    """Route packed calls of every recurrent mixer of `model` through `packed_recurrent_forward`;
    returns how many mixers it found (idempotent)."""
    found = 0
    for module in model.modules():
        if is_recurrent_mixer(module):
            found += 1
            if not isinstance(module.__dict__.get("forward"), functools.partial):
                module.forward = functools.partial(packed_recurrent_forward, type(module).forward, module)
    return found


def stream_grid_index(cu_seqlens: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, int, int]:
    """For a stream of N tokens in S sequences (`cu_seqlens` (S + 1,)): each token's flat index in an
    (S, L) grid, L the longest length (token t of sequence s at s·L + t - cu[s]); and S, L."""
    cu = cu_seqlens.to(device).long()
    lengths = cu.diff()  # (S,)
    count, longest = len(lengths), int(lengths.max())
    seq = torch.repeat_interleave(torch.arange(count, device=device), lengths)  # (N,)
    flat = seq * longest + torch.arange(int(cu[-1]), device=device) - cu[seq]  # (N,)
    return flat, count, longest


def packed_recurrent_forward(
    forward: Callable[..., torch.Tensor], module: nn.Module, hidden_states: torch.Tensor, **kwargs: object
) -> torch.Tensor:
    """`forward(module, hidden_states, **kwargs)`; for a packed call ((1, N, H) with
    `fulcrum_cu_seqlens`), the same over the (S, L, H) grid of its sequences, back as (1, N, H)."""
    cu_seqlens = kwargs.get("fulcrum_cu_seqlens")
    if cu_seqlens is None:
        return forward(module, hidden_states, **kwargs)
    if kwargs.get("fulcrum_sp") is not None:
        raise ValueError(
            "ulysses_sequence_parallel_size > 1 splits each sequence over ranks, and a linear-attention "
            "layer's recurrent state runs along the whole sequence: set it to 1 for this model"
        )
    assert isinstance(cu_seqlens, torch.Tensor)
    stream = hidden_states[0]  # (N, H)
    flat, count, longest = stream_grid_index(cu_seqlens, stream.device)
    grid = stream.new_zeros(count * longest, stream.shape[-1]).index_copy(0, flat, stream)
    out = forward(module, grid.view(count, longest, -1), cache=None, attention_mask=None)  # (S, L, H)
    return out.reshape(count * longest, -1).index_select(0, flat)[None]  # (1, N, H)
