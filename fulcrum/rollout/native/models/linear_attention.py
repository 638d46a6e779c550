"""Gated DeltaNet (Qwen3.5's linear attention) in the native engine: each sequence's recurrent state.

A linear-attention layer keeps no KV cache. Each sequence has, per such layer, a slot in
`RecurrentStates`: the delta-rule state S (Hv, Dk, Dv), float32, and the conv window, the last K - 1
inputs of the causal depthwise conv (C channels). Slot 0 is scratch (padded decode rows write there).
A prefill chunk starts from zeros at a sequence's first token, else from its slot (chunked prefill, a
next turn), and leaves the state after its last token in the slot; a decode step advances every row's
slot by one token, until the row's turn ends (`turn_ended`): a window runs on past a row's stop, and
from then on the row's steps write the scratch slot, so a held turn's slot stays as its last token
left it and its next turn prefills only the new tokens. The delta rule itself is transformers'
(`torch_chunk_gated_delta_rule` for a chunk, `torch_recurrent_gated_delta_rule` for one step), which
run flash-linear-attention's kernels where that package is installed and supports the device, and
their torch reference otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class RecurrentStates:
    """conv: (L_lin, slots, C, K - 1) in the engine dtype; delta: (L_lin, slots, Hv, Dk, Dv) float32."""

    conv: torch.Tensor
    delta: torch.Tensor

    @classmethod
    def empty(
        cls, layers: int, slots: int, channels: int, kernel: int, heads: int, key_dim: int, value_dim: int,
        dtype: torch.dtype, device: torch.device,
    ) -> RecurrentStates:  # fmt: skip
        conv = torch.zeros(layers, slots, channels, kernel - 1, dtype=dtype, device=device)
        return cls(conv, torch.zeros(layers, slots, heads, key_dim, value_dim, device=device))

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Slot src -> slot dst for each (src, dst) (a prompt's state to its forks)."""
        if pairs:
            src = torch.tensor([p[0] for p in pairs], device=self.conv.device)
            dst = torch.tensor([p[1] for p in pairs], device=self.conv.device)
            self.conv[:, dst] = self.conv[:, src]
            self.delta[:, dst] = self.delta[:, src]


def causal_conv(
    window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv with SiLU over x (B, T, C) after `window` (B, C, K - 1), the inputs before it:
    y_t = silu(Σ_j w[:, j] · u_{t + j}), u = [window | x] along time, w (C, K); and the new window, the
    last K - 1 of u. Returns (y (B, T, C), window (B, C, K - 1))."""
    u = torch.cat([window.to(x.dtype), x.transpose(1, 2)], dim=-1)  # (B, C, K - 1 + T)
    y = F.conv1d(u.to(weight.dtype), weight[:, None, :], groups=weight.shape[0])  # (B, C, T)
    return F.silu(y).to(x.dtype).transpose(1, 2), u[..., u.shape[-1] - window.shape[-1] :]


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w · x / rms(x) · silu(z) per head: x, z (N, Hv, Dv) -> (N, Hv, Dv) in x's dtype (the normed x is
    rounded to x's dtype before the weight, the gate taken in float32, as Hugging Face's RMSNormGated)."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(z.float())).to(x.dtype)


def turn_ended(tokens: torch.Tensor, stop_ids: torch.Tensor, left: torch.Tensor, step: int) -> torch.Tensor:
    """Decode rows whose turn ends with the token sampled at `step` (0-based) of a window: the token is
    one of the row's stop ids, or it is the row's last, its `left`-th of the window (step + 1 = left).

    tokens (B,) int64; stop_ids (B, S) int64, -1 where a row has fewer than S; left (B,) -> (B,) bool."""
    return (tokens[:, None] == stop_ids).any(dim=1) | (left == step + 1)


@dataclass
class LinearAttentionShape:
    """One rank's Gated DeltaNet sizes: Hk key heads of Dk, Hv value heads of Dv, conv of K taps."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    kernel: int

    @property
    def channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


Target = tuple[torch.Tensor, tuple[int, int, int]]  # (engine view, (dim, start, length) of the HF tensor)


def fused_projection_targets(
    layer: dict[str, torch.Tensor], shape: LinearAttentionShape
) -> dict[str, list[Target]]:
    """Qwen3-Next's fused projections into the engine's separate ones, as (engine rows, the HF rows that
    fill them). `lin_qkvz` holds, per key head g, rows [q (Dk) | k (Dk) | v (r·Dv) | z (r·Dv)]
    (r = Hv / Hk), which go to row g·Dk of q and of k in `lin_qkv` ([q | k | v], heads in order) and to
    row g·r·Dv of its v and of `lin_z`; `lin_ba` holds [b (r) | a (r)] per key head, to row g·r of
    `lin_b` and `lin_a`."""
    s = shape
    key, ratio = s.key_heads * s.key_dim, s.value_heads // s.key_heads
    dk, dv = s.key_dim, ratio * s.value_dim  # one group's q (or k) rows, and its v (or z) rows
    qkv, z, b, a = layer["lin_qkv"], layer["lin_z"], layer["lin_b"], layer["lin_a"]
    qkvz: list[Target] = []
    ba: list[Target] = []
    for g in range(s.key_heads):
        base = g * (2 * dk + 2 * dv)
        qkvz += [
            (qkv[g * dk : (g + 1) * dk], (0, base, dk)),
            (qkv[key + g * dk : key + (g + 1) * dk], (0, base + dk, dk)),
            (qkv[2 * key + g * dv : 2 * key + (g + 1) * dv], (0, base + 2 * dk, dv)),
            (z[g * dv : (g + 1) * dv], (0, base + 2 * dk + dv, dv)),
        ]
        rows = slice(g * ratio, (g + 1) * ratio)
        ba += [(b[rows], (0, 2 * g * ratio, ratio)), (a[rows], (0, (2 * g + 1) * ratio, ratio))]
    return {"lin_qkvz": qkvz, "lin_ba": ba}


def linear_attention(
    layer: dict[str, torch.Tensor],
    x: torch.Tensor,
    shape: LinearAttentionShape,
    conv_state: torch.Tensor,
    delta_state: torch.Tensor,
    slots: torch.Tensor,
    q_lens: list[int] | None,
    fresh: list[bool] | None,
    eps: float,
    writes: torch.Tensor | None = None,
) -> torch.Tensor:
    """One Gated DeltaNet layer over the normed input x (N, hidden) -> (N, hidden), stepping the states.

    Decode (`q_lens` None): row b is one token of the sequence in slot `slots[b]`, whose stepped state
    goes to slot `writes[b]` (default `slots`; scratch 0 leaves a finished row's slot as it was).
    Prefill: sequence i has `q_lens[i]` consecutive tokens and slot `slots[i]`, and starts from zeros
    where `fresh[i]`.
    `conv_state` (slots, C, K - 1) and `delta_state` (slots, Hv, Dk, Dv) are this layer's, written in place.
    g = -exp(A_log) · softplus(a + dt_bias) and β = sigmoid(b) per token and value head.
    """
    # transformers releases before Qwen3.5 lack the module; only a hybrid model needs it
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    s = shape
    key = s.key_heads * s.key_dim
    mixed = F.linear(x, layer["lin_qkv"])  # (N, C)
    z = F.linear(x, layer["lin_z"]).view(-1, s.value_heads, s.value_dim)
    beta = F.linear(x, layer["lin_b"]).sigmoid()  # (N, Hv)
    g = -layer["lin_a_log"].float().exp() * F.softplus(
        F.linear(x, layer["lin_a"]).float() + layer["lin_dt_bias"]
    )
    weight = layer["lin_conv"].view(s.channels, s.kernel)
    if q_lens is None:  # decode: B rows of one token
        rows = x.shape[0]
        conv, window = causal_conv(conv_state.index_select(0, slots), mixed[:, None], weight)
        writes = slots if writes is None else writes
        conv_state.index_copy_(0, writes, window.to(conv_state.dtype))
        q, k, v = conv[:, 0].split([key, key, s.value_heads * s.value_dim], dim=-1)
        out, state = torch_recurrent_gated_delta_rule(
            q.reshape(rows, 1, s.key_heads, s.key_dim),
            k.reshape(rows, 1, s.key_heads, s.key_dim),
            v.reshape(rows, 1, s.value_heads, s.value_dim),
            g=g[:, None],
            beta=beta[:, None],
            initial_state=delta_state.index_select(0, slots),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        delta_state.index_copy_(0, writes, state.float())
        core = out[:, 0]  # (B, Hv, Dv)
    else:
        outs, start = [], 0
        for i, length in enumerate(q_lens):
            slot = slots[i : i + 1]
            span = slice(start, start + length)
            start += length
            window = torch.zeros_like(conv_state[:1]) if fresh[i] else conv_state.index_select(0, slot)
            conv, window = causal_conv(window, mixed[None, span], weight)
            conv_state.index_copy_(0, slot, window.to(conv_state.dtype))
            q, k, v = conv[0].split([key, key, s.value_heads * s.value_dim], dim=-1)
            initial = None if fresh[i] else delta_state.index_select(0, slot)
            out, state = torch_chunk_gated_delta_rule(
                q.reshape(1, length, s.key_heads, s.key_dim),
                k.reshape(1, length, s.key_heads, s.key_dim),
                v.reshape(1, length, s.value_heads, s.value_dim),
                g=g[None, span],
                beta=beta[None, span],
                initial_state=initial,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
            delta_state.index_copy_(0, slot, state.float())
            outs.append(out[0])
        core = torch.cat(outs)  # (N, Hv, Dv)
    normed = gated_rms_norm(core.to(x.dtype), z, layer["lin_norm"], eps)
    return F.linear(normed.reshape(x.shape[0], -1), layer["lin_out"])
