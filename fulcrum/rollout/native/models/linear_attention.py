"""Gated DeltaNet (Qwen3.5's linear attention) in the native engine: each sequence's recurrent state.

A linear-attention layer keeps no KV cache. Each sequence has, per such layer, a slot in
`RecurrentStates`: the delta-rule state S (Hv, Dk, Dv), float32, and the conv window, the last K - 1
inputs of the causal depthwise conv (C channels). Slot 0 is scratch (padded decode rows write there).
A prefill chunk starts from zeros at a sequence's first token, else from its slot (chunked prefill, a
next turn), and leaves the state after its last token in the slot; a decode step advances every row's
slot by one token, until the row's turn ends (`turn_ended`): a window runs on past a row's stop, and
from then on the row's steps write the scratch slot, so a held turn's slot stays as its last token
left it and its next turn prefills only the new tokens.

Two paths compute the same thing (`StateStep.fla` picks one per forward, by device): on CUDA with
flash-linear-attention installed, its Triton kernels (`fulcrum.models.gated_delta`): every sequence of a
prefill in one varlen call of the conv and of the chunked delta rule, each starting from its slot, and a
decode step that reads and writes the slots in place; elsewhere the torch reference, transformers'
`torch_chunk_gated_delta_rule` (a prefill chunk, one sequence at a time) and
`torch_recurrent_gated_delta_rule` (one step), the tests' yardstick for the kernels.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fulcrum.batch import host_to_device
from fulcrum.models.gated_delta import (
    conv_step,
    conv_varlen,
    decay,
    delta_rule_step,
    delta_rule_varlen,
    split_qkv,
    torch_delta_rules,
)


@dataclass
class RecurrentStates:
    """conv: (L_lin, slots, C, K - 1) in the engine dtype; delta: (L_lin, slots, Hv, Dk, Dv) float32."""

    conv: torch.Tensor
    delta: torch.Tensor

    @staticmethod
    def shapes(
        layers: int, slots: int, shape: LinearAttentionShape
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The (conv, delta) tensors' shapes for `slots` slots of `layers` layers."""
        conv = (layers, slots, shape.channels, shape.kernel - 1)
        return conv, (layers, slots, shape.value_heads, shape.key_dim, shape.value_dim)

    @classmethod
    def nbytes(cls, layers: int, slots: int, shape: LinearAttentionShape, dtype: torch.dtype) -> int:
        """What `empty` allocates: the conv windows in `dtype`, the delta-rule states in float32."""
        conv, delta = cls.shapes(layers, slots, shape)
        return math.prod(conv) * dtype.itemsize + math.prod(delta) * 4

    @classmethod
    def empty(
        cls, layers: int, slots: int, shape: LinearAttentionShape, dtype: torch.dtype, device: torch.device
    ) -> RecurrentStates:
        conv, delta = cls.shapes(layers, slots, shape)
        return cls(torch.zeros(conv, dtype=dtype, device=device), torch.zeros(delta, device=device))

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


@dataclass
class StateStep:
    """What one forward's linear-attention layers share: which slots it reads and writes.

    Prefill: sequence i has `q_lens[i]` consecutive tokens and slot `slots[i]`, and starts from zeros
    where `fresh[i]`. Decode (`q_lens` None): row b is one token of the sequence in slot `slots[b]`,
    whose stepped state goes to slot `writes[b]` (scratch 0 leaves a finished row's slot as it was).
    With `fla`, the kernels' inputs are built once here, the same tensors for every layer (fla caches
    its chunk indices by the `cu_seqlens` object): the stream's offsets on the device and the host,
    and which sequences start fresh (S,) bool on the device."""

    slots: torch.Tensor
    writes: torch.Tensor | None = None
    q_lens: list[int] | None = None
    fresh: list[bool] | None = None
    fla: bool = False
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_cpu: torch.Tensor | None = None
    fresh_rows: torch.Tensor | None = None

    @classmethod
    def prefill(
        cls, slots: torch.Tensor, q_lens: list[int], fresh: list[bool], cu_seqlens: torch.Tensor, fla: bool
    ) -> StateStep:
        """`cu_seqlens` (S + 1,) int32 on the device: the offsets of the prefill's sequences."""
        step = cls(slots, q_lens=q_lens, fresh=fresh, fla=fla)
        if fla:
            step.cu_seqlens = cu_seqlens
            step.cu_seqlens_cpu = torch.tensor([0, *itertools.accumulate(q_lens)])
            step.fresh_rows = host_to_device(torch.tensor(fresh), slots.device)
        return step

    @classmethod
    def decode(cls, slots: torch.Tensor, writes: torch.Tensor | None, fla: bool) -> StateStep:
        return cls(slots, writes=slots if writes is None else writes, fla=fla)


def split_heads(conv: torch.Tensor, shape: LinearAttentionShape) -> tuple[torch.Tensor, ...]:
    """The conv's output (N, C) as q, k (N, Hk, Dk) and v (N, Hv, Dv): channels [q | k | v]."""
    return split_qkv(conv, shape.key_heads, shape.key_dim, shape.value_heads, shape.value_dim)


def linear_attention(
    layer: dict[str, torch.Tensor],
    x: torch.Tensor,
    shape: LinearAttentionShape,
    conv_state: torch.Tensor,
    delta_state: torch.Tensor,
    step: StateStep,
    eps: float,
) -> torch.Tensor:
    """One Gated DeltaNet layer over the normed input x (N, hidden) -> (N, hidden), stepping the states
    of `step`'s slots. `conv_state` (slots, C, K - 1) and `delta_state` (slots, Hv, Dk, Dv) are this
    layer's, written in place. g = -exp(A_log) · softplus(a + dt_bias) and β = sigmoid(b) per token and
    value head."""
    s = shape
    mixed = F.linear(x, layer["lin_qkv"])  # (N, C)
    z = F.linear(x, layer["lin_z"]).view(-1, s.value_heads, s.value_dim)
    beta = F.linear(x, layer["lin_b"]).sigmoid()  # (N, Hv)
    g = decay(F.linear(x, layer["lin_a"]), layer["lin_a_log"], layer["lin_dt_bias"])
    weight = layer["lin_conv"].view(s.channels, s.kernel)
    if step.fla:
        mixer = _fla_decode if step.q_lens is None else _fla_prefill
    else:
        mixer = _torch_decode if step.q_lens is None else _torch_prefill
    core = mixer(mixed, weight, g, beta, s, conv_state, delta_state, step)  # (N, Hv, Dv)
    normed = gated_rms_norm(core.to(x.dtype), z, layer["lin_norm"], eps)
    return F.linear(normed.reshape(x.shape[0], -1), layer["lin_out"])


def _fla_prefill(
    mixed: torch.Tensor,
    weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    shape: LinearAttentionShape,
    conv_state: torch.Tensor,
    delta_state: torch.Tensor,
    step: StateStep,
) -> torch.Tensor:
    """Every sequence of the prefill in one varlen conv and one varlen chunked delta rule, each from its
    slot (zeros where fresh), each's final state back to its slot."""
    slots, fresh = step.slots, step.fresh_rows
    window = conv_state.index_select(0, slots).masked_fill_(fresh[:, None, None], 0)
    conv, window = conv_varlen(mixed, weight, step.cu_seqlens, window, step.cu_seqlens_cpu)
    conv_state.index_copy_(0, slots, window.to(conv_state.dtype))
    q, k, v = split_heads(conv, shape)
    initial = delta_state.index_select(0, slots).masked_fill_(fresh[:, None, None, None], 0)
    core, final = delta_rule_varlen(q, k, v, g, beta, step.cu_seqlens, initial, True, step.cu_seqlens_cpu)
    delta_state.index_copy_(0, slots, final.to(delta_state.dtype))
    return core


def _fla_decode(
    mixed: torch.Tensor,
    weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    shape: LinearAttentionShape,
    conv_state: torch.Tensor,
    delta_state: torch.Tensor,
    step: StateStep,
) -> torch.Tensor:
    """One token a row: the conv stepped over the row's window, the delta rule in place in the slots."""
    conv, window = conv_step(mixed, conv_state.index_select(0, step.slots), weight)
    conv_state.index_copy_(0, step.writes, window.to(conv_state.dtype))
    q, k, v = split_heads(conv, shape)
    return delta_rule_step(q, k, v, g, beta, delta_state, step.slots, step.writes)


def _torch_decode(
    mixed: torch.Tensor,
    weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    shape: LinearAttentionShape,
    conv_state: torch.Tensor,
    delta_state: torch.Tensor,
    step: StateStep,
) -> torch.Tensor:
    """The torch reference of `_fla_decode`: transformers' recurrent delta rule over gathered states."""
    _, torch_recurrent_gated_delta_rule = torch_delta_rules()
    conv, window = causal_conv(conv_state.index_select(0, step.slots), mixed[:, None], weight)
    conv_state.index_copy_(0, step.writes, window.to(conv_state.dtype))
    q, k, v = split_heads(conv[:, 0], shape)
    out, state = torch_recurrent_gated_delta_rule(
        q[:, None],
        k[:, None],
        v[:, None],
        g=g[:, None],
        beta=beta[:, None],
        initial_state=delta_state.index_select(0, step.slots),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    delta_state.index_copy_(0, step.writes, state.float())
    return out[:, 0]  # (B, Hv, Dv)


def _torch_prefill(
    mixed: torch.Tensor,
    weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    shape: LinearAttentionShape,
    conv_state: torch.Tensor,
    delta_state: torch.Tensor,
    step: StateStep,
) -> torch.Tensor:
    """The torch reference of `_fla_prefill`: one sequence at a time, transformers' chunked delta rule."""
    torch_chunk_gated_delta_rule, _ = torch_delta_rules()
    outs, start = [], 0
    for i, length in enumerate(step.q_lens):
        slot = step.slots[i : i + 1]
        span = slice(start, start + length)
        start += length
        fresh = step.fresh[i]
        window = torch.zeros_like(conv_state[:1]) if fresh else conv_state.index_select(0, slot)
        conv, window = causal_conv(window, mixed[None, span], weight)
        conv_state.index_copy_(0, slot, window.to(conv_state.dtype))
        q, k, v = split_heads(conv[0], shape)
        out, state = torch_chunk_gated_delta_rule(
            q[None],
            k[None],
            v[None],
            g=g[None, span],
            beta=beta[None, span],
            initial_state=None if fresh else delta_state.index_select(0, slot),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        delta_state.index_copy_(0, slot, state.float())
        outs.append(out[0])
    return torch.cat(outs)  # (N, Hv, Dv)
