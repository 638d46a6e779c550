"""Triton kernels for the CUDA path: paged decode attention, fused norms, RoPE, SwiGLU (the sampler's
are in `sample_kernels`).

Each mirrors a torch function of `ops.py` (tests compare them, on the GPU or under TRITON_INTERPRET=1).
Importing this module needs `triton`; `HAVE_TRITON` says whether it is there.
"""

from __future__ import annotations

import torch

from fulcrum.rollout.native.decode_grid import decode_launch

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
        cache_addr_ptr, k_offset, v_offset, part_out_ptr, part_lse_ptr, order_ptr,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        TILE: tl.constexpr, PRECISION: tl.constexpr, INDIRECT: tl.constexpr, CACHE_DTYPE: tl.constexpr,
        SLIDING: tl.constexpr, SPLITS: tl.constexpr, ORDERED: tl.constexpr,
    ):  # fmt: skip
        # One program per (sequence, KV head): the GROUP query heads that share the KV head are
        # processed together, so each K/V tile is read once. Online softmax over TILE-token tiles.
        # INDIRECT: the cache's address is read from the device (cache_addr_ptr) instead of being an
        # argument, so a CUDA graph holding this kernel survives the cache being freed and reallocated.
        # SLIDING (window > 0): only the window latest positions are read (sliding-window layers). A
        # compile-time switch, so full-attention layers run the loop from 0 with no position floor.
        # SPLITS > 1 (flash-decoding): program (seq, kv_head, split) reads the split-th of the context's
        # tiles and writes its heads' normalised partial output and log-sum-exp to part_out / part_lse
        # (B, Hq, SPLITS, D) and (B, Hq, SPLITS); _decode_combine_kernel merges them. More programs
        # for a batch whose (sequence, KV head) pairs leave the GPU's warps short of memory requests.
        # ORDERED: the grid is (KV head, rank, split) and the rank-th program row takes sequence
        # order[rank] (`decode_order`: longest context first), so that the GPU, which starts programs
        # in grid order, starts the longest first and a launch does not end on one long program.
        if INDIRECT:
            # The alignment hint restores the vectorised loads that a pointer argument gets for free.
            base = tl.multiple_of(tl.load(cache_addr_ptr), 16).to(tl.pointer_type(CACHE_DTYPE))
            k_cache_ptr = base + k_offset
            v_cache_ptr = base + v_offset
        if ORDERED:
            seq = tl.load(order_ptr + tl.program_id(1))
            kv_head = tl.program_id(0)
            kv_heads = tl.num_programs(0)
        else:
            seq = tl.program_id(0)
            kv_head = tl.program_id(1)
            kv_heads = tl.num_programs(1)
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
        loop_end = context_len
        if SPLITS > 1:
            split = tl.program_id(2)
            tiles = tl.cdiv(context_len - tile_start, TILE)
            per_split = tl.cdiv(tiles, SPLITS) * TILE
            tile_start = tile_start + split * per_split
            loop_end = tl.minimum(context_len, tile_start + per_split)
        for start in range(tile_start, loop_end, TILE):
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
        if SPLITS > 1:  # a split past the context read nothing: weight 0 in the combine
            read = l_i > 0
            part = tl.where(read[:, None], acc / tl.where(read, l_i, 1.0)[:, None], 0.0)
            lse = tl.where(read, m_i + tl.log(tl.where(read, l_i, 1.0)), float("-inf"))
            row = (seq * GROUP * kv_heads + head) * SPLITS + tl.program_id(2)  # (b, h, split)
            tl.store(part_out_ptr + row[:, None] * HEAD_DIM + dim[None, :], part, mask=head_ok[:, None])
            tl.store(part_lse_ptr + row, lse, mask=head_ok)
        else:
            out = acc / l_i[:, None]
            tl.store(
                out_ptr + seq * stride_o_tok + head[:, None] * stride_o_head + dim[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=head_ok[:, None],
            )

    @triton.jit
    def _decode_combine_kernel(
        part_out_ptr, part_lse_ptr, out_ptr, stride_o_tok, stride_o_head,
        HEADS: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):  # fmt: skip
        # One program per (sequence, query head): out = sum_s w_s * o_s / sum_s w_s, w_s = exp(lse_s - max lse).
        seq = tl.program_id(0)
        head = tl.program_id(1)
        split = tl.arange(0, SPLITS_PAD)
        dim = tl.arange(0, HEAD_DIM)
        ok = split < SPLITS
        row = (seq * HEADS + head) * SPLITS + split
        lse = tl.load(part_lse_ptr + row, mask=ok, other=float("-inf"))
        weight = tl.exp(lse - tl.max(lse, 0))  # every context has a token: one split at least read
        part = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + dim[None, :], mask=ok[:, None], other=0.0)
        out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
        tl.store(out_ptr + seq * stride_o_tok + head * stride_o_head + dim, out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, residual_ptr, weight_ptr, out_ptr, eps, hidden,
        HAS_RESIDUAL: tl.constexpr, OFFSET: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # out = (OFFSET + weight) * rmsnorm(x + residual); residual <- x + residual (rounded to the model
        # dtype first, as the unfused HF code does). OFFSET 0: the normed x is rounded to the model dtype
        # before the weight (HF's LlamaRMSNorm); else the product is taken in fp32 and rounded once
        # (HF's (1 + w) norms: Gemma, Qwen3.5), as ops.rms_norm.
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
        weight = tl.load(weight_ptr + cols, mask=ok, other=0.0)
        if OFFSET == 0:
            out = weight * (x32 * rstd).to(x_ptr.dtype.element_ty)
        else:
            out = (x32 * rstd * (weight.to(tl.float32) + OFFSET)).to(x_ptr.dtype.element_ty)
        tl.store(out_ptr + row * hidden + cols, out, mask=ok)

    @triton.jit
    def _rope_kernel(
        q_ptr, k_ptr, positions_ptr, cos_sin_ptr, stride_q_tok, stride_k_tok, num_q_heads, num_k_heads,
        v_ptr, stride_v_tok, slots_ptr, cache_ptr, cache_addr_ptr, k_offset, v_offset,
        q_norm_ptr, k_norm_ptr, eps,
        HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
        HEADS_PAD: tl.constexpr, INDIRECT: tl.constexpr, CACHE_DTYPE: tl.constexpr,
        QK_NORM: tl.constexpr, NORM_OFFSET: tl.constexpr,
    ):  # fmt: skip
        # In place on q (N, Hq, D) and k (N, Hkv, D) rows that may be strided views of one qkv buffer:
        # the first 2 * HALF of each head's HEAD_DIM dims rotate (rotate-half over that width), the rest
        # pass through (partial RoPE: Qwen3.5, Qwen3-Next). Then k and v (N, Hkv, D) written whole at
        # each token's cache slot (K plane at k_offset, V plane at v_offset, elements from the cache's
        # start; the start read on the device when INDIRECT, as the paged kernel does): the K/V write
        # costs no kernel of its own (a decode step would otherwise launch two index_copy_ a layer).
        # QK_NORM (whole-head rotation only): each head of q and k first RMS-normed over its HEAD_DIM dims
        # with its weight (q_norm_ptr, k_norm_ptr), rounded as _add_rms_norm_kernel rounds, so the
        # rotation reads what the separate norm would have stored, with no pass of its own.
        tok = tl.program_id(0).to(tl.int64)
        pos = tl.load(positions_ptr + tok)
        half = tl.arange(0, HALF_PAD)
        half_ok = (half < HALF)[None, :]
        cos = tl.load(cos_sin_ptr + pos * 2 * HALF + half, mask=half < HALF, other=0.0)[None, :]
        sin = tl.load(cos_sin_ptr + pos * 2 * HALF + HALF + half, mask=half < HALF, other=0.0)[None, :]
        heads = tl.arange(0, HEADS_PAD)
        dims = tl.arange(0, DIM_PAD)
        k_heads = (heads < num_k_heads)[:, None]
        in_row = heads[:, None] * HEAD_DIM + half[None, :]  # a head's first rotated half, within a row
        whole = heads[:, None] * HEAD_DIM + dims[None, :]  # every dim of a head, within a row
        whole_ok = k_heads & (dims < HEAD_DIM)[None, :]
        if INDIRECT:
            cache_ptr = tl.multiple_of(tl.load(cache_addr_ptr), 16).to(tl.pointer_type(CACHE_DTYPE))
        slot = cache_ptr + tl.load(slots_ptr + tok).to(tl.int64) * (num_k_heads * HEAD_DIM)
        v_row = tl.load(v_ptr + tok * stride_v_tok + whole, mask=whole_ok, other=0.0)
        tl.store(slot + v_offset + whole, v_row, mask=whole_ok)
        if 2 * HALF < HEAD_DIM:  # k's dims past the rotated ones go to the cache as they are
            tail = whole_ok & (dims >= 2 * HALF)[None, :]
            k_tail = tl.load(k_ptr + tok * stride_k_tok + whole, mask=tail, other=0.0)
            tl.store(slot + k_offset + whole, k_tail, mask=tail)
        for which in tl.static_range(2):
            if which == 0:
                base = q_ptr + tok * stride_q_tok
                count = num_q_heads
                norm_ptr = q_norm_ptr
            else:
                base = k_ptr + tok * stride_k_tok
                count = num_k_heads
                norm_ptr = k_norm_ptr
            ok = (heads < count)[:, None] & half_ok
            first_ptr = base + in_row
            x1 = tl.load(first_ptr, mask=ok, other=0.0)
            x2 = tl.load(first_ptr + HALF, mask=ok, other=0.0)
            if QK_NORM:
                w1 = tl.load(norm_ptr + half, mask=half < HALF, other=0.0)[None, :]
                w2 = tl.load(norm_ptr + HALF + half, mask=half < HALF, other=0.0)[None, :]
                a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
                squares = tl.sum(a1 * a1, 1) + tl.sum(a2 * a2, 1)
                rstd = (1.0 / tl.sqrt(squares / HEAD_DIM + eps))[:, None]
                if NORM_OFFSET == 0:
                    x1 = w1 * (a1 * rstd).to(x1.dtype)
                    x2 = w2 * (a2 * rstd).to(x2.dtype)
                else:
                    x1 = (a1 * rstd * (w1.to(tl.float32) + NORM_OFFSET)).to(x1.dtype)
                    x2 = (a2 * rstd * (w2.to(tl.float32) + NORM_OFFSET)).to(x2.dtype)
            y1 = (x1.to(tl.float32) * cos - x2.to(tl.float32) * sin).to(x1.dtype)
            y2 = (x2.to(tl.float32) * cos + x1.to(tl.float32) * sin).to(x1.dtype)
            tl.store(first_ptr, y1, mask=ok)
            tl.store(first_ptr + HALF, y2, mask=ok)
            if which == 1:
                tl.store(slot + k_offset + in_row, y1, mask=ok)
                tl.store(slot + k_offset + in_row + HALF, y2, mask=ok)

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        gate = tl.load(gate_up_ptr + row * 2 * inter + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * 2 * inter + inter + cols, mask=ok, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


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
        return plane_offsets(self.num_slots * self.num_kv_heads * self.head_dim, layer)


def plane_offsets(plane: int, layer: int) -> tuple[int, int]:
    """Element offsets of layer `layer`'s K and V planes in a (layers, 2, slots, Hkv, D) cache whose
    planes hold `plane` = slots * Hkv * D elements each."""
    return 2 * layer * plane, (2 * layer + 1) * plane


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _decode(
    q: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    cache_strides: tuple[int, int],
    indirect: tuple[torch.Tensor, int, int] | None,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    out: torch.Tensor,
    window: int | None,
    cache_dtype: torch.dtype,
    num_kv_heads: int,
    launch: dict[str, int] | None,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch _paged_decode_kernel (and, with SPLITS > 1, _decode_combine_kernel) into `out`. Given an
    `order` (`decode_grid.decode_order`), the programs take the rows in that order."""
    batch, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    max_context = block_tables.shape[1] * block_size
    params = decode_launch(batch, num_kv_heads, min(max_context, window or max_context), q.device, launch)
    ordered = order is not None
    splits = params["SPLITS"]
    if splits > 1:
        part_out = torch.empty((batch, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # not written
    address, k_offset, v_offset = indirect if indirect is not None else (context_lens, 0, 0)
    grid = (num_kv_heads, batch, splits) if ordered else (batch, num_kv_heads, splits)
    _paged_decode_kernel[grid](
        q, caches[0], caches[1], block_tables, context_lens, out, scale, window or 0,
        q.stride(0), q.stride(1), cache_strides[0], cache_strides[1], block_tables.stride(0),
        out.stride(0), out.stride(1), address, k_offset, v_offset, part_out, part_lse,
        order if ordered else context_lens,
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=head_dim,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", INDIRECT=indirect is not None,
        CACHE_DTYPE=_TL_DTYPES[cache_dtype], SLIDING=bool(window), ORDERED=ordered, **params,
    )  # fmt: skip
    if splits > 1:
        _decode_combine_kernel[(batch, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1),
            HEADS=num_heads, SPLITS=splits, SPLITS_PAD=max(2, next_pow2(splits)), HEAD_DIM=head_dim,
        )  # fmt: skip
    return out


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
    launch: dict[str, int] | None = None,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton twin of ops.decode_attention_gather. q: (B, Hq, D); caches (slots, Hkv, D) -> (B, Hq, D).
    `launch` overrides DECODE_LAUNCH's keys (TILE, SPLITS, num_warps, num_stages; `decode_launch`);
    `order`: the order the programs take the rows in (`decode_grid.decode_order`), None for the batch's."""
    return _decode(
        q, (k_cache, v_cache), (k_cache.stride(0), k_cache.stride(1)), None, block_tables, context_lens,
        block_size, scale, torch.empty_like(q) if out is None else out, window, q.dtype, k_cache.shape[1],
        launch, order,
    )  # fmt: skip


def paged_decode_attention_indirect(
    q: torch.Tensor,
    cache: IndirectCache,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None = None,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_decode_attention over layer `layer` of an IndirectCache (address read on the device)."""
    head_dim = q.shape[2]
    return _decode(
        q, (q, q), (cache.num_kv_heads * head_dim, head_dim), (cache.address, *cache.offsets(layer)),
        block_tables, context_lens, block_size, scale, torch.empty_like(q), window, cache.dtype,
        cache.num_kv_heads, None, order,
    )  # fmt: skip


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> torch.Tensor:
    """Triton twin of ops.rms_norm / ops.add_rms_norm (`offset`: 1 for (1 + w) norms); with a residual,
    it is updated in place to x + residual."""
    rows, hidden = x.shape
    out = torch.empty_like(x)
    _add_rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, eps, hidden,
        HAS_RESIDUAL=residual is not None, OFFSET=float(offset), BLOCK=next_pow2(hidden),
    )  # fmt: skip
    return out


def rope_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    slots: torch.Tensor,
    cache: torch.Tensor | IndirectCache,
    layer: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float, float] | None = None,
) -> None:
    """Triton twin of ops.apply_rope on q (N, Hq, D) and k (N, Hkv, D), in place (rows may be strided),
    and the rotated k and v (N, Hkv, D) written at `slots` (N,) of layer `layer` of `cache`: a (layers,
    2, slots, Hkv, D) tensor, or an IndirectCache. One kernel for the rotation and the cache's two
    index_copy_. A `cos_sin` table (P, R) narrower than D rotates the first R dims of each head and
    passes the rest through (partial RoPE), as ops.apply_rope. With `qk_norm` (attention.QKNorm: the q and
    k weights, eps, the weight offset) each head of q and k is first RMS-normed (Qwen3's and Gemma 3's
    per-head norms: what add_rms_norm would give each head's row), in the same pass; whole-head rotation
    only."""
    tokens, num_q_heads, head_dim = q.shape
    half = cos_sin.shape[-1] // 2
    assert 2 * half <= head_dim and cos_sin.is_contiguous()
    assert qk_norm is None or 2 * half == head_dim, "the fused head norm needs whole-head rotation"
    kv_heads = k.shape[1]
    for t in (q, k, v):
        assert t.stride(2) == 1 and t.stride(1) == head_dim
    if isinstance(cache, IndirectCache):
        k_offset, v_offset = cache.offsets(layer)
        tensor, address, indirect, dtype = k, cache.address, True, cache.dtype
    else:
        assert cache.is_contiguous() and cache.shape[-2:] == (kv_heads, head_dim)
        k_offset, v_offset = plane_offsets(cache.shape[2] * kv_heads * head_dim, layer)
        tensor, address, indirect, dtype = cache, positions, False, cache.dtype
    assert dtype == k.dtype == v.dtype
    _rope_kernel[(tokens,)](
        q, k, positions, cos_sin, q.stride(0), k.stride(0), num_q_heads, kv_heads,
        v, v.stride(0), slots, tensor, address, k_offset, v_offset,
        *(qk_norm[:3] if qk_norm is not None else (q, k, 0.0)),
        HALF=half, HALF_PAD=next_pow2(half), HEAD_DIM=head_dim, DIM_PAD=next_pow2(head_dim),
        HEADS_PAD=next_pow2(max(num_q_heads, kv_heads)), INDIRECT=indirect, CACHE_DTYPE=_TL_DTYPES[dtype],
        QK_NORM=qk_norm is not None, NORM_OFFSET=float(qk_norm[3]) if qk_norm is not None else 0.0,
    )  # fmt: skip


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton twin of ops.silu_and_mul: (N, 2I) -> (N, I)."""
    rows, double = gate_up.shape
    inter = double // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out
