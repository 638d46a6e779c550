"""Attention over the paged KV cache: rotate and store the step's K/V (`rotate_and_store`), then prefill
(packed, causal) or decode (paged).

The CUDA path uses aten's flash kernel in its varlen form for prefill (the training passes' call,
`fulcrum.models.packed_attention.varlen_causal_attention`), or cuDNN's for a step of fresh prompts with
`prefill_attention="cudnn"`, or FlashAttention-4's for every prefill step with `prefill_attention="fa4"`,
and the Triton paged kernel for decode; the CPU path (and any dtype FlashAttention does not take) uses SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from fulcrum.models.packed_attention import (
    cudnn_causal_attention,
    has_cudnn_attention,
    has_flash_varlen,
    varlen_causal_attention,
)
from fulcrum.rollout.native import ops


class QKNorm(NamedTuple):
    """Per-head RMSNorm of q and k for the rotation (`rotate_and_store`) to apply before it rotates: each (D,) weight,
    the norm's eps and its weight offset (1 for (1 + w) norms)."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    offset: float


@dataclass
class AttentionMetadata:
    """What every layer's attention needs for one forward (N tokens, S sequences)."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # (N,) int64: cache slot each new token's K/V goes to
    block_size: int
    # prefill
    cu_seqlens_q: torch.Tensor | None = None  # (S+1,) int32
    cu_seqlens_k: torch.Tensor | None = None  # (S+1,) int32
    q_lens: list[int] | None = None
    k_lens: list[int] | None = None
    context_slots: torch.Tensor | None = None  # (sum k_lens,) slots of the whole context, when any is cached
    prefill_kernel: str = "flash"  # EngineConfig.prefill_attention
    # decode
    block_tables: torch.Tensor | None = None  # (B, max_blocks) int32
    context_lens: torch.Tensor | None = None  # (B,) int32, the current token included
    # The rows longest context first (decode_grid.decode_order), once a step for every layer's decode
    # kernel, under engine_kwargs.native.decode_order=longest_first; None: the batch's order.
    decode_order: torch.Tensor | None = None
    max_context: int = 0  # the CPU gather path's width
    use_triton: bool = False
    # CUDA decode: the cache seen through its device-held address (kernels.IndirectCache), so that
    # captured graphs outlive a sleep / wake-up cycle. None: index the cache tensor directly.
    indirect_cache: Any = None
    # Hybrid models: each sequence's (prefill) or row's (decode) recurrent-state slot, and for prefill
    # whether each sequence starts at its first token (its state starts from zeros).
    state_slots: torch.Tensor | None = None  # (S,) or (B,) int64
    state_fresh: list[bool] | None = None
    # Decode: where each row's stepped state goes: its slot, or the scratch slot 0 once its turn has
    # ended in the window (the state stays as its last token left it, for a held turn's next one).
    state_writes: torch.Tensor | None = None  # (B,) int64


def rotate_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_cache: torch.Tensor | None,
    layer: int,
    meta: AttentionMetadata,
    use_triton: bool,
    qk_norm: QKNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (N, Hq, D) and k (N, Hkv, D) rotated (RoPE at `positions`), and the rotated k and v written at
    their slots (`meta.slot_mapping`) of layer `layer` of the cache, before `paged_attention` reads it.
    With Triton one kernel does both (`kernels.rope_and_store_kv`, into the cache tensor or the
    IndirectCache), and the heads' norm first when given one (`QKNorm`); else the torch twins and
    two `index_copy_`."""
    if use_triton:
        from fulcrum.rollout.native import kernels

        cache = meta.indirect_cache if meta.indirect_cache is not None else kv_cache
        kernels.rope_and_store_kv(q, k, v, positions, cos_sin, meta.slot_mapping, cache, layer, qk_norm)
        return q, k
    assert qk_norm is None, "the heads' norm fused into the rotation is the Triton path's"
    q, k = ops.apply_rope(q, positions, cos_sin), ops.apply_rope(k, positions, cos_sin)
    kv_cache[layer, 0].index_copy_(0, meta.slot_mapping, k)
    kv_cache[layer, 1].index_copy_(0, meta.slot_mapping, v)
    return q, k


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor | None,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q: (N, Hq, D), k, v: (N, Hkv, D) of the new tokens, already in the cache (`rotate_and_store`);
    kv_cache (layers, 2, slots, Hkv, D) -> (N, Hq, D).

    `window`: a sliding-window layer's width (a token sees the window latest positions, itself
    included); None for full causal attention. The cache keeps every position either way.
    """
    if meta.indirect_cache is not None:
        from fulcrum.rollout.native import kernels

        return kernels.paged_decode_attention_indirect(
            q,
            meta.indirect_cache,
            layer,
            meta.block_tables,
            meta.context_lens,
            meta.block_size,
            scale,
            window,
            order=meta.decode_order,
        )
    k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]
    if not meta.is_prefill:
        if meta.use_triton:
            from fulcrum.rollout.native.kernels import paged_decode_attention

            return paged_decode_attention(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.context_lens,
                meta.block_size,
                scale,
                window=window,
                order=meta.decode_order,
            )
        return ops.decode_attention_gather(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            meta.max_context,
            meta.block_size,
            scale,
            window,
        )
    fresh = meta.context_slots is None  # every sequence's queries are all of its keys
    if meta.prefill_kernel == "cudnn" and fresh and window is None and has_cudnn_attention(q):
        return cudnn_causal_attention(q, k, v, meta.q_lens, scale, native_gqa=True, strided_rows=True)
    if not fresh:  # part of the context is already cached: read it all back
        k = k_cache.index_select(0, meta.context_slots)
        v = v_cache.index_select(0, meta.context_slots)
    if has_flash_varlen(q):  # a step's new tokens are the last of each sequence's keys
        return varlen_causal_attention(
            q,
            k,
            v,
            meta.cu_seqlens_q,
            max(meta.q_lens),
            scale,
            window,
            cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_k=max(meta.k_lens),
            strided_rows=True,
            # fa4: the engine checked where it started that FlashAttention-4 runs here (`fa4_unavailable_reason`)
            kernel="fa4" if meta.prefill_kernel == "fa4" else "flash",
        )
    return ops.prefill_attention_sdpa(q, k, v, meta.q_lens, meta.k_lens, scale, window)
