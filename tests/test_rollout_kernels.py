"""The native engine's Triton kernels against their torch twins (fulcrum/rollout/native/ops.py).

Runs on a CUDA device, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1` with triton
installed); skipped otherwise (CI has no triton: the CPU engine uses the torch twins, tested elsewhere).
Triton 3.6's interpreter takes a one-element array's index with int(), which NumPy 2.4 refuses ("only
0-dimensional arrays can be converted to Python scalars"): under the interpreter, NumPy below 2.4.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import pytest
import torch

from fulcrum.rollout.native import ops
from fulcrum.rollout.native.kernels import HAVE_TRITON

ON_CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(
    not HAVE_TRITON or not (ON_CUDA or INTERPRETED),
    reason="needs triton and a CUDA device (or TRITON_INTERPRET=1)",
)
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
DTYPES = [torch.float32, torch.bfloat16] if ON_CUDA else [torch.float32]


def tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


# (launch, rows longest first)
SPLIT_LAUNCHES = [
    (None, False),
    ({"TILE": 16, "SPLITS": 3}, False),
    ({"TILE": 64, "SPLITS": 4}, False),
    ({"TILE": 16, "SPLITS": 1}, True),
    ({"TILE": 16, "SPLITS": 3}, True),
]
SPLIT_IDS = ["one-program", "splits-3-of-16", "splits-4-of-64", "longest-first", "longest-first-splits-3"]


@pytest.mark.parametrize(("launch", "longest_first"), SPLIT_LAUNCHES, ids=SPLIT_IDS)
@pytest.mark.parametrize("window", [None, 20], ids=["full", "sliding-window"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_attention_matches_gather_sdpa(dtype, window, launch, longest_first):
    """With a window of 20 the contexts of 70 and 112 tokens start inside a tile and a block. Split
    over several programs a context's tiles are shared out unevenly, and some splits read nothing (a
    one-token context, four splits of one 64-token tile). Longest first (`decode_order` given), the
    programs take the rows in the reverse of the batch's order, and each row's output still lands in its
    own row."""
    from fulcrum.rollout.native.decode_grid import decode_order
    from fulcrum.rollout.native.kernels import paged_decode_attention

    torch.manual_seed(0)
    batch, heads, kv_heads, dim, block = 5, 14, 2, 64, 16
    k_cache = torch.randn(40 * block, kv_heads, dim, device=DEVICE, dtype=dtype)
    v_cache = torch.randn(40 * block, kv_heads, dim, device=DEVICE, dtype=dtype)
    tables = torch.randperm(39, device=DEVICE)[: batch * 7].view(batch, 7).int() + 1
    context = torch.tensor([1, 15, 16, 70, 112], device=DEVICE, dtype=torch.int32)
    q = torch.randn(batch, heads, dim, device=DEVICE, dtype=dtype)
    expected = ops.decode_attention_gather(q, k_cache, v_cache, tables, context, 112, block, 0.125, window)
    order = decode_order(context) if longest_first else None
    got = paged_decode_attention(
        q, k_cache, v_cache, tables, context, block, 0.125, window=window, launch=launch, order=order
    )
    torch.testing.assert_close(got, expected, **tol(dtype))


@pytest.mark.parametrize("order", [0, 1], ids=["batch-order", "longest-first"])
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode_attention_over_an_indirect_cache_matches_gather_sdpa(monkeypatch, splits, order):
    """The cache's address read on the device (graphs that survive sleep), split or not, the rows taken
    in the batch's order or longest first."""
    from fulcrum.rollout.native import decode_grid, kernels

    monkeypatch.setitem(decode_grid.DECODE_LAUNCH, "SPLITS", splits)
    monkeypatch.setitem(decode_grid.DECODE_LAUNCH, "TILE", 16)
    torch.manual_seed(1)
    batch, heads, kv_heads, dim, block, layers = 3, 14, 2, 64, 16, 2
    cache = torch.randn(layers, 2, 20 * block, kv_heads, dim, device=DEVICE, dtype=torch.float32)
    indirect = kernels.IndirectCache(tuple(cache.shape), cache.dtype, cache.device)
    indirect.point_to(cache)
    tables = torch.randperm(19, device=DEVICE)[: batch * 5].view(batch, 5).int() + 1
    context = torch.tensor([3, 40, 77], device=DEVICE, dtype=torch.int32)
    q = torch.randn(batch, heads, dim, device=DEVICE)
    expected = ops.decode_attention_gather(q, cache[1, 0], cache[1, 1], tables, context, 80, block, 0.125)
    rows = decode_grid.decode_order(context) if order else None
    got = kernels.paged_decode_attention_indirect(q, indirect, 1, tables, context, block, 0.125, order=rows)
    torch.testing.assert_close(got, expected, **tol(torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_norms_rope_and_swiglu_match_torch(dtype):
    from fulcrum.rollout.native import kernels

    torch.manual_seed(0)
    x = torch.randn(6, 96, device=DEVICE, dtype=dtype)
    residual = torch.randn(6, 96, device=DEVICE, dtype=dtype)
    weight = torch.randn(96, device=DEVICE, dtype=dtype)
    expected_out, expected_residual = ops.add_rms_norm(x, residual, weight, 1e-6)
    got_out = kernels.add_rms_norm(x, residual, weight, 1e-6)  # residual updated in place
    torch.testing.assert_close(got_out, expected_out, **tol(dtype))
    torch.testing.assert_close(residual, expected_residual, **tol(dtype))
    torch.testing.assert_close(
        kernels.add_rms_norm(x, None, weight, 1e-6), ops.rms_norm(x, weight, 1e-6), **tol(dtype)
    )
    # (1 + w) norms (Gemma, Qwen3.5): the weights stored as w - 1, the product taken in fp32
    torch.testing.assert_close(
        kernels.add_rms_norm(x, None, weight, 1e-6, 1.0), ops.rms_norm(x, weight, 1e-6, 1.0), **tol(dtype)
    )
    summed = residual.clone()
    expected_out, expected_residual = ops.add_rms_norm(x, summed, weight, 1e-6, 1.0)
    torch.testing.assert_close(kernels.add_rms_norm(x, summed, weight, 1e-6, 1.0), expected_out, **tol(dtype))
    torch.testing.assert_close(summed, expected_residual, **tol(dtype))

    tokens, heads, kv_heads, dim = 7, 14, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=DEVICE, dtype=dtype)
    positions = torch.tensor([0, 1, 5, 9, 3, 100, 2], device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=DEVICE).float() / dim))
    cos_sin = ops.rope_cos_sin(inv_freq, 128, 1.0)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    expected_q, expected_k = ops.apply_rope(q, positions, cos_sin), ops.apply_rope(k, positions, cos_sin)
    cache = torch.zeros(1, 2, tokens, kv_heads, dim, device=DEVICE, dtype=dtype)
    slots = torch.arange(tokens, device=DEVICE)
    kernels.rope_and_store_kv(q, k, v, positions, cos_sin, slots, cache, 0)
    torch.testing.assert_close(q, expected_q, **tol(dtype))
    torch.testing.assert_close(k, expected_k, **tol(dtype))
    torch.testing.assert_close(cache[0, 0], expected_k, **tol(dtype))

    gate_up = torch.randn(4, 2 * 300, device=DEVICE, dtype=dtype)
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), ops.silu_and_mul(gate_up), **tol(dtype))


@pytest.mark.parametrize("rotary", [64, 16, 24], ids=["whole-heads", "partial-16-of-64", "partial-24-of-64"])
@pytest.mark.parametrize("indirect", [False, True], ids=["cache-tensor", "indirect-cache"])
def test_rope_and_store_kv_rotates_and_writes_the_cache_like_rope_then_index_copy(indirect, rotary):
    """The fused kernel leaves q and k rotated in place and k, v at their slots of the layer's planes,
    exactly as the rotation (ops.apply_rope) then the cache's index_copy_ do; other slots and layers
    untouched. A table narrower than the head (partial RoPE, Qwen3.5's quarter) rotates the first dims
    and passes the rest through, in q and in the cached k (24: a half-width of 12, no power of two)."""
    from fulcrum.rollout.native import kernels

    torch.manual_seed(0)
    tokens, heads, kv_heads, dim, layers, slots = 5, 14, 2, 64, 3, 40
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=DEVICE)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    positions = torch.tensor([0, 7, 3, 30, 12], device=DEVICE)
    slot_mapping = torch.tensor([4, 17, 0, 39, 22], device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary, 2, device=DEVICE).float() / rotary))
    cos_sin = ops.rope_cos_sin(inv_freq, 64, 1.0)
    assert cos_sin.shape[-1] == rotary
    cache = torch.randn(layers, 2, slots, kv_heads, dim, device=DEVICE)
    expected_cache, projected = cache.clone(), qkv.clone()
    expected_q, expected_k = ops.apply_rope(q, positions, cos_sin), ops.apply_rope(k, positions, cos_sin)
    expected_cache[1, 0].index_copy_(0, slot_mapping, expected_k)
    expected_cache[1, 1].index_copy_(0, slot_mapping, v)
    target = cache
    if indirect:
        target = kernels.IndirectCache(tuple(cache.shape), cache.dtype, cache.device)
        target.point_to(cache)
    kernels.rope_and_store_kv(q, k, v, positions, cos_sin, slot_mapping, target, 1)
    torch.testing.assert_close(q, expected_q, **tol(torch.float32))
    torch.testing.assert_close(k, expected_k, **tol(torch.float32))
    torch.testing.assert_close(cache, expected_cache, **tol(torch.float32))
    if rotary < dim:  # the tail of each head as projected, in q, k and the cached k
        assert torch.equal(
            q[..., rotary:], projected[:, : heads * dim].view(tokens, heads, dim)[..., rotary:]
        )
        assert torch.equal(cache[1, 0, slot_mapping, :, rotary:], expected_k[..., rotary:])


def test_sampler_follows_the_tempered_distribution_and_greedy_is_argmax():
    from fulcrum.rollout.native.sample_kernels import sample_tokens

    seed = torch.tensor([123], dtype=torch.int64, device=DEVICE)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], device=DEVICE).repeat(4000, 1)
    tokens, logprobs = sample_tokens(logits, 0.5, seed)
    expected = (logits[0] / 0.5).softmax(-1)
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    torch.testing.assert_close(freq, expected, atol=0.02, rtol=0)
    torch.testing.assert_close(logprobs, expected.log()[tokens])
    wide = torch.randn(4, 5000, device=DEVICE)
    tokens, logprobs = sample_tokens(wide, 0.0, seed)
    assert tokens.tolist() == wide.argmax(-1).tolist()
    torch.testing.assert_close(logprobs, wide.log_softmax(-1).gather(-1, tokens[:, None])[:, 0])
    a, _ = sample_tokens(wide, 1.0, torch.tensor([7], device=DEVICE))
    b, _ = sample_tokens(wide, 1.0, torch.tensor([7], device=DEVICE))
    c, _ = sample_tokens(wide, 1.0, torch.tensor([8], device=DEVICE))
    assert a.tolist() == b.tolist()  # the seed decides the sample
    assert a.tolist() != c.tolist()


def philox_uniforms(seed: int, counters: np.ndarray) -> np.ndarray:
    """tl.randint4x(seed, counters) through tl.rand's conversion to [0, 1): (N,) int -> (N, 4) fp32.

    Philox4x32-10 on (counter, 0, 0, 0) with key (seed mod 2^32, seed // 2^32); the uniform of a
    32-bit output x read as int32 is (x if x >= 0 else -x - 1) * 4.6566127342e-10. tl.rand keeps the
    first of the four.
    """
    low = np.uint64(0xFFFFFFFF)
    c0 = counters.astype(np.uint64)
    c1, c2, c3 = np.zeros_like(c0), np.zeros_like(c0), np.zeros_like(c0)
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
    for _ in range(10):
        a, b = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = (b >> np.uint64(32)) ^ c1 ^ k0, b & low, (a >> np.uint64(32)) ^ c3 ^ k1, a & low
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & low, (k1 + np.uint64(0xBB67AE85)) & low
    signed = np.stack([c0, c1, c2, c3], axis=1).astype(np.uint32).view(np.int32).astype(np.int64)
    magnitude = np.where(signed < 0, -signed - 1, signed)
    return magnitude.astype(np.float32) * np.float32(4.6566127342e-10)


def reference_inverse_cdf(logits: torch.Tensor, temperature: float, seed: int) -> list[int]:
    """In float64, per row r: the first index whose cumulative softmax(logits / T) exceeds u_r, the
    first Philox output of counter r under `seed`."""
    u = philox_uniforms(seed, np.arange(logits.shape[0]))[:, 0].astype(np.float64)
    cdf = (logits.double().cpu() / temperature).softmax(-1).cumsum(-1).numpy()
    return [int((row <= u_r).sum()) for row, u_r in zip(cdf, u, strict=True)]


def test_sampler_is_the_inverse_cdf_of_one_philox_uniform_per_row():
    """V = 5003 ends mid-tile; 40 rows of spread logits, so the draws land in many tiles."""
    from fulcrum.rollout.native.sample_kernels import sample_tokens

    torch.manual_seed(1)
    logits = torch.randn(40, 5003, device=DEVICE) * 3
    tokens, logprobs = sample_tokens(logits, 0.7, torch.tensor([2**33 + 5], device=DEVICE))
    assert tokens.tolist() == reference_inverse_cdf(logits, 0.7, 2**33 + 5)
    assert len(set(t // 512 for t in tokens.tolist())) > 5
    expected = (logits / 0.7).log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, expected)


@pytest.mark.parametrize("temperature", [0.8, 0.0], ids=["sampled", "greedy"])
def test_sampler_tokens_do_not_depend_on_the_split_of_a_row(temperature):
    """V = 5003 in 1, 2, 3 or 5 chunks of whole 1024-entry tiles, walked 1, 2 or 4 tiles at a time; V = 2050
    (not a multiple of 4), one row; then in tiles of other sizes (whose sums the search adds in another order: a draw within fp32
    rounding of a boundary could move, none of these does)."""
    from fulcrum.rollout.native.sample_kernels import SAMPLE_LAUNCH, sample_chunks, sample_tokens

    torch.manual_seed(2)
    seed = torch.tensor([99], device=DEVICE)
    for rows, vocab, splits in [(3, 5003, (1, 2, 3, 5)), (1, 2050, (1, 2, 3))]:
        tiles = {"block": 1024}
        assert [sample_chunks(vocab, s, **tiles)[1] for s in splits] == list(splits)  # each count used as is
        logits = torch.randn(rows, vocab, device=DEVICE)
        base_tokens, base_logprobs = sample_tokens(logits, temperature, seed, **tiles)
        for s in splits:
            # 2 or 4 tiles a loop iteration: a group that runs past its chunk's end stores nothing there
            for group in (1, 2, 4):
                launch = {"launch": {"GROUP": group}}
                tokens, logprobs = sample_tokens(logits, temperature, seed, splits=s, **tiles, **launch)
                assert tokens.tolist() == base_tokens.tolist(), (s, group)
                exact = group == SAMPLE_LAUNCH["GROUP"]  # another may add a tile's entries in another order
                torch.testing.assert_close(logprobs, base_logprobs, atol=0 if exact else 1e-6, rtol=0)
        # the launch bench/tools/sample_sweep.py tunes: tiles of 512 or 2048 entries, programs per SM
        for launch in ({"block": 512}, {"block": 2048, "programs_per_sm": 16}):
            tokens, logprobs = sample_tokens(logits, temperature, seed, **launch)
            assert tokens.tolist() == base_tokens.tolist(), launch
            torch.testing.assert_close(logprobs, base_logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [0.8, 0.0], ids=["sampled", "greedy"])
def test_sampler_writes_into_given_rows_and_moves_the_decode_state_on(temperature):
    """`out=` and `advance=` (what a decode step passes): the same tokens and log-probs as a plain call,
    written into the given rows of larger buffers; each row's next input is its token, its position and
    context length one more; the rows past the batch untouched."""
    from fulcrum.rollout.native.sample_kernels import DecodeState, sample_tokens

    torch.manual_seed(4)
    logits = torch.randn(6, 3001, device=DEVICE) * 2
    seed = torch.tensor([17], device=DEVICE)
    tokens, logprobs = sample_tokens(logits, temperature, seed)
    out_tokens = torch.full((2, 8), -1, dtype=torch.long, device=DEVICE)
    out_logprobs = torch.full((2, 8), 9.0, device=DEVICE)
    ids = torch.full((8,), -1, dtype=torch.long, device=DEVICE)
    positions = torch.arange(8, device=DEVICE) * 10
    context_lens = (torch.arange(8, device=DEVICE) * 10 + 1).int()
    state = DecodeState(ids[:6], positions[:6], context_lens[:6])
    returned = sample_tokens(
        logits, temperature, seed, out=(out_tokens[1, :6], out_logprobs[1, :6]), advance=state
    )
    assert returned[0].data_ptr() == out_tokens[1].data_ptr()
    assert out_tokens[1, :6].tolist() == tokens.tolist() == ids[:6].tolist()
    torch.testing.assert_close(out_logprobs[1, :6], logprobs, atol=0, rtol=0)
    assert out_tokens[0].tolist() == [-1] * 8 and out_tokens[1, 6:].tolist() == [-1, -1]
    assert out_logprobs[1, 6:].tolist() == [9.0, 9.0] and ids[6:].tolist() == [-1, -1]
    assert positions.tolist() == [i * 10 + 1 for i in range(6)] + [60, 70]
    assert context_lens.tolist() == [i * 10 + 2 for i in range(6)] + [61, 71]
    assert context_lens.dtype == torch.int32


def test_sampler_over_tiles_masked_to_minus_inf_gives_finite_logprobs():
    """Tiles whose every logit is masked out (-inf) add nothing to the softmax and hold no token: their sum
    is taken against a finite stand-in max, where exp(-inf - -inf) would make the row's log-probs NaN, and
    the search steps over them. The first 1000 and the last 2003 entries of 5003 are -inf, in 1 chunk
    and in 3 of 2048."""
    from fulcrum.rollout.native.sample_kernels import sample_tokens

    torch.manual_seed(3)
    masked = torch.randn(16, 5003, device=DEVICE) * 3
    masked[:, 3000:] = float("-inf")
    masked[:, :1000] = float("-inf")
    for temperature, seed in [(1.0, 5), (0.7, 11), (0.0, 0)]:
        expected_logprobs = (masked / (temperature or 1.0)).log_softmax(-1)
        if temperature:
            reference = reference_inverse_cdf(masked, temperature, seed)
        else:
            reference = masked.argmax(-1).tolist()
        for splits in (1, 3):
            tokens, logprobs = sample_tokens(
                masked, temperature, torch.tensor([seed], device=DEVICE), splits=splits, block=1024
            )
            assert tokens.tolist() == reference, (temperature, splits)
            assert ((tokens >= 1000) & (tokens < 3000)).all()
            torch.testing.assert_close(logprobs, expected_logprobs.gather(-1, tokens[:, None])[:, 0])


def test_sampler_over_a_5003_entry_vocabulary_follows_the_tempered_distribution():
    """The mass sits on both sides of tile edges (511 | 512, 1023 | 1024, 3071 | 3072) and in the last,
    partial tile (5000, 5002). A misplaced tile boundary or an off-by-one in either search would give an
    entry its neighbour's frequency, or none."""
    from fulcrum.rollout.native.sample_kernels import sample_tokens

    hot = torch.tensor([0, 511, 512, 1023, 1024, 3071, 3072, 5000, 5002], device=DEVICE)
    row = torch.full((5003,), -4.0, device=DEVICE)
    row[hot] = torch.tensor([1.0, 1.5, 1.5, 0.0, 1.0, 0.5, 0.5, 1.5, 1.0], device=DEVICE)
    logits = row.repeat(2048, 1)  # 2048 draws: standard errors up to 0.009 here
    tokens, logprobs = sample_tokens(logits, 0.5, torch.tensor([5], device=DEVICE), splits=2)
    expected = (row / 0.5).softmax(-1)
    freq = torch.bincount(tokens, minlength=5003).float() / len(tokens)
    torch.testing.assert_close(freq[hot], expected[hot], atol=0.03, rtol=0)
    torch.testing.assert_close(freq[hot].sum(), expected[hot].sum(), atol=0.02, rtol=0)
    torch.testing.assert_close(logprobs, expected.log()[tokens])


def test_sampler_greedy_breaks_ties_to_the_lowest_index_across_tiles_and_chunks():
    """Greedy over rows whose maximum repeats: at 2, 5, 1026 (the next tile) and 4000; at 1026 and 4000;
    everywhere."""
    from fulcrum.rollout.native.sample_kernels import sample_tokens

    logits = torch.rand(3, 5003, device=DEVICE)
    logits[0, [2, 5, 1026, 4000]] = 3.0
    logits[1, [1026, 4000]] = 3.0
    logits[2] = 0.0
    for splits in (1, 2, 5):
        tokens, _ = sample_tokens(logits, 0.0, torch.tensor([0], device=DEVICE), splits=splits)
        assert tokens.tolist() == [2, 1026, 0] == logits.argmax(-1).tolist()


def test_sampler_split_count_fills_the_device_with_whole_tiles():
    from fulcrum.rollout.native.sample_kernels import sample_chunks, sample_splits

    tiles = {"block": 1024}
    assert sample_splits(512, 151936, 132, programs_per_sm=4, **tiles) == 2  # 1024 programs for 4 x 132
    assert sample_splits(1, 151936, 132, programs_per_sm=4, **tiles) == 149  # capped at one tile each
    assert sample_splits(4096, 151936, 132, programs_per_sm=4, **tiles) == 1
    assert sample_chunks(151936, 2, **tiles) == (76800, 2)  # 148.4 tiles of 1024: 75 and 73.4
    assert sample_chunks(5003, 4, **tiles) == (2048, 3)  # four chunks of whole tiles would leave one empty
    # the defaults (tiles of 512, 16 programs per SM): a 0.5B decode batch gets 2,560 programs
    assert sample_splits(512, 151936, 132) == 5
    assert sample_chunks(151936, 5) == (30720, 5)


def compiled_variants(kernel) -> int:
    """How many variants of a Triton kernel this process has compiled for the current device (Triton
    3.x keeps them in `device_caches[device][0]`, one entry per specialisation of its arguments)."""
    return len(kernel.device_caches[torch.cuda.current_device()][0])


@pytest.mark.skipif(
    not ON_CUDA, reason="compilation happens on a GPU only (the interpreter compiles nothing)"
)
def test_sampler_compiles_once_whatever_the_batch():
    """A rollout samples first tokens for any number of completed prompts and decodes a batch that shrinks
    as sequences finish: a batch size not seen before must not compile a new variant of the kernels (a
    compilation takes tenths of a second in the middle of a step)."""
    from fulcrum.rollout.native import sample_kernels as sk

    seed = torch.tensor([5], device=DEVICE)
    logits = torch.randn(512, 151936, device=DEVICE, dtype=torch.bfloat16)
    sk.sample_tokens(logits, 1.0, seed)
    kernels = (sk._sample_tile_stats_kernel, sk._sample_pick_kernel)
    before = [compiled_variants(k) for k in kernels]
    for batch in (1, 3, 7, 16, 17, 136, 509, 64):
        sk.sample_tokens(logits[:batch], 1.0, seed)
        sk.sample_tokens(logits[torch.arange(batch, device=DEVICE)], 1.0, seed)
    assert [compiled_variants(k) for k in kernels] == before


def chunked_engine_case(vocab: int, num_kv_blocks: int) -> tuple[list[list[int]], Any]:
    """Four random prompts (1 to 40 tokens below `vocab`) and a float32 engine configuration of 32 tokens
    a step (the 40-token prompt prefills in two chunks) and `num_kv_blocks` blocks (few: preemption)."""
    from fulcrum.rollout.native import EngineConfig

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in [1, 40, 7, 23]]
    config = EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, num_kv_blocks=num_kv_blocks, headroom_tokens=0,
        decode_steps=4, dtype=torch.float32,
    )  # fmt: skip
    return prompts, config


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["w-norm", "one-plus-w-norm"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_rotation_norms_each_head_first_as_the_separate_norm_would(dtype, offset):
    """rope_and_store_kv with a QKNorm: q and k (strided views of one qkv row) and the cached k are what
    the per-head add_rms_norm (on each head's row) then the rotation give, Qwen3's w·x̂ and Gemma 3's
    (1 + w)·x̂ alike; v reaches the cache untouched."""
    from fulcrum.rollout.native import kernels
    from fulcrum.rollout.native.attention import QKNorm

    torch.manual_seed(0)
    tokens, heads, kv_heads, dim = 6, 16, 8, 128
    qkv = (3 * torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=DEVICE)).to(dtype)
    views = (
        qkv[:, : heads * dim].view(tokens, heads, dim),
        qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim),
        qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim),
    )
    q, k, v = views
    q_weight, k_weight = (torch.randn(dim, device=DEVICE).to(dtype) for _ in range(2))
    positions = torch.tensor([0, 7, 3, 30, 12, 1], device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=DEVICE).float() / dim))
    cos_sin = ops.rope_cos_sin(inv_freq, 64, 1.0)

    def head_norm(x, weight):
        rows = x.reshape(-1, dim).contiguous()
        return kernels.add_rms_norm(rows, None, weight, 1e-6, offset).view(x.shape)

    expected_q = ops.apply_rope(head_norm(q, q_weight), positions, cos_sin)
    expected_k = ops.apply_rope(head_norm(k, k_weight), positions, cos_sin)
    expected_v = v.clone()
    cache = torch.zeros(1, 2, tokens, kv_heads, dim, device=DEVICE, dtype=dtype)
    slots = torch.arange(tokens, device=DEVICE)
    norm = QKNorm(q_weight, k_weight, 1e-6, offset)
    kernels.rope_and_store_kv(q, k, v, positions, cos_sin, slots, cache, 0, norm)
    torch.testing.assert_close(q, expected_q, **tol(dtype))
    torch.testing.assert_close(k, expected_k, **tol(dtype))
    torch.testing.assert_close(cache[0, 0], expected_k, **tol(dtype))
    assert torch.equal(cache[0, 1], expected_v) and torch.equal(v, expected_v)
    partial = ops.rope_cos_sin(inv_freq[: dim // 8], 64, 1.0)
    with pytest.raises(AssertionError, match="whole-head rotation"):
        kernels.rope_and_store_kv(q, k, v, positions, partial, slots, cache, 0, norm)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_an_engine_with_per_head_norms_on_its_triton_kernels_samples_the_torch_paths_tokens(arch):
    """Qwen3 (w·x̂) and Gemma 3 ((1 + w)·x̂, sliding layers) norm their q and k heads inside the rotation's
    kernel on the Triton path: greedy tokens and log-probs are the torch path's (separate norms), through
    chunked prefill and decode."""
    from arch_checks import arch_model
    from test_arch_gemma3 import SHAPE as GEMMA3_SHAPE
    from test_arch_qwen3 import SHAPE as QWEN3_SHAPE

    from fulcrum.rollout import SamplingParams
    from fulcrum.rollout.native import NativeEngine

    shape = {**{"qwen3": QWEN3_SHAPE, "gemma3_text": GEMMA3_SHAPE}[arch], "head_dim": 32}  # decode: 2^n
    model = arch_model(arch, shape, seed=1, init_std=0.1).to(DEVICE)
    prompts, config = chunked_engine_case(vocab=200, num_kv_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reference = NativeEngine(model, [1], 0, dataclasses.replace(config, triton_kernels=False), DEVICE)
    expected = reference.generate(prompts, params)
    engine = NativeEngine(model, [1], 0, dataclasses.replace(config, triton_kernels=True), DEVICE)
    assert engine.runner.use_triton and engine.runner.model.qk_norm
    out = engine.generate(prompts, params)
    assert out.token_ids == expected.token_ids
    for ours, theirs in zip(out.logprobs, expected.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-4, rtol=0)


def test_the_engine_never_reads_a_kv_slot_before_writing_it():
    """On the Triton path the KV cache is not zero-filled at wake-up: whatever it holds, even NaN, the
    greedy tokens are those of the torch path (which zero-fills it) and the log-probs finite, through
    chunked prefill, preemption and re-prefill."""
    from fulcrum.rollout import SamplingParams
    from fulcrum.rollout.native import EngineConfig, NativeEngine
    from fulcrum.rollout.testing import random_causal_lm

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in [1, 40, 7, 23, 16, 3]]
    config = EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, num_kv_blocks=12, headroom_tokens=0, decode_steps=4,
        dtype=torch.float32,
    )  # fmt: skip
    model = random_causal_lm("qwen2", init_std=0.2).to(DEVICE)
    params = SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True)
    reference = NativeEngine(model, [1], 0, dataclasses.replace(config, triton_kernels=False), DEVICE)
    assert not reference.runner.use_triton
    expected = reference.generate(prompts, params).token_ids
    engine = NativeEngine(model, [1], 0, dataclasses.replace(config, triton_kernels=True), DEVICE)
    assert engine.runner.use_triton
    assert engine.generate(prompts, params).token_ids == expected
    engine.wake_up()
    engine.runner.kv_cache.fill_(float("nan"))
    poisoned = engine.generate(prompts, params)
    assert engine.stats["preemptions"] > 0
    assert poisoned.token_ids == expected
    assert all(torch.isfinite(torch.tensor(lp)).all() for lp in poisoned.logprobs)


def test_an_engine_taking_its_decode_rows_longest_first_samples_the_torch_paths_tokens(monkeypatch):
    """`engine_kwargs.native.decode_order=longest_first`: the engine's decode steps hand the kernel the rows
    longest context first (AttentionMetadata.decode_order, once a step): prompts of 1 to 40 tokens decode
    side by side, through chunked prefill and preemption, and the greedy tokens and log-probs are the
    torch path's."""
    from fulcrum.rollout import SamplingParams
    from fulcrum.rollout.native import NativeEngine, decode_grid
    from fulcrum.rollout.testing import random_causal_lm

    orders = []
    monkeypatch.setattr(
        "fulcrum.rollout.native.model_runner.decode_order",
        lambda lens: orders.append(lens.clone()) or decode_grid.decode_order(lens),
    )
    model = random_causal_lm("qwen2", init_std=0.2).to(DEVICE)
    prompts, config = chunked_engine_case(vocab=256, num_kv_blocks=12)
    config = dataclasses.replace(config, decode_order="longest_first")
    params = SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True)
    reference = NativeEngine(model, [1], 0, dataclasses.replace(config, triton_kernels=False), DEVICE)
    expected = reference.generate(prompts, params)
    assert not orders  # the torch path has no kernel to order
    batch_order = NativeEngine(
        model, [1], 0, dataclasses.replace(config, decode_order="batch", triton_kernels=True), DEVICE
    )
    assert batch_order.generate(prompts, params).token_ids == expected.token_ids and not orders
    engine = NativeEngine(model, [1], 0, dataclasses.replace(config, triton_kernels=True), DEVICE)
    out = engine.generate(prompts, params)
    assert orders and any(len(set(lens.tolist())) > 1 for lens in orders)  # uneven contexts were ordered
    assert engine.stats["preemptions"] > 0
    assert out.token_ids == expected.token_ids
    for ours, theirs in zip(out.logprobs, expected.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("decode_order", ["batch", "longest_first"])
@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_next"])
def test_a_hybrid_engine_on_its_triton_kernels_samples_the_torch_paths_tokens(arch, decode_order):
    """Qwen3.5 and Qwen3-Next run the engine's Triton kernels in their attention layers (RoPE on a
    quarter of each head, the rest passed through into the cache), their (1 + w) norms and the sampler,
    beside the Gated DeltaNet layers; the greedy tokens are the torch path's, through chunked prefill,
    forks, preemption and re-prefill, with the KV cache poisoned with NaN (never zero-filled there), the
    attention layers' decode rows in the batch's order or longest first (the recurrent states' rows stay
    the batch's)."""
    from arch_checks import GATED_DELTANET_SHAPE, arch_model, require_model_type

    from fulcrum.rollout import SamplingParams
    from fulcrum.rollout.native import NativeEngine

    require_model_type(arch)
    shape = dict(GATED_DELTANET_SHAPE, num_hidden_layers=4)
    if arch == "qwen3_next":
        shape |= dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        shape |= dict(shared_expert_intermediate_size=48)
    model = arch_model(arch, shape, seed=1, init_std=0.1).to(DEVICE)
    assert model.config.rope_parameters["partial_rotary_factor"] < 1
    prompts, config = chunked_engine_case(vocab=1000, num_kv_blocks=10)
    config = dataclasses.replace(config, decode_order=decode_order)
    params = SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True)
    reference = NativeEngine(model, [1], 0, dataclasses.replace(config, triton_kernels=False), DEVICE)
    expected = reference.generate(prompts, params).token_ids
    engine = NativeEngine(model, [1], 0, dataclasses.replace(config, triton_kernels=True), DEVICE)
    assert engine.runner.use_triton and engine.runner.states is not None
    engine.wake_up()
    engine.runner.kv_cache.fill_(float("nan"))
    assert engine.generate(prompts, params).token_ids == expected
    assert engine.stats["preemptions"] > 0
