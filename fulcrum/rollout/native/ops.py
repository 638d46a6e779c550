"""The engine's element-wise and attention building blocks in plain torch (the CPU path and the reference).

Each has a Triton twin in `kernels.py` that the CUDA path uses; tests hold the two together.
Shapes: N tokens, H heads (Hq query, Hkv key/value), D head dim, B sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), computed in fp32 and rounded once, as HF's Qwen2/Llama RMSNorm.

    x: (N, hidden) -> (N, hidden) in x's dtype.
    """
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual sum is kept in the model dtype, as HF does."""
    total = x + residual
    return rms_norm(total, weight, eps), total


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int, scaling: float) -> torch.Tensor:
    """(max_positions, D) fp32 table: [cos | sin] of position * inv_freq, times the RoPE attention scaling.

    inv_freq: (D/2,) — taken from the Hugging Face model's rotary embedding, so every RoPE variant it
    implements without a position-dependent rule (default, linear, llama3, yarn) comes along.
    """
    positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = positions[:, None] * inv_freq.float()[None, :]  # (P, D/2)
    return torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x * cos + rotate_half(x) * sin, per token position. x: (N, H, D) -> (N, H, D)."""
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
) -> torch.Tensor:
    """Causal attention of packed sequences, one SDPA call each; queries are the last tokens of the keys.

    q: (sum q_lens, Hq, D); k, v: (sum k_lens, Hkv, D) -> (sum q_lens, Hq, D). Query i of a sequence
    sits at key position k_len - q_len + i and sees keys 0..that position (bottom-right causal).
    """
    out = torch.empty_like(q)
    q_start = k_start = 0
    for q_len, k_len in zip(q_lens, k_lens, strict=True):
        qs = q[q_start : q_start + q_len].transpose(0, 1)  # (Hq, q_len, D)
        ks = k[k_start : k_start + k_len].transpose(0, 1)
        vs = v[k_start : k_start + k_len].transpose(0, 1)
        row = torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)
        mask = torch.arange(k_len, device=q.device)[None, :] <= row  # (q_len, k_len)
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
) -> torch.Tensor:
    """One query token per sequence over its paged context: gather the blocks, then masked SDPA.

    q: (B, Hq, D); k_cache, v_cache: (slots, Hkv, D); block_tables: (B, max_blocks);
    context_lens: (B,) tokens to attend to (the current one included) -> (B, Hq, D).
    """
    batch = q.shape[0]
    positions = torch.arange(max_context, device=q.device)
    slots = block_tables[:, positions // block_size].long() * block_size + positions % block_size  # (B, C)
    keys = k_cache[slots].transpose(1, 2)  # (B, Hkv, C, D)
    values = v_cache[slots].transpose(1, 2)
    mask = (positions[None, :] < context_lens[:, None])[:, None, None, :]  # (B, 1, 1, C)
    out = F.scaled_dot_product_attention(
        q.view(batch, -1, 1, q.shape[-1]), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.view(batch, -1, q.shape[-1])
