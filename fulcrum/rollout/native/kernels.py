"""Triton kernels for the CUDA path: paged decode attention, fused norms, RoPE, SwiGLU, Gumbel-max sampling.

Each mirrors a torch function of `ops.py` (tests compare them, on the GPU or under TRITON_INTERPRET=1).
Importing this module needs `triton`; `HAVE_TRITON` says whether it is there.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs: the engine uses ops.py
    HAVE_TRITON = False

if HAVE_TRITON:
    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
        scale, window,
        stride_q_tok, stride_q_head, stride_k_slot, stride_k_head, stride_bt, stride_o_tok, stride_o_head,
        cache_addr_ptr, k_offset, v_offset,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        TILE: tl.constexpr, PRECISION: tl.constexpr, INDIRECT: tl.constexpr, CACHE_DTYPE: tl.constexpr,
        SLIDING: tl.constexpr,
    ):  # fmt: skip
        # One program per (sequence, KV head): the GROUP query heads that share the KV head are
        # processed together, so each K/V tile is read once. Online softmax over TILE-token tiles.
        # INDIRECT: the cache's address is read from the device (cache_addr_ptr) instead of being an
        # argument, so a CUDA graph holding this kernel survives the cache being freed and reallocated.
        # SLIDING (window > 0): only the window latest positions are read (sliding-window layers). A
        # compile-time switch, so full-attention layers run the loop from 0 with no position floor.
        if INDIRECT:
            # The alignment hint restores the vectorised loads that a pointer argument gets for free.
            base = tl.multiple_of(tl.load(cache_addr_ptr), 16).to(tl.pointer_type(CACHE_DTYPE))
            k_cache_ptr = base + k_offset
            v_cache_ptr = base + v_offset
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        context_len = tl.load(context_lens_ptr + seq)
        group = tl.arange(0, GROUP_PAD)
        head = kv_head * GROUP + group
        head_ok = group < GROUP
        dim = tl.arange(0, HEAD_DIM)
        q = tl.load(
            q_ptr + seq * stride_q_tok + head[:, None] * stride_q_head + dim[None, :],
            mask=head_ok[:, None],
            other=0.0,
        )  # (G, D)
        m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
        if SLIDING:
            first = tl.maximum(context_len - window, 0)
            tile_start = (first // TILE) * TILE
        else:
            first = 0
            tile_start = 0
        for start in range(tile_start, context_len, TILE):
            pos = start + tl.arange(0, TILE)
            pos_ok = pos < context_len
            if SLIDING:
                pos_ok = pos_ok & (pos >= first)
            block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            kv_offset = slot[:, None] * stride_k_slot + kv_head * stride_k_head + dim[None, :]
            k = tl.load(k_cache_ptr + kv_offset, mask=pos_ok[:, None], other=0.0)  # (TILE, D)
            v = tl.load(v_cache_ptr + kv_offset, mask=pos_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (G, TILE)
            s = tl.where(pos_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + seq * stride_o_tok + head[:, None] * stride_o_head + dim[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=head_ok[:, None],
        )

    @triton.jit
    def _store_kv_kernel(
        k_ptr, v_ptr, slots_ptr, cache_addr_ptr, k_offset, v_offset, stride_k_tok, stride_v_tok,
        WIDTH: tl.constexpr, BLOCK: tl.constexpr, CACHE_DTYPE: tl.constexpr,
    ):  # fmt: skip
        # cache[k_offset + slot * WIDTH + :] = k[token]; the same for v (WIDTH = Hkv * D), with the cache
        # address read on the device (see INDIRECT above).
        tok = tl.program_id(0).to(tl.int64)
        base = tl.multiple_of(tl.load(cache_addr_ptr), 16).to(tl.pointer_type(CACHE_DTYPE))
        slot = tl.load(slots_ptr + tok).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < WIDTH
        k = tl.load(k_ptr + tok * stride_k_tok + cols, mask=ok)
        v = tl.load(v_ptr + tok * stride_v_tok + cols, mask=ok)
        tl.store(base + k_offset + slot * WIDTH + cols, k, mask=ok)
        tl.store(base + v_offset + slot * WIDTH + cols, v, mask=ok)

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, residual_ptr, weight_ptr, out_ptr, eps, hidden, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr
    ):
        # out = weight * rmsnorm(x + residual); residual <- x + residual (rounded to the model dtype first,
        # as the unfused HF code does).
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < hidden
        x = tl.load(x_ptr + row * hidden + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            total = x + tl.load(residual_ptr + row * hidden + cols, mask=ok, other=0.0)
            tl.store(residual_ptr + row * hidden + cols, total, mask=ok)
            x = total
        x32 = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / hidden + eps)
        normed = (x32 * rstd).to(x_ptr.dtype.element_ty)
        weight = tl.load(weight_ptr + cols, mask=ok, other=0.0)
        tl.store(out_ptr + row * hidden + cols, weight * normed, mask=ok)

    @triton.jit
    def _rope_kernel(
        q_ptr, k_ptr, positions_ptr, cos_sin_ptr, stride_q_tok, stride_k_tok, num_q_heads, num_k_heads,
        HALF: tl.constexpr, HEADS_PAD: tl.constexpr,
    ):  # fmt: skip
        # In place on q (N, Hq, D) and k (N, Hkv, D) rows that may be strided views of one qkv buffer.
        tok = tl.program_id(0).to(tl.int64)
        pos = tl.load(positions_ptr + tok)
        half = tl.arange(0, HALF)
        cos = tl.load(cos_sin_ptr + pos * 2 * HALF + half)[None, :]
        sin = tl.load(cos_sin_ptr + pos * 2 * HALF + HALF + half)[None, :]
        heads = tl.arange(0, HEADS_PAD)
        for which in tl.static_range(2):
            if which == 0:
                base = q_ptr + tok * stride_q_tok
                count = num_q_heads
            else:
                base = k_ptr + tok * stride_k_tok
                count = num_k_heads
            ok = (heads < count)[:, None]
            first_ptr = base + heads[:, None] * (2 * HALF) + half[None, :]
            x1 = tl.load(first_ptr, mask=ok, other=0.0)
            x2 = tl.load(first_ptr + HALF, mask=ok, other=0.0)
            y1 = x1.to(tl.float32) * cos - x2.to(tl.float32) * sin
            y2 = x2.to(tl.float32) * cos + x1.to(tl.float32) * sin
            tl.store(first_ptr, y1.to(x1.dtype), mask=ok)
            tl.store(first_ptr + HALF, y2.to(x1.dtype), mask=ok)

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        gate = tl.load(gate_up_ptr + row * 2 * inter + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * 2 * inter + inter + cols, mask=ok, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _gumbel_sample_kernel(
        logits_ptr, stride_row, vocab, inv_temperature, seed_ptr, tokens_ptr, logprobs_ptr,
        GREEDY: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # One pass over a row: the logsumexp of logits/T (for the log-prob) and the argmax of
        # logits/T + Gumbel noise (the sample), i.e. the Gumbel-max trick; GREEDY drops the noise.
        row = tl.program_id(0).to(tl.int64)
        seed = tl.load(seed_ptr)
        cols = tl.arange(0, BLOCK)
        run_max = tl.full((BLOCK,), float("-inf"), tl.float32)
        run_sum = tl.zeros((BLOCK,), tl.float32)
        best_val = tl.full((BLOCK,), float("-inf"), tl.float32)
        best_idx = tl.zeros((BLOCK,), tl.int32)
        for start in range(0, vocab, BLOCK):
            idx = start + cols
            ok = idx < vocab
            x = tl.load(logits_ptr + row * stride_row + idx, mask=ok, other=float("-inf")).to(tl.float32)
            x = x * inv_temperature
            new_max = tl.maximum(run_max, x)
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - safe) + tl.exp(x - safe)
            run_max = new_max
            if GREEDY:
                score = x
            else:
                u = tl.rand(seed, (row * vocab + idx).to(tl.int32))
                u = tl.minimum(tl.maximum(u, 1e-20), 0.99999994)
                score = x - tl.log(-tl.log(u))
            score = tl.where(ok, score, float("-inf"))
            better = score > best_val
            best_val = tl.where(better, score, best_val)
            best_idx = tl.where(better, idx, best_idx)
        row_max = tl.max(run_max, 0)
        total = tl.sum(run_sum * tl.exp(run_max - row_max), 0)
        top = tl.max(best_val, 0)
        # lowest index among the lanes holding the best score: the same tie-break as torch.argmax
        token = tl.min(tl.where(best_val == top, best_idx, vocab), 0)
        picked = tl.load(logits_ptr + row * stride_row + token).to(tl.float32) * inv_temperature
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(logprobs_ptr + row, picked - row_max - tl.log(total))


class IndirectCache:
    """A KV cache (layers, 2, slots, Hkv, D) seen through a one-element device tensor holding its address.

    Kernels that take the cache this way read the address when they run, so CUDA graphs captured
    over them stay valid when the cache is freed (`sleep`) and allocated again elsewhere (`wake_up`):
    `point_to(new_cache)` only rewrites the address.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers, _, self.num_slots, self.num_kv_heads, self.head_dim = shape
        self.dtype = dtype
        self.address = torch.zeros(1, dtype=torch.int64, device=device)

    def point_to(self, cache: torch.Tensor) -> None:
        assert cache.is_contiguous() and cache.dtype == self.dtype
        self.address.fill_(cache.data_ptr())

    def offsets(self, layer: int) -> tuple[int, int]:
        """Element offsets of layer `layer`'s K and V planes from the cache's start."""
        plane = self.num_slots * self.num_kv_heads * self.head_dim
        return 2 * layer * plane, (2 * layer + 1) * plane


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    out: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Triton twin of ops.decode_attention_gather. q: (B, Hq, D); caches (slots, Hkv, D) -> (B, Hq, D)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _paged_decode_kernel[(batch, num_kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), context_lens, 0, 0,
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(16, _next_pow2(group)), HEAD_DIM=head_dim,
        TILE=64, PRECISION=precision, INDIRECT=False, CACHE_DTYPE=_TL_DTYPES[q.dtype],
        SLIDING=bool(window),
    )  # fmt: skip
    return out


def paged_decode_attention_indirect(
    q: torch.Tensor,
    cache: IndirectCache,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """paged_decode_attention over layer `layer` of an IndirectCache (address read on the device)."""
    batch, num_heads, head_dim = q.shape
    group = num_heads // cache.num_kv_heads
    out = torch.empty_like(q)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    k_offset, v_offset = cache.offsets(layer)
    _paged_decode_kernel[(batch, cache.num_kv_heads)](
        q, q, q, block_tables, context_lens, out, scale, window or 0,
        q.stride(0), q.stride(1), cache.num_kv_heads * head_dim, head_dim, block_tables.stride(0),
        out.stride(0), out.stride(1), cache.address, k_offset, v_offset,
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(16, _next_pow2(group)), HEAD_DIM=head_dim,
        TILE=64, PRECISION=precision, INDIRECT=True, CACHE_DTYPE=_TL_DTYPES[cache.dtype],
        SLIDING=bool(window),
    )  # fmt: skip
    return out


def store_kv_indirect(
    k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, cache: IndirectCache, layer: int
):
    """Write k, v (N, Hkv, D) at `slots` (N,) of layer `layer` of an IndirectCache."""
    tokens, kv_heads, head_dim = k.shape
    assert k.stride(1) == head_dim and k.stride(2) == 1 and v.stride(1) == head_dim and v.stride(2) == 1
    k_offset, v_offset = cache.offsets(layer)
    width = kv_heads * head_dim
    _store_kv_kernel[(tokens,)](
        k, v, slots, cache.address, k_offset, v_offset, k.stride(0), v.stride(0),
        WIDTH=width, BLOCK=_next_pow2(width), CACHE_DTYPE=_TL_DTYPES[cache.dtype],
    )  # fmt: skip


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Triton twin of ops.rms_norm / ops.add_rms_norm; with a residual, it is updated in place to x + residual."""
    rows, hidden = x.shape
    out = torch.empty_like(x)
    _add_rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, eps, hidden,
        HAS_RESIDUAL=residual is not None, BLOCK=_next_pow2(hidden),
    )  # fmt: skip
    return out


def rope_inplace(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Triton twin of ops.apply_rope on q (N, Hq, D) and k (N, Hkv, D), in place (rows may be strided)."""
    tokens, num_q_heads, head_dim = q.shape
    assert q.stride(2) == 1 and k.stride(2) == 1 and q.stride(1) == head_dim and k.stride(1) == head_dim
    _rope_kernel[(tokens,)](
        q, k, positions, cos_sin, q.stride(0), k.stride(0), num_q_heads, k.shape[1],
        HALF=head_dim // 2, HEADS_PAD=_next_pow2(max(num_q_heads, k.shape[1])),
    )  # fmt: skip


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton twin of ops.silu_and_mul: (N, 2I) -> (N, I)."""
    rows, double = gate_up.shape
    inter = double // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out


def gumbel_sample(
    logits: torch.Tensor, temperature: float, seed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of logits (B, V) by Gumbel-max; greedy when temperature == 0.

    Returns (tokens (B,) int64, log-probs (B,) fp32 under softmax(logits / T), T = 1 when greedy).
    `seed` is a one-element int64 device tensor (read on the device, so CUDA graphs may hold it).
    """
    batch, vocab = logits.shape
    tokens = torch.empty(batch, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(batch, dtype=torch.float32, device=logits.device)
    greedy = temperature == 0
    _gumbel_sample_kernel[(batch,)](
        logits, logits.stride(0), vocab, 1.0 if greedy else 1.0 / temperature, seed, tokens, logprobs,
        GREEDY=greedy, BLOCK=1024,
    )  # fmt: skip
    return tokens, logprobs
