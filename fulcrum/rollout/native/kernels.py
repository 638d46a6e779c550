"""Triton kernels for the CUDA path: paged decode attention, fused norms, RoPE, SwiGLU, Gumbel-max sampling.

Each mirrors a torch function of `ops.py` (tests compare them, on the GPU or under TRITON_INTERPRET=1).
Importing this module needs `triton`; `HAVE_TRITON` says whether it is there.

Sampling (`gumbel_sample`) was bound by the integer multiplies of its Philox4x32-10 noise, so each
Philox call serves four vocabulary entries (all four of its 32-bit outputs), and each row is split
over several programs whose partial results a second small kernel combines: a small batch still
fills the GPU, and a large one gets more warps per SM to hide the multiply latency (487 -> 341 µs a
0.5B decode step on an H200).
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
        v_ptr, stride_v_tok, slots_ptr, cache_ptr, cache_addr_ptr, k_offset, v_offset,
        HALF: tl.constexpr, HEADS_PAD: tl.constexpr, INDIRECT: tl.constexpr, CACHE_DTYPE: tl.constexpr,
    ):  # fmt: skip
        # In place on q (N, Hq, D) and k (N, Hkv, D) rows that may be strided views of one qkv buffer;
        # then the rotated k and v (N, Hkv, D) written at each token's cache slot (K plane at k_offset,
        # V plane at v_offset, elements from the cache's start; the start read on the device when
        # INDIRECT, as the paged kernel does): the K/V write costs no kernel of its own, where two
        # index_copy_ launches a layer were 5 % of a decode step (48 of its ~290 kernels).
        tok = tl.program_id(0).to(tl.int64)
        pos = tl.load(positions_ptr + tok)
        half = tl.arange(0, HALF)
        cos = tl.load(cos_sin_ptr + pos * 2 * HALF + half)[None, :]
        sin = tl.load(cos_sin_ptr + pos * 2 * HALF + HALF + half)[None, :]
        heads = tl.arange(0, HEADS_PAD)
        k_ok = (heads < num_k_heads)[:, None]
        in_row = heads[:, None] * (2 * HALF) + half[None, :]  # a head's first half, within a token's row
        if INDIRECT:
            cache_ptr = tl.multiple_of(tl.load(cache_addr_ptr), 16).to(tl.pointer_type(CACHE_DTYPE))
        slot_row = cache_ptr + tl.load(slots_ptr + tok).to(tl.int64) * (num_k_heads * 2 * HALF) + in_row
        v_first = v_ptr + tok * stride_v_tok + in_row
        tl.store(slot_row + v_offset, tl.load(v_first, mask=k_ok, other=0.0), mask=k_ok)
        tl.store(slot_row + v_offset + HALF, tl.load(v_first + HALF, mask=k_ok, other=0.0), mask=k_ok)
        for which in tl.static_range(2):
            if which == 0:
                base = q_ptr + tok * stride_q_tok
                count = num_q_heads
            else:
                base = k_ptr + tok * stride_k_tok
                count = num_k_heads
            ok = (heads < count)[:, None]
            first_ptr = base + in_row
            x1 = tl.load(first_ptr, mask=ok, other=0.0)
            x2 = tl.load(first_ptr + HALF, mask=ok, other=0.0)
            y1 = (x1.to(tl.float32) * cos - x2.to(tl.float32) * sin).to(x1.dtype)
            y2 = (x2.to(tl.float32) * cos + x1.to(tl.float32) * sin).to(x1.dtype)
            tl.store(first_ptr, y1, mask=ok)
            tl.store(first_ptr + HALF, y2, mask=ok)
            if which == 1:
                tl.store(slot_row + k_offset, y1, mask=ok)
                tl.store(slot_row + k_offset + HALF, y2, mask=ok)

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
    def _gumbel_sample_partial_kernel(
        logits_ptr, stride_row, vocab, quads_per_row, chunk, inv_temperature, seed_ptr,
        part_max_ptr, part_sum_ptr, part_best_ptr, part_idx_ptr,
        GREEDY: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # Program (row, part) reduces the chunk [part * chunk, (part + 1) * chunk) of its row to four
        # partials: the max of logits/T, the sum of exp(logits/T - that max), the best Gumbel score
        # logits/T - log(-log u) and the lowest index holding it; _gumbel_sample_combine_kernel merges
        # the chunks of a row. GREEDY drops the noise (the score is logits/T, T = 1).
        #
        # Cost: one Philox4x32-10 per element (tl.rand keeps one of its four 32-bit outputs) made the
        # one-program-per-row kernel integer-multiply bound: 488 µs of a 2,830 µs decode step at
        # 512 x 151936 on an H200. Here one Philox call serves the four consecutive elements
        # 4Q .. 4Q + 3 of a row (lane = index % 4 picks one of its outputs), a quarter of that work;
        # the split gives a small batch the whole GPU and a 512-row batch twice the programs of one
        # per row (more warps per SM to hide the multiply latency). Expected about 120-150 µs per
        # decode step at 512 x 151936 on an H200; measured 341 (from 487): the multiplies were not all
        # of it, and bench/sample_sweep.py times the launch for the rest.
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        lo = part * chunk
        hi = tl.minimum(lo + chunk, vocab)
        seed = tl.load(seed_ptr)
        # The tile as (BLOCK // 4, 4): row q holds the elements 4q .. 4q + 3 of the tile, which share
        # one Philox call. Tiles start at multiples of BLOCK (a multiple of 4), so these are the
        # elements 4Q .. 4Q + 3 of the row, Q = start // 4 + q.
        quad = tl.arange(0, BLOCK // 4)
        lane = tl.arange(0, 4)[None, :]
        cols = quad[:, None] * 4 + lane
        run_max = tl.full((BLOCK // 4, 4), float("-inf"), tl.float32)
        run_sum = tl.zeros((BLOCK // 4, 4), tl.float32)
        best_val = tl.full((BLOCK // 4, 4), float("-inf"), tl.float32)
        best_idx = tl.zeros((BLOCK // 4, 4), tl.int32)
        for start in range(lo, hi, BLOCK):
            idx = start + cols
            ok = idx < hi
            x = tl.load(logits_ptr + row * stride_row + idx, mask=ok, other=float("-inf")).to(tl.float32)
            x = x * inv_temperature
            new_max = tl.maximum(run_max, x)
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - safe) + tl.exp(x - safe)
            run_max = new_max
            if GREEDY:
                score = x
            else:
                # Philox counter row * ceil(V / 4) + Q: an element's noise depends on (seed, row,
                # index) only, never on the split. The wrapper keeps batch * ceil(V / 4) < 2^31
                # (56,536 rows at V = 151936), so the counter fits in int32, as tl.rand's does.
                counter = (row * quads_per_row + start // 4).to(tl.int32) + quad
                r0, r1, r2, r3 = tl.randint4x(seed, counter)
                bits = tl.where(
                    lane == 0,
                    r0[:, None],
                    tl.where(lane == 1, r1[:, None], tl.where(lane == 2, r2[:, None], r3[:, None])),
                )
                u = tl.uint_to_uniform_float(bits)  # tl.rand's conversion: [0, 1)
                u = tl.minimum(tl.maximum(u, 1e-20), 0.99999994)
                score = x - tl.log(-tl.log(u))
            score = tl.where(ok, score, float("-inf"))
            better = score > best_val  # strict: a lane keeps its lowest index among equal scores
            best_val = tl.where(better, score, best_val)
            best_idx = tl.where(better, idx, best_idx)
        chunk_max = tl.max(run_max)
        safe_max = tl.where(chunk_max == float("-inf"), 0.0, chunk_max)
        chunk_best = tl.max(best_val)
        slot = row * tl.num_programs(1) + part
        tl.store(part_max_ptr + slot, chunk_max)
        tl.store(part_sum_ptr + slot, tl.sum(run_sum * tl.exp(run_max - safe_max)))
        tl.store(part_best_ptr + slot, chunk_best)
        tl.store(part_idx_ptr + slot, tl.min(tl.where(best_val == chunk_best, best_idx, vocab)))

    @triton.jit
    def _gumbel_sample_combine_kernel(
        logits_ptr, stride_row, vocab, splits, inv_temperature,
        part_max_ptr, part_sum_ptr, part_best_ptr, part_idx_ptr, tokens_ptr, logprobs_ptr,
        SPLITS_PAD: tl.constexpr,
    ):  # fmt: skip
        # One program per row merges its chunks' partials: row max M = max_i m_i, the softmax
        # denominator sum_i s_i * exp(m_i - M), and the best score with the lowest index among equal
        # scores (the chunks are disjoint index ranges, each reporting its lowest: torch.argmax's
        # tie-break). log-prob = picked / T - M - log(denominator).
        row = tl.program_id(0).to(tl.int64)
        part = tl.arange(0, SPLITS_PAD)
        ok = part < splits
        slot = row * splits + part
        part_max = tl.load(part_max_ptr + slot, mask=ok, other=float("-inf"))
        part_sum = tl.load(part_sum_ptr + slot, mask=ok, other=0.0)
        part_best = tl.load(part_best_ptr + slot, mask=ok, other=float("-inf"))
        part_idx = tl.load(part_idx_ptr + slot, mask=ok, other=0)
        row_max = tl.max(part_max, 0)
        safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        total = tl.sum(part_sum * tl.exp(part_max - safe_max), 0)
        top = tl.max(part_best, 0)
        token = tl.min(tl.where(ok & (part_best == top), part_idx, vocab), 0)
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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# The paged decode kernel's launch: TILE positions a loop iteration, and Triton's num_warps and num_stages
# (absent: Triton's defaults). `bench/attention_sweep.py` times the alternatives on a GPU: on an H200 one
# warp a program with 4 stages was the fastest launch common to both shapes swept, 1.27x Triton's
# defaults on Qwen2.5-0.5B's (76.6 -> 60.4 us a layer's call) and 1.14x on SmolLM2-135M's (BENCHMARKS.md).
DECODE_LAUNCH: dict[str, int] = {"TILE": 64, "num_warps": 1, "num_stages": 4}


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
) -> torch.Tensor:
    """Triton twin of ops.decode_attention_gather. q: (B, Hq, D); caches (slots, Hkv, D) -> (B, Hq, D).
    `launch` replaces DECODE_LAUNCH (TILE, num_warps, num_stages)."""
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
        PRECISION=precision, INDIRECT=False, CACHE_DTYPE=_TL_DTYPES[q.dtype], SLIDING=bool(window),
        **(launch or DECODE_LAUNCH),
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
        PRECISION=precision, INDIRECT=True, CACHE_DTYPE=_TL_DTYPES[cache.dtype], SLIDING=bool(window),
        **DECODE_LAUNCH,
    )  # fmt: skip
    return out


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


def rope_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    slots: torch.Tensor,
    cache: torch.Tensor | IndirectCache,
    layer: int,
) -> None:
    """Triton twin of ops.apply_rope on q (N, Hq, D) and k (N, Hkv, D), in place (rows may be strided),
    and the rotated k and v (N, Hkv, D) written at `slots` (N,) of layer `layer` of `cache`: a (layers,
    2, slots, Hkv, D) tensor, or an IndirectCache. One kernel for the rotation and the cache's two
    index_copy_."""
    tokens, num_q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    for t in (q, k, v):
        assert t.stride(2) == 1 and t.stride(1) == head_dim
    if isinstance(cache, IndirectCache):
        k_offset, v_offset = cache.offsets(layer)
        tensor, address, indirect, dtype = k, cache.address, True, cache.dtype
    else:
        assert cache.is_contiguous() and cache.shape[-2:] == (kv_heads, head_dim)
        plane = cache.shape[2] * kv_heads * head_dim
        k_offset, v_offset = 2 * layer * plane, (2 * layer + 1) * plane
        tensor, address, indirect, dtype = cache, positions, False, cache.dtype
    assert dtype == k.dtype == v.dtype
    _rope_kernel[(tokens,)](
        q, k, positions, cos_sin, q.stride(0), k.stride(0), num_q_heads, kv_heads,
        v, v.stride(0), slots, tensor, address, k_offset, v_offset,
        HALF=head_dim // 2, HEADS_PAD=_next_pow2(max(num_q_heads, kv_heads)), INDIRECT=indirect,
        CACHE_DTYPE=_TL_DTYPES[dtype],
    )  # fmt: skip


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton twin of ops.silu_and_mul: (N, 2I) -> (N, I)."""
    rows, double = gate_up.shape
    inter = double // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out


# Elements per tile of the sampling kernels; a multiple of 4 (one Philox call per 4 elements).
SAMPLE_BLOCK = 1024
# Sampling programs per multiprocessor that the split aims for, over the whole batch.
SAMPLE_PROGRAMS_PER_SM = 4
# Multiprocessors assumed off CUDA (the interpreter): an H200's, so the split matches the GPU's.
DEFAULT_SM_COUNT = 132


# The sampler's launch beyond BLOCK and the split's aim: Triton's num_warps and num_stages (absent:
# Triton's defaults). `bench/sample_sweep.py` times BLOCK, programs per SM and these on a GPU; the tokens
# are the same under every launch (an entry's noise depends on its index only).
SAMPLE_LAUNCH: dict[str, int] = {}


def sample_splits(
    batch: int,
    vocab: int,
    sm_count: int,
    block: int = SAMPLE_BLOCK,
    programs_per_sm: int = SAMPLE_PROGRAMS_PER_SM,
) -> int:
    """Programs per row for gumbel_sample: about `programs_per_sm` per multiprocessor in all.

    splits = clamp(ceil(programs_per_sm * sm_count / batch), 1, ceil(vocab / block)),
    the upper bound keeping every chunk at least one tile long.
    """
    return max(1, min(_cdiv(programs_per_sm * sm_count, batch), _cdiv(vocab, block)))


def sample_chunks(vocab: int, splits: int, block: int = SAMPLE_BLOCK) -> tuple[int, int]:
    """(chunk, splits used): the row cut into chunks of whole tiles, none of them empty.

    chunk = ceil(ceil(vocab / splits) / block) * block, splits used = ceil(vocab / chunk) <= splits.
    """
    chunk = _cdiv(_cdiv(vocab, splits), block) * block
    return chunk, _cdiv(vocab, chunk)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SM_COUNT


def gumbel_sample(
    logits: torch.Tensor,
    temperature: float,
    seed: torch.Tensor,
    *,
    splits: int | None = None,
    block: int = SAMPLE_BLOCK,
    programs_per_sm: int = SAMPLE_PROGRAMS_PER_SM,
    launch: dict[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of logits (B, V) by Gumbel-max; greedy when temperature == 0.

    Returns (tokens (B,) int64, log-probs (B,) fp32 under softmax(logits / T), T = 1 when greedy).
    `seed` is a one-element int64 device tensor (read on the device, so CUDA graphs may hold it).
    `splits` (programs per row, at most ceil(V / block) used) defaults to sample_splits(B, V,
    the device's multiprocessors), fixed for a given (B, V, device) as CUDA graphs need; the tokens
    do not depend on it, the log-probs only through the order of a float sum. `block` (entries a loop
    iteration, a multiple of 4), `programs_per_sm` and `launch` (num_warps, num_stages; default
    SAMPLE_LAUNCH) change the launch only, never the tokens.
    """
    batch, vocab = logits.shape
    quads_per_row = _cdiv(vocab, 4)
    assert batch * quads_per_row < 2**31, "the Philox counter is int32"
    device = logits.device
    assert block % 4 == 0, "a tile holds whole Philox quads"
    wanted = (
        sample_splits(batch, vocab, _sm_count(device), block, programs_per_sm) if splits is None else splits
    )
    chunk, used = sample_chunks(vocab, wanted, block)
    tokens = torch.empty(batch, dtype=torch.long, device=device)
    logprobs = torch.empty(batch, dtype=torch.float32, device=device)
    part_f = torch.empty((3, batch, used), dtype=torch.float32, device=device)
    part_idx = torch.empty((batch, used), dtype=torch.int32, device=device)
    greedy = temperature == 0
    inv_temperature = 1.0 if greedy else 1.0 / temperature
    _gumbel_sample_partial_kernel[(batch, used)](
        logits, logits.stride(0), vocab, quads_per_row, chunk, inv_temperature, seed,
        part_f[0], part_f[1], part_f[2], part_idx, GREEDY=greedy, BLOCK=block,
        **(launch if launch is not None else SAMPLE_LAUNCH),
    )  # fmt: skip
    _gumbel_sample_combine_kernel[(batch,)](
        logits, logits.stride(0), vocab, used, inv_temperature,
        part_f[0], part_f[1], part_f[2], part_idx, tokens, logprobs,
        SPLITS_PAD=max(16, _next_pow2(used)),
    )  # fmt: skip
    return tokens, logprobs
