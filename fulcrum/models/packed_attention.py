"""Attention over a packed stream: the three paths behind `fulcrum.models.packed`'s attention interface.

A packed call carries the stream's `cu_seqlens` (S + 1,) and `max_seqlen`; each sequence attends
causally to its own earlier tokens only. On CUDA in half precision: aten's flash kernel in its varlen form (or
`torch.nn.attention.varlen.varlen_attn`), grouped-query heads handled by the kernel; elsewhere one causal
SDPA over the sequences laid out side by side, right-padded to the longest. A call without packing
metadata is transformers' SDPA, so a model switched to packed attention still runs padded batches.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from fulcrum.parallel.ulysses import SequenceParallel, gather_heads_scatter_seq, sequence_parallel_heads

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn

    _VARLEN_PARAMS = frozenset(inspect.signature(varlen_attn).parameters)
except ImportError:  # pragma: no cover - older torch: CUDA packing falls back to per-sequence SDPA
    varlen_attn = None
    _VARLEN_PARAMS = frozenset()
# aten's flash kernel with its own derivative (varlen when given cumulative sequence offsets).
_ATEN_FLASH = getattr(torch.ops.aten, "_flash_attention_forward", None)
# FlashAttention-4's `pack_gqa` under `kernel="fa4"`: None lets FA4 choose (under grouped-query attention it
# packs a K/V head's query heads into one tile's rows); bench/long_context.py times False beside it.
FA4_PACK_GQA: bool | None = None


def packed_attention(
    module: nn.Module,
    query: torch.Tensor,  # (1, Hq, N, D)
    key: torch.Tensor,  # (1, Hkv, N, D)
    value: torch.Tensor,  # (1, Hkv, N, D)
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature; returns ((1, N, Hq, D), None) for packed calls.

    Packed calls carry `fulcrum_cu_seqlens` and `fulcrum_max_seqlen`; any other call is SDPA's. A
    layer's `sliding_window` W (Mistral) lets a token see the W latest positions, itself included.
    """
    cu_seqlens = kwargs.pop("fulcrum_cu_seqlens", None)
    max_seqlen = kwargs.pop("fulcrum_max_seqlen", None)
    sp = kwargs.pop("fulcrum_sp", None)
    if cu_seqlens is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout:
        raise ValueError("packed attention has no attention dropout: set the model's attention_dropout to 0")
    if isinstance(sp, SequenceParallel):  # this rank's n tokens, all heads -> all tokens, its heads
        query, key, value = sequence_parallel_heads(query, key, value, sp)  # (1, H / sp, N', D)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (N, H, D)
    assert isinstance(cu_seqlens, torch.Tensor) and isinstance(max_seqlen, int)
    window = kwargs.get("sliding_window")
    window = int(window) if window is not None and max_seqlen > int(window) else None  # else no effect
    if has_flash_varlen(q):
        out = varlen_causal_attention(q, k, v, cu_seqlens, max_seqlen, scaling, window)
    else:
        out = right_padded_causal_attention(q, k, v, cu_seqlens, scaling, window)
    if isinstance(sp, SequenceParallel):
        out = gather_heads_scatter_seq(out, sp)  # (N', Hq / sp, D) -> (n, Hq, D)
    return out.unsqueeze(0), None  # (1, N, Hq, D)


def right_padded_causal_attention(
    q: torch.Tensor,  # (N, Hq, D)
    k: torch.Tensor,  # (N, Hkv, D)
    v: torch.Tensor,  # (N, Hkv, D)
    cu_seqlens: torch.Tensor,  # (S + 1,)
    scale: float | None,
    window: int | None = None,
) -> torch.Tensor:
    """Varlen causal attention as one SDPA call: (N, Hq, D), equal to one causal SDPA per sequence
    (with `window`, key j is seen by query i when i - window < j <= i).

    Token t of sequence s goes to row s, column t - cu[s] of an (S, L) grid, L the longest length;
    the rest is zeros. Each sequence starts at column 0, so under the causal mask a real query only
    sees its own sequence's earlier keys (the padding lies after it); the padding queries' outputs
    are dropped. Cost S × L² per head against Σ L_s²: on the CPU the one call beats S small ones.
    """
    n, heads, dim = q.shape
    lengths = cu_seqlens.diff().long()  # (S,)
    s, longest = len(lengths), int(lengths.max())
    seq = torch.repeat_interleave(torch.arange(s, device=q.device), lengths.to(q.device))  # (N,)
    flat = seq * longest + torch.arange(n, device=q.device) - cu_seqlens.to(q.device).long()[seq]  # (N,)

    def grid(x: torch.Tensor) -> torch.Tensor:  # (N, H, D) -> (S, H, L, D)
        out = x.new_zeros(s * longest, x.shape[1], dim).index_copy(0, flat, x)
        return out.view(s, longest, x.shape[1], dim).transpose(1, 2)

    if window is None:
        causal: dict[str, object] = {"is_causal": True}
    else:
        offset = torch.arange(longest, device=q.device)[:, None] - torch.arange(longest, device=q.device)
        causal = {"attn_mask": (offset >= 0) & (offset < window)}  # (L, L): query row, key column
    out = F.scaled_dot_product_attention(
        grid(q), grid(k), grid(v), scale=scale, enable_gqa=heads != k.shape[1], **causal
    )  # (S, Hq, L, D)
    return out.transpose(1, 2).reshape(s * longest, heads, dim).index_select(0, flat)


def has_flash_varlen(x: torch.Tensor) -> bool:
    """Whether `varlen_causal_attention` runs on `x`: a CUDA tensor of a half-precision dtype, with
    aten's flash kernel (or `varlen_attn`) in this torch."""
    return (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and (_ATEN_FLASH is not None or varlen_attn is not None)
    )


def varlen_causal_attention(
    q: torch.Tensor,  # (N, Hq, D)
    k: torch.Tensor,  # (M, Hkv, D)
    v: torch.Tensor,  # (M, Hkv, D)
    cu_seqlens: torch.Tensor,  # (S + 1,) int32
    max_seqlen: int,
    scale: float | None,
    window: int | None = None,
    *,
    cu_seqlens_k: torch.Tensor | None = None,  # (S + 1,) int32; None: the queries' own
    max_seqlen_k: int | None = None,
    strided_rows: bool = False,
    kernel: str = "flash",
) -> torch.Tensor:
    """Flash varlen attention, causal (with `window`, over the window latest keys), grouped-query heads
    handled by the kernel: (N, Hq, D).

    `kernel`: "flash", aten's FlashAttention-2 kernel (with its derivative), or "fa4", FlashAttention-4's
    varlen forward (the `fa4` extra, Hopper or Blackwell, no gradient: the rollout engine's prefill), which
    takes q, k and v as they are (rows at any 16-byte-aligned stride).

    `strided_rows`: q, k and v go to aten's flash kernel as they are wherever their last dimension is
    contiguous, since the kernel reads tokens and heads at any stride (the rollout engine's views of one
    QKV row: three copies a layer saved); otherwise, and always on `varlen_attn`,
    each is made contiguous first, as the training passes' backward takes them.

    Sequence s's queries may be the last of its keys (`cu_seqlens_k` longer than `cu_seqlens`: a
    prefill over a cached context); causal then aligns them to the end of the keys, as flash-attn does.
    The aten flash kernel is called directly (what `torch.nn.attention.varlen.varlen_attn` calls;
    its derivative is aten's): the Python custom-op layer of `varlen_attn` costs ~0.2 ms of CPU per
    call, which at 24 layers × (forward, recomputation, backward) bounded small micro-batches, and
    the rollout engine's prefill (24 layers a step) too.
    """
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    max_k = max_seqlen if max_seqlen_k is None else max_seqlen_k
    if kernel == "fa4":
        from flash_attn.cute import flash_attn_varlen_func

        window_size = (None, None) if window is None else (window - 1, 0)
        return flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_k,
            max_seqlen_q=max_seqlen,
            max_seqlen_k=max_k,
            softmax_scale=scale,
            causal=True,
            window_size=window_size,
            pack_gqa=FA4_PACK_GQA,
        )[0]
    if strided_rows and _ATEN_FLASH is not None:
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    else:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    left = -1 if window is None else window - 1  # keys i - left .. i
    if _ATEN_FLASH is not None:
        sliding = {} if window is None else {"window_size_left": left, "window_size_right": 0}
        return _ATEN_FLASH(
            q, k, v, cu_seqlens, cu_k, max_seqlen, max_k, 0.0, True, False, scale=scale, **sliding
        )[0]
    kwargs: dict[str, object] = {"scale": scale}
    if "is_causal" in _VARLEN_PARAMS and window is None:  # torch 2.10–2.12
        kwargs["is_causal"] = True
    else:  # later: causal is a window (left unbounded, right 0)
        kwargs["window_size"] = (left, 0)
    if "enable_gqa" in _VARLEN_PARAMS:
        kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    return varlen_attn(q, k, v, cu_seqlens, cu_k, max_seqlen, max_k, **kwargs)


def fa4_unavailable_reason(device: torch.device) -> str | None:
    """Why FlashAttention-4 (`varlen_causal_attention(kernel="fa4")`) cannot run on `device`, or None: it needs the
    `fa4` extra (the flash-attn-4 package) and a Hopper or Blackwell card (compute capability 9 or 10)."""
    if device.type != "cuda":
        return f"FlashAttention-4 runs on CUDA, not {device.type}"
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
        return "FlashAttention-4 is not installed (pip install 'fulcrum[fa4]')"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"FlashAttention-4 runs on Hopper or Blackwell (compute capability 9.x or 10.x), not {major}.{minor}"
    return None


def has_cudnn_attention(x: torch.Tensor) -> bool:
    """Whether `cudnn_causal_attention` can run on `x`: a CUDA tensor of a half-precision dtype, with cuDNN
    present and SDPA's cuDNN backend enabled."""
    return (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and torch.backends.cudnn.is_available()
        and torch.backends.cuda.cudnn_sdp_enabled()
    )


def repeat_kv_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(N, Hkv, D) -> (N, heads, D): each K/V head repeated for the query heads of its group (query head h
    reads K/V head h // (heads / Hkv), as the flash kernel groups them); `x` itself when already whole."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def cudnn_bucket(length: int) -> int:
    """The length a prompt of `length` tokens runs at under `cudnn_causal_attention`: rounded up to a
    multiple of max(64, 2^(⌊log2 length⌋ − 4)), sixteen lengths an octave.

    cuDNN builds an execution plan for each shape it meets; prompts of every length would each cost one.
    The padded tail adds at most (1 + 1/16)² − 1 ≈ 13 % to a prompt's causal attention FLOPs (64 tokens
    on a prompt shorter than 1,024)."""
    step = max(64, 1 << max(0, length.bit_length() - 5))
    return -(-length // step) * step


def cudnn_causal_attention(
    q: torch.Tensor,  # (N, Hq, D)
    k: torch.Tensor,  # (N, Hkv, D)
    v: torch.Tensor,  # (N, Hkv, D)
    lengths: list[int],
    scale: float | None,
    native_gqa: bool = False,
    backend: object | None = None,
    strided_rows: bool = False,
) -> torch.Tensor:
    """Causal attention of packed sequences whose queries are all of their keys (a prefill with no cached
    context, no window), under SDPA's cuDNN backend: (N, Hq, D).

    The sequences (`lengths`, in order, summing to N) are grouped by `cudnn_bucket` of their length, and
    each group runs as one dense (P, Hq, L_b, D) batch, zero-padded at the end. Padding at the end changes
    no real query's output: the causal mask keeps query i to keys 0..i. K/V heads are repeated for their
    query groups (`repeat_kv_heads`) unless `native_gqa`, which hands cuDNN the grouped heads. `backend`
    (an `SDPBackend`; cuDNN's by default) lets the CPU check the grouping under the math kernel.
    `strided_rows`: q, k and v are read as they are (the engine's views of one QKV row, each with its last
    dimension contiguous): a batch of consecutive prompts already at their padded length is then a view
    with the row's stride, no copy; else each is made contiguous first.

    Dense, not cuDNN's varlen (ragged) form, which aten also offers: on Hopper the ragged call measured
    tens of times slower than the dense batch (BENCHMARKS.md, "Long contexts")."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads = q.shape[1]
    if not native_gqa:
        k, v = repeat_kv_heads(k, heads), repeat_kv_heads(v, heads)
    if not strided_rows or any(x.stride(-1) != 1 for x in (q, k, v)):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    starts = [0, *itertools.accumulate(lengths[:-1])]
    groups: dict[int, list[tuple[int, int]]] = {}
    for start, n in zip(starts, lengths, strict=True):
        groups.setdefault(cudnn_bucket(n), []).append((start, n))
    out = torch.empty_like(q)
    for padded, members in groups.items():
        batches = [_padded_batch(x, members, padded) for x in (q, k, v)]  # (P, H, L_b, D) each
        with sdpa_kernel(backend if backend is not None else SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(
                *batches, is_causal=True, scale=scale, enable_gqa=batches[1].shape[1] != heads
            )
        o = o.transpose(1, 2)  # (P, L_b, H, D)
        for j, (start, n) in enumerate(members):
            out[start : start + n] = o[j, :n]
    return out


def _padded_batch(x: torch.Tensor, members: list[tuple[int, int]], padded: int) -> torch.Tensor:
    """The (start, length) runs of x (N, H, D), its last dimension contiguous, as a (P, H, padded, D) batch:
    a view of x when the runs are consecutive and already `padded` long, else a zero-padded copy."""
    first = members[0][0]
    if all(n == padded and s == first + j * padded for j, (s, n) in enumerate(members)):
        return (
            x[first : first + len(members) * padded].view(len(members), padded, *x.shape[1:]).transpose(1, 2)
        )
    batch = x.new_zeros(len(members), padded, *x.shape[1:])
    for j, (start, n) in enumerate(members):
        batch[j, :n] = x[start : start + n]
    return batch.transpose(1, 2)
