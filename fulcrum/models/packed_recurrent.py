"""Linear-attention (recurrent) layers over a packed stream: each sequence starts from a zero state.

A Gated DeltaNet layer (Qwen3.5's `linear_attn`) carries a recurrent state and a causal conv window
along its input; over a packed stream of S sequences laid end to end, its own forward would carry both
across sequence boundaries. `enable_packed_recurrence` gives each such module an instance `forward`
for packed calls (ones carrying `fulcrum_cu_seqlens`):

`packed_gated_deltanet`: the module's own projections, norm and output over the stream; its conv and
delta rule
- on CUDA with flash-linear-attention installed, where fla takes their gradients (`fulcrum.models.
  gated_delta.fla_trains`), as fla's varlen kernels, which start every sequence from zeros (fla's
  backward for both);
- elsewhere, as their torch references over the sequences laid side by side in an (S, L) grid,
  right-padded to the longest: every row starts from a zero state and zero conv history, and the padding
  lies after each row's tokens, where a causal layer never reads it. (Not the module's own forward:
  transformers sends its delta rule to fla's kernels wherever fla imports, CPU tensors included.)

Other calls (padded batches) go to the module's forward unchanged (`padded_training_refusal` says where
that forward cannot train); the state dict is unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fulcrum.models.gated_delta import (
    conv_varlen,
    decay,
    delta_rule_varlen,
    fla_refusal,
    fla_trains,
    split_qkv,
    torch_delta_rules,
)
from fulcrum.models.load import switch_off_hub_kernels


def is_recurrent_mixer(module: nn.Module) -> bool:
    """Whether `module` is a linear-attention token mixer with a recurrent state (Gated DeltaNet)."""
    return type(module).__name__.endswith("GatedDeltaNet")


def padded_training_refusal(model: nn.Module, device: torch.device) -> str | None:
    """Why `model` cannot take gradients on padded micro-batches on `device`, or None: the padded path runs
    the model's own forward, in which transformers sends the delta rule to fla wherever fla imports, and
    where fla refuses that rule's backward (`fla_refusal`) the update would stop there; the packed path
    runs the torch reference instead."""
    if not any(is_recurrent_mixer(module) for module in model.modules()):
        return None
    return fla_refusal(device)


def enable_packed_recurrence(model: nn.Module) -> int:
    """Route packed calls of every recurrent mixer of `model` through `packed_recurrent_forward`;
    returns how many mixers it found (idempotent). transformers' Hub kernels go off first
    (`switch_off_hub_kernels`): they would reset these forwards at the model's next `train()`."""
    switch_off_hub_kernels(model)
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
    """`forward(module, hidden_states, **kwargs)` (the module's own); for a packed call ((1, N, H) with
    `fulcrum_cu_seqlens`), `packed_gated_deltanet` over its sequences, each from zero states (1, N, H)."""
    cu_seqlens = kwargs.get("fulcrum_cu_seqlens")
    if cu_seqlens is None:
        return forward(module, hidden_states, **kwargs)
    if kwargs.get("fulcrum_sp") is not None:
        raise ValueError(
            "ulysses_sequence_parallel_size > 1 splits each sequence over ranks, and a linear-attention "
            "layer's recurrent state runs along the whole sequence: set it to 1 for this model"
        )
    assert isinstance(cu_seqlens, torch.Tensor)
    return packed_gated_deltanet(module, hidden_states[0], cu_seqlens)[None]  # (1, N, H)


def mixer_inputs(module: nn.Module, stream: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A Gated DeltaNet module's projections of the stream (N, H): the conv's input [q | k | v] (N, C),
    the gate z (N, Hv, Dv), b and a (N, Hv). Qwen3-Next fuses them per key-head group (`in_proj_qkvz`,
    `in_proj_ba`), which its own `fix_query_key_value_ordering` takes apart."""
    rows = stream.shape[0]
    if hasattr(module, "in_proj_qkvz"):
        q, k, v, z, b, a = module.fix_query_key_value_ordering(
            module.in_proj_qkvz(stream)[None], module.in_proj_ba(stream)[None]
        )
        mixed = torch.cat([t.reshape(rows, -1) for t in (q, k, v)], dim=-1)
        return mixed, z[0], b[0], a[0]
    z = module.in_proj_z(stream).view(rows, -1, module.head_v_dim)
    return module.in_proj_qkv(stream), z, module.in_proj_b(stream), module.in_proj_a(stream)


@torch.compiler.disable  # fla's Triton launches and autotuning stay outside a compiled region
def packed_gated_deltanet(module: nn.Module, stream: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """A Gated DeltaNet module over the packed stream (N, H) of sequences `cu_seqlens` (S + 1,), each from
    a zero state and zero conv history: its forward with the conv and the delta rule as fla's varlen
    kernels on CUDA where fla trains (`fla_trains`), else their torch references over the sequences' grid
    (transformers' Qwen3.5 forward, argument for argument). Returns (N, H)."""
    if module.activation not in ("silu", "swish"):
        raise ValueError(f"linear attention: the causal conv runs SiLU, not hidden_act={module.activation!r}")
    rows = stream.shape[0]
    mixed, z, b, a = mixer_inputs(module, stream)
    heads = (module.num_k_heads, module.head_k_dim, module.num_v_heads, module.head_v_dim)
    weight, g, beta = module.conv1d.weight.squeeze(1), decay(a, module.A_log, module.dt_bias), b.sigmoid()
    if fla_trains(stream.device):
        conv, _ = conv_varlen(mixed, weight, cu_seqlens)
        q, k, v = split_qkv(conv, *heads)
        core, _ = delta_rule_varlen(q, k, v, g, beta, cu_seqlens)
    else:
        core = torch_mixer_over_grid(mixed, weight, g, beta, cu_seqlens, heads)
    normed = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(normed.reshape(rows, -1))


def torch_mixer_over_grid(
    mixed: torch.Tensor,
    weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    heads: tuple[int, int, int, int],
) -> torch.Tensor:
    """The torch reference of fla's varlen conv and delta rule from zero states: the stream's mixer input
    (N, C), log-decay g and β (N, Hv) laid out in the (S, L) grid of its sequences, the causal conv and
    transformers' chunked delta rule over the grid, the outputs (N, Hv, Dv) gathered back. `heads` is
    (Hk, Dk, Hv, Dv)."""
    flat, count, longest = stream_grid_index(cu_seqlens, mixed.device)

    def grid(t: torch.Tensor) -> torch.Tensor:  # (N, ...) -> (S, L, ...), zeros after each sequence
        laid = t.new_zeros(count * longest, *t.shape[1:]).index_copy(0, flat, t)
        return laid.view(count, longest, *t.shape[1:])

    taps = weight.shape[-1]  # transformers' torch conv, op for op: zero-padded on both sides, the tail cut
    conv = F.conv1d(grid(mixed).transpose(1, 2), weight[:, None], padding=taps - 1, groups=weight.shape[0])
    conv = F.silu(conv[..., :longest]).transpose(1, 2)  # (S, L, C)
    q, k, v = (t.view(count, longest, *t.shape[1:]) for t in split_qkv(conv.flatten(0, 1), *heads))
    chunked, _ = torch_delta_rules()
    out, _ = chunked(q, k, v, g=grid(g), beta=grid(beta), use_qk_l2norm_in_kernel=True)  # (S, L, Hv, Dv)
    return out.flatten(0, 1).index_select(0, flat)
