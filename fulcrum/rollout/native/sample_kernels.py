"""Triton kernels of the native engine's sampler: one token per row by the inverse CDF, with its log-prob.

The Triton twin of the temperature / greedy case of `fulcrum.rollout.sampling.sample_next` (tests compare
their distributions, on the GPU or under TRITON_INTERPRET=1); `sampler.DeviceSampler` calls
`sample_tokens`. Importing this module needs `triton` (see `kernels.HAVE_TRITON`).

Why the inverse CDF and not Gumbel-max: Gumbel-max draws a Philox uniform and takes two logs for every
vocabulary entry, so its arithmetic, not the read of the logits, bounds the kernel. The inverse CDF needs
one uniform a row: a first pass reduces each tile of BLOCK entries to its max and its softmax sum (one exp
an entry), a second finds the tile where the row's cumulative mass crosses u * Z and, in that tile alone,
the entry, so the sampler costs about one read of the logits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fulcrum.rollout.native.kernels import HAVE_TRITON, next_pow2

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _sample_tile_stats_kernel(
        logits_ptr, stride_row, vocab, tiles, chunk, inv_temperature, tile_max_ptr, tile_sum_ptr,
        BLOCK: tl.constexpr, GROUP: tl.constexpr,
    ):  # fmt: skip
        # Program (row, part) walks the tiles of the chunk [part * chunk, (part + 1) * chunk) of its row
        # (chunk a whole number of tiles), GROUP tiles a loop iteration, and stores, per tile t of BLOCK
        # entries,
        #     m_t = max_i x_i / T,   s_t = sum_i exp(x_i / T - m_t)   (s_t = 0 when the tile is all -inf).
        # A tile's figures depend on its entries only, never on the split; GROUP (which puts more loads in
        # flight between the reductions) and num_warps may change the order of a tile's sum (fp32 rounding).
        row = tl.program_id(0).to(tl.int64)
        lo = tl.program_id(1) * chunk
        hi = tl.minimum(lo + chunk, vocab)
        cols = tl.arange(0, BLOCK)[None, :]
        for start in range(lo, hi, BLOCK * GROUP):
            tile_start = start + tl.arange(0, GROUP) * BLOCK
            idx = tile_start[:, None] + cols
            x = tl.load(logits_ptr + row * stride_row + idx, mask=idx < hi, other=float("-inf"))
            x = x.to(tl.float32) * inv_temperature
            tile_max = tl.max(x, 1)
            safe = tl.where(tile_max == float("-inf"), 0.0, tile_max)
            tile_sum = tl.sum(tl.exp(x - safe[:, None]), 1)
            slot = row * tiles + tile_start // BLOCK
            mine = tile_start < hi  # the group's tiles past the chunk belong to the next program
            tl.store(tile_max_ptr + slot, tile_max, mask=mine)
            tl.store(tile_sum_ptr + slot, tile_sum, mask=mine)

    @triton.jit
    def _sample_pick_kernel(
        logits_ptr, stride_row, vocab, tiles, inv_temperature, seed_ptr,
        tile_max_ptr, tile_sum_ptr, tokens_ptr, logprobs_ptr, ids_ptr, positions_ptr, context_lens_ptr,
        GREEDY: tl.constexpr, BLOCK: tl.constexpr, TILES_PAD: tl.constexpr, ADVANCE: tl.constexpr,
    ):  # fmt: skip
        # One program per row. Over the tiles: M = max_t m_t, w_t = s_t exp(m_t - M) (tile t's mass
        # against M), Z = sum_t w_t, C_t = w_0 + ... + w_t. Sampled: target = u Z with u ~ U[0, 1) from
        # Philox(seed, counter = row); the tile is the first t with C_t > target, then in that tile the
        # first entry i whose running sum of exp(x_i / T - M) exceeds target - C_{t-1}: entry i is drawn
        # with probability exp(x_i / T - M) / Z, the tempered softmax (up to fp32 rounding at the
        # boundaries). Where rounding puts the target past the last mass, the last entry with mass is
        # taken. Greedy: the lowest tile holding M and its lowest entry equal to M (torch.argmax's
        # tie-break), T = 1. log-prob = x_token / T - M - log Z. ADVANCE: the row's decode state moves on
        # here too (next input = the token, position and context length + 1): no kernel of its own.
        row = tl.program_id(0).to(tl.int64)
        t_idx = tl.arange(0, TILES_PAD)
        t_ok = t_idx < tiles
        m = tl.load(tile_max_ptr + row * tiles + t_idx, mask=t_ok, other=float("-inf"))
        s = tl.load(tile_sum_ptr + row * tiles + t_idx, mask=t_ok, other=0.0)
        row_max = tl.max(m, 0)
        safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        w = s * tl.exp(m - safe_max)
        total = tl.sum(w, 0)
        cols = tl.arange(0, BLOCK)
        if GREEDY:
            tile = tl.min(tl.where(t_ok & (m == row_max), t_idx, TILES_PAD), 0)
            idx = tile * BLOCK + cols
            x = tl.load(logits_ptr + row * stride_row + idx, mask=idx < vocab, other=float("-inf"))
            x = x.to(tl.float32) * inv_temperature
            token = tl.min(tl.where(x == row_max, idx, vocab), 0)
        else:
            target = tl.rand(tl.load(seed_ptr), row.to(tl.int32)) * total
            cum = tl.cumsum(w, 0)
            last_tile = tl.max(tl.where(w > 0, t_idx, 0), 0)
            tile = tl.minimum(tl.sum((cum <= target).to(tl.int32), 0), last_tile)
            before = tl.max(tl.where(t_idx < tile, cum, 0.0), 0)
            idx = tile * BLOCK + cols
            x = tl.load(logits_ptr + row * stride_row + idx, mask=idx < vocab, other=float("-inf"))
            p = tl.exp(x.to(tl.float32) * inv_temperature - safe_max)
            inside = tl.cumsum(p, 0)
            last = tl.max(tl.where(p > 0, cols, 0), 0)
            pick = tl.minimum(tl.sum((inside <= target - before).to(tl.int32), 0), last)
            token = tile * BLOCK + pick
        picked = tl.load(logits_ptr + row * stride_row + token).to(tl.float32) * inv_temperature
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(logprobs_ptr + row, picked - row_max - tl.log(total))
        if ADVANCE:
            tl.store(ids_ptr + row, token.to(tl.int64))
            tl.store(positions_ptr + row, tl.load(positions_ptr + row) + 1)
            tl.store(context_lens_ptr + row, tl.load(context_lens_ptr + row) + 1)


class DecodeState(NamedTuple):
    """A decode step's per-row state on the device, (B,) each: the next step's input token (int64), its
    position (int64) and the context length it attends over (int32). After sampling, row r has
    input_ids[r] = its token, positions[r] + 1, context_lens[r] + 1."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    context_lens: torch.Tensor


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Entries per tile of the sampling kernels (a power of two): the first pass's unit, the second pass's scan.
SAMPLE_BLOCK = 512
# First-pass programs per multiprocessor that the split aims for, over the whole batch; with the first
# pass's launch (below) a tuned value: `bench/tools/sample_sweep.py` times the alternatives on a GPU.
SAMPLE_PROGRAMS_PER_SM = 16
# Multiprocessors assumed off CUDA (the interpreter): a data-centre GPU's 132, so that tests under the
# interpreter split the rows as the GPU does.
DEFAULT_SM_COUNT = 132


# The first pass's launch beyond BLOCK and the split's aim: GROUP (tiles a loop iteration), Triton's
# num_warps and num_stages (absent: Triton's defaults). `bench/tools/sample_sweep.py` times BLOCK,
# programs per SM and these on a GPU; the split never changes the tokens, the others only where a tile's
# sum adds its entries in another order (fp32 rounding at a boundary).
SAMPLE_LAUNCH: dict[str, int] = {"GROUP": 4, "num_warps": 1, "num_stages": 2}


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
    """First-pass programs per row for sample_tokens: about `programs_per_sm` per multiprocessor in all.

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


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    seed: torch.Tensor,
    *,
    splits: int | None = None,
    block: int | None = None,
    programs_per_sm: int | None = None,
    launch: dict[str, int] | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    advance: DecodeState | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of logits (B, V) from softmax(logits / T); greedy when temperature == 0.

    Returns (tokens (B,) int64, log-probs (B,) fp32 under softmax(logits / T), T = 1 when greedy).
    `seed` is a one-element int64 device tensor (read on the device, so CUDA graphs may hold it); row r
    draws its uniform from Philox counter r under it. `splits` (first-pass programs per row, at most
    ceil(V / block) used) defaults to sample_splits(B, V, the device's multiprocessors), fixed for a given
    (B, V, device) as CUDA graphs need; neither the tokens nor the log-probs depend on it. `block` (entries
    a tile, a power of two; SAMPLE_BLOCK when None) sets the tiles, whose sums the search adds up: a draw
    within fp32 rounding of an entry's boundary may fall on the other side under another block.
    `programs_per_sm` (SAMPLE_PROGRAMS_PER_SM when None) and `launch` (over SAMPLE_LAUNCH: GROUP,
    num_warps, num_stages) change how the first pass is laid out; GROUP and num_warps may change the order
    of a tile's sum, so, as with another block, a draw within rounding of a boundary may move. The module's defaults are read
    at each call, so a benchmark may set them. `out`: contiguous (B,) int64 and float32 tensors to write
    the tokens and log-probs into (returned); `advance`: a decode step's state rows, moved on in the same
    kernel (`DecodeState`).
    """
    block, programs_per_sm = _tiling(block, programs_per_sm)
    assert block & (block - 1) == 0, "a tile is a power of two entries"
    batch, vocab = logits.shape
    device = logits.device
    wanted = (
        sample_splits(batch, vocab, _sm_count(device), block, programs_per_sm) if splits is None else splits
    )
    chunk, used = sample_chunks(vocab, wanted, block)
    tiles = _cdiv(vocab, block)
    if out is None:
        out = (
            torch.empty(batch, dtype=torch.long, device=device),
            torch.empty(batch, dtype=torch.float32, device=device),
        )
    tokens, logprobs = out
    assert tokens.is_contiguous() and logprobs.is_contiguous() and len(tokens) == len(logprobs) == batch
    state = advance if advance is not None else DecodeState(tokens, tokens, logprobs)
    # One compiled variant of each kernel whatever the batch: Triton specialises a kernel on its integer
    # arguments (== 1, divisible by 16) and on its pointers' 16-byte alignment, and compiles each new
    # variant on first use (tenths of a second, in the middle of a rollout: the prefill's first tokens and
    # a shrinking decode batch meet new sizes in any step). No argument depends on the batch: the tile
    # figures are two separate (aligned) allocations of `tiles` a row, `chunk` is a whole number of tiles.
    tile_max, tile_sum = (torch.empty((batch, tiles), dtype=torch.float32, device=device) for _ in range(2))
    greedy = temperature == 0
    inv_temperature = 1.0 if greedy else 1.0 / temperature
    _sample_tile_stats_kernel[(batch, used)](
        logits, logits.stride(0), vocab, tiles, chunk, inv_temperature, tile_max, tile_sum,
        BLOCK=block, **{**SAMPLE_LAUNCH, **(launch or {})},
    )  # fmt: skip
    _sample_pick_kernel[(batch,)](
        logits, logits.stride(0), vocab, tiles, inv_temperature, seed, tile_max, tile_sum, tokens, logprobs,
        state.input_ids, state.positions, state.context_lens,
        GREEDY=greedy, BLOCK=block, TILES_PAD=max(16, next_pow2(tiles)), ADVANCE=advance is not None,
    )  # fmt: skip
    return tokens, logprobs
