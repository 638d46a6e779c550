"""The engine's element-wise and attention building blocks in plain torch (the CPU path and the reference).

Each has a Triton twin in `kernels.py` that the CUDA path uses; tests hold the two together.
Shapes: N tokens, H heads (Hq query, Hkv key/value), D head dim, B sequences.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from fulcrum.parallel.tensor_parallel import TensorParallel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """(offset + weight) * x / sqrt(mean(x^2) + eps): x (N, hidden) -> (N, hidden) in x's dtype.

    offset 0 (Llama, Qwen): the normed x is rounded to x's dtype, then scaled by the weight, as HF's
    LlamaRMSNorm; offset 1 (Gemma, whose weights are stored as w - 1): the product is taken in fp32
    and rounded once, as HF's Gemma3RMSNorm.
    """
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (normed * (offset + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def rms_norm_over_heads(
    x: torch.Tensor, weight: torch.Tensor, eps: float, tp: TensorParallel
) -> torch.Tensor:
    """OLMo's QK-norm: x (N, H, D) -> (N, H, D), normed over all H·D values of a token together,
    w · x / sqrt(mean(x²) + eps) with the product in fp32 (as Hugging Face's Olmo3RMSNorm).

    Under tensor parallelism (`tp`) the squares are summed over the ranks, each holding an equal share
    of the heads (a replicated K/V head counts once on each of its ranks, which leaves the mean as it
    is), so the mean is over the model's heads."""
    flat = x.reshape(x.shape[0], -1).float()  # (N, H·D)
    if tp.size == 1:
        mean = flat.pow(2).mean(-1, keepdim=True)
    else:
        mean = tp.all_reduce(flat.pow(2).sum(-1, keepdim=True)) / (flat.shape[-1] * tp.size)
    return (weight * (flat * torch.rsqrt(mean + eps))).to(x.dtype).view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual sum is kept in the model dtype, as HF does."""
    total = x + residual
    return rms_norm(total, weight, eps, offset), total


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int, scaling: float) -> torch.Tensor:
    """(max_positions, D) fp32 table: [cos | sin] of position * inv_freq, times the RoPE attention scaling.

    inv_freq: (D/2,) — taken from the Hugging Face model's rotary embedding, so every RoPE variant it
    implements without a position-dependent rule (default, linear, llama3, yarn) comes along.
    """
    positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = positions[:, None] * inv_freq.float()[None, :]  # (P, D/2)
    return torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x * cos + rotate_half(x) * sin, per token position. x: (N, H, D) -> (N, H, D).

    A table narrower than D (`partial_rotary_factor`, Qwen3.5) rotates the first R of each head's D
    dimensions and passes the rest through."""
    rotary = cos_sin.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rotary], positions, cos_sin), x[..., rotary:]], dim=-1)
    half = x.shape[-1] // 2
    cos_half, sin_half = cos_sin[positions].chunk(2, dim=-1)  # (N, D/2) each
    cos = torch.cat([cos_half, cos_half], dim=-1)[:, None, :].to(x.dtype)
    sin = torch.cat([sin_half, sin_half], dim=-1)[:, None, :].to(x.dtype)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up]: (N, 2I) -> (N, I)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for gate_up = [gate | up] (Gemma's `gelu_pytorch_tanh`): (N, 2I) -> (N, I)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def window_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal mask, and with `window` only the window latest keys (itself included, HF's
    `sliding_window_overlay`): key j seen by query i when j <= i and i - window < j.

    query_pos (..., Q, 1), key_pos (..., 1, K) -> bool (..., Q, K).
    """
    seen = key_pos <= query_pos
    return seen if window is None else seen & (key_pos > query_pos - window)


def block_slots(
    block_tables: torch.Tensor, seq_index: torch.Tensor, positions: torch.Tensor, block_size: int
):
    """Cache slot of each (sequence, position): block_tables[seq, pos // bs] * bs + pos % bs.

    block_tables: (S, max_blocks) int; seq_index, positions: (N,) int64 -> (N,) int64.
    """
    blocks = block_tables[seq_index, positions // block_size].long()
    return blocks * block_size + positions % block_size


def prefill_attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lens: list[int],
    k_lens: list[int],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed sequences, one SDPA call each; queries are the last tokens of the keys.

    q: (sum q_lens, Hq, D); k, v: (sum k_lens, Hkv, D) -> (sum q_lens, Hq, D). Query i of a sequence
    sits at key position k_len - q_len + i and sees keys 0..that position (bottom-right causal), the
    `window` latest of them with a window.
    """
    out = torch.empty_like(q)
    q_start = k_start = 0
    for q_len, k_len in zip(q_lens, k_lens, strict=True):
        qs = q[q_start : q_start + q_len].transpose(0, 1)  # (Hq, q_len, D)
        ks = k[k_start : k_start + k_len].transpose(0, 1)
        vs = v[k_start : k_start + k_len].transpose(0, 1)
        row = torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)
        mask = window_mask(row, torch.arange(k_len, device=q.device)[None, :], window)  # (q_len, k_len)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out[q_start : q_start + q_len] = o.transpose(0, 1)
        q_start += q_len
        k_start += k_len
    return out


def decode_attention_gather(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context: int,
    block_size: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence over its paged context: gather the blocks, then masked SDPA.

    q: (B, Hq, D); k_cache, v_cache: (slots, Hkv, D); block_tables: (B, max_blocks);
    context_lens: (B,) tokens to attend to (the current one included), the `window` latest of them
    with a window -> (B, Hq, D).
    """
    batch = q.shape[0]
    positions = torch.arange(max_context, device=q.device)
    slots = block_tables[:, positions // block_size].long() * block_size + positions % block_size  # (B, C)
    keys = k_cache[slots].transpose(1, 2)  # (B, Hkv, C, D)
    values = v_cache[slots].transpose(1, 2)
    mask = window_mask(context_lens[:, None] - 1, positions[None, :], window)[
        :, None, None, :
    ]  # (B, 1, 1, C)
    out = F.scaled_dot_product_attention(
        q.view(batch, -1, 1, q.shape[-1]), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.view(batch, -1, q.shape[-1])
