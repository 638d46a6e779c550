"""Triton kernels of the native engine's sampler: Gumbel-max sampling with the log-prob of the token drawn.

The Triton twin of the temperature / greedy case of `fulcrum.rollout.sampling.sample_next` (tests compare
them, on the GPU or under TRITON_INTERPRET=1); `sampler.DeviceSampler` calls `gumbel_sample`. Importing
this module needs `triton` (see `kernels.HAVE_TRITON`).

Sampling was bound by the integer multiplies of its Philox4x32-10 noise, so each Philox call serves four
vocabulary entries (all four of its 32-bit outputs), and each row is split over several programs whose
partial results a second small kernel combines: a small batch still fills the GPU, and a large one gets
more warps per SM to hide the multiply latency (487 -> 341 µs a 0.5B decode step on an H200; 306 µs
with the swept launch below).
"""

from __future__ import annotations

import torch

from fulcrum.rollout.native.kernels import HAVE_TRITON, next_pow2

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gumbel_noise(seed, row, quads_per_row, start, quad, lane):
        # Gumbel noise -log(-log u) of the tile's elements 4Q .. 4Q + 3, Q = start // 4 + quad: Philox
        # counter row * ceil(V / 4) + Q, so an element's noise depends on (seed, row, index) only, never
        # on the split. The wrapper keeps batch * ceil(V / 4) < 2^31 (56,536 rows at V = 151936), so the
        # counter fits in int32, as tl.rand's does.
        counter = (row * quads_per_row + start // 4).to(tl.int32) + quad
        r0, r1, r2, r3 = tl.randint4x(seed, counter)
        bits = tl.where(
            lane == 0,
            r0[:, None],
            tl.where(lane == 1, r1[:, None], tl.where(lane == 2, r2[:, None], r3[:, None])),
        )
        u = tl.uint_to_uniform_float(bits)  # tl.rand's conversion: [0, 1)
        u = tl.minimum(tl.maximum(u, 1e-20), 0.99999994)
        return -tl.log(-tl.log(u))

    @triton.jit
    def _scaled_tile(logits_ptr, row, stride_row, idx, ok, inv_temperature):
        # The tile's logits / T in float32, -inf past the chunk's end.
        x = tl.load(logits_ptr + row * stride_row + idx, mask=ok, other=float("-inf"))
        return x.to(tl.float32) * inv_temperature

    @triton.jit
    def _keep_best(score, ok, idx, best_val, best_idx):
        # Each lane's best score so far and its index; strict, so a lane keeps its lowest index among equal
        # scores.
        score = tl.where(ok, score, float("-inf"))
        better = score > best_val
        return tl.where(better, score, best_val), tl.where(better, idx, best_idx)

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
        # of it. bench/sample_sweep.py's best launch (tiles of 512, 16 programs per SM) took it to 306.
        # Keeping the softmax's max and sum per program (one exp an element, not two) gained nothing;
        # nor did reading the chunk twice so that the tiles too far below its max to win skip their
        # noise: sampling took 114.5 µs a decode step on SmolLM2-135M's real logits against 107.0 in
        # one pass (H200); only synthetic peaked logits favoured it.
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
            x = _scaled_tile(logits_ptr, row, stride_row, idx, ok, inv_temperature)
            new_max = tl.maximum(run_max, x)
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - safe) + tl.exp(x - safe)
            run_max = new_max
            if GREEDY:
                score = x
            else:
                score = x + _gumbel_noise(seed, row, quads_per_row, start, quad, lane)
            best_val, best_idx = _keep_best(score, ok, idx, best_val, best_idx)
        chunk_max = tl.max(run_max)
        safe_max = tl.where(chunk_max == float("-inf"), 0.0, chunk_max)
        chunk_sum = tl.sum(run_sum * tl.exp(run_max - safe_max))
        chunk_best = tl.max(best_val)
        slot = row * tl.num_programs(1) + part
        tl.store(part_max_ptr + slot, chunk_max)
        tl.store(part_sum_ptr + slot, chunk_sum)
        tl.store(part_best_ptr + slot, chunk_best)
        tl.store(part_idx_ptr + slot, tl.min(tl.where(best_val == chunk_best, best_idx, vocab)))

    @triton.jit(do_not_specialize=["splits"])
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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Elements per tile of the sampling kernels; a multiple of 4 (one Philox call per 4 elements).
SAMPLE_BLOCK = 512
# Sampling programs per multiprocessor that the split aims for, over the whole batch.
SAMPLE_PROGRAMS_PER_SM = 16
# Multiprocessors assumed off CUDA (the interpreter): an H200's, so the split matches the GPU's.
DEFAULT_SM_COUNT = 132


# The sampler's launch beyond BLOCK and the split's aim: Triton's num_warps and num_stages (absent:
# Triton's defaults). `bench/sample_sweep.py` times BLOCK, programs per SM and these on a GPU; the tokens
# are the same under every launch (an entry's noise depends on its index only). These defaults (with
# BLOCK 512 and 16 programs per SM) are the sweep's fastest launch common to both shapes: 1.13x (0.5B,
# 512 x 151,936) and 1.12x (SmolLM2, 1,024 x 49,152) over BLOCK 1024, 4 programs per SM and Triton's
# launch (H200, 2026-12-02).
SAMPLE_LAUNCH: dict[str, int] = {"num_warps": 4, "num_stages": 2}


def _tiling(block: int | None, programs_per_sm: int | None) -> tuple[int, int]:
    """(block, programs per SM): the ones given, else the module's SAMPLE_BLOCK and SAMPLE_PROGRAMS_PER_SM
    as they are at the call (a benchmark may set them)."""
    return (
        SAMPLE_BLOCK if block is None else block,
        SAMPLE_PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm,
    )


def sample_splits(
    batch: int,
    vocab: int,
    sm_count: int,
    block: int | None = None,
    programs_per_sm: int | None = None,
) -> int:
    """Programs per row for gumbel_sample: about `programs_per_sm` per multiprocessor in all.

    splits = clamp(ceil(programs_per_sm * sm_count / batch), 1, ceil(vocab / block)),
    the upper bound keeping every chunk at least one tile long.
    """
    block, programs_per_sm = _tiling(block, programs_per_sm)
    return max(1, min(_cdiv(programs_per_sm * sm_count, batch), _cdiv(vocab, block)))


def sample_chunks(vocab: int, splits: int, block: int | None = None) -> tuple[int, int]:
    """(chunk, splits used): the row cut into chunks of whole tiles, none of them empty.

    chunk = ceil(ceil(vocab / splits) / block) * block, splits used = ceil(vocab / chunk) <= splits.
    """
    block, _ = _tiling(block, None)
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
    block: int | None = None,
    programs_per_sm: int | None = None,
    launch: dict[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of logits (B, V) by Gumbel-max; greedy when temperature == 0.

    Returns (tokens (B,) int64, log-probs (B,) fp32 under softmax(logits / T), T = 1 when greedy).
    `seed` is a one-element int64 device tensor (read on the device, so CUDA graphs may hold it).
    `splits` (programs per row, at most ceil(V / block) used) defaults to sample_splits(B, V,
    the device's multiprocessors), fixed for a given (B, V, device) as CUDA graphs need; the tokens
    do not depend on it, the log-probs only through the order of a float sum. `block` (entries a loop
    iteration, a multiple of 4; SAMPLE_BLOCK when None), `programs_per_sm` (SAMPLE_PROGRAMS_PER_SM when
    None) and `launch` (over SAMPLE_LAUNCH: num_warps, num_stages) change how the work is laid out,
    never the tokens. The module's defaults are read at each call, so a benchmark may set them.
    """
    block, programs_per_sm = _tiling(block, programs_per_sm)
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
    # One compiled variant of each kernel whatever the batch: Triton specialises a kernel on its
    # integer arguments (== 1, divisible by 16) and on its pointers' 16-byte alignment, and compiles
    # each new variant on first use (tenths of a second, in the middle of a rollout: the prefill's
    # first tokens and a shrinking decode batch meet new sizes in any step). So the partials are four
    # separate (aligned) allocations, `used` is not specialised, and the combine's width depends on
    # the vocabulary only (`chunk` is a whole number of tiles, divisible by 16 whatever the split).
    part_max, part_sum, part_best = (
        torch.empty((batch, used), dtype=torch.float32, device=device) for _ in range(3)
    )
    part_idx = torch.empty((batch, used), dtype=torch.int32, device=device)
    greedy = temperature == 0
    inv_temperature = 1.0 if greedy else 1.0 / temperature
    kernel_launch = {**SAMPLE_LAUNCH, **(launch or {})}
    _gumbel_sample_partial_kernel[(batch, used)](
        logits, logits.stride(0), vocab, quads_per_row, chunk, inv_temperature, seed,
        part_max, part_sum, part_best, part_idx, GREEDY=greedy, BLOCK=block, **kernel_launch,
    )  # fmt: skip
    _gumbel_sample_combine_kernel[(batch,)](
        logits, logits.stride(0), vocab, used, inv_temperature,
        part_max, part_sum, part_best, part_idx, tokens, logprobs,
        SPLITS_PAD=max(16, next_pow2(_cdiv(vocab, block))),
    )  # fmt: skip
    return tokens, logprobs
