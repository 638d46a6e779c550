"""The native engine's Triton kernels against their torch twins (fulcrum/rollout/native/ops.py).

Runs on a CUDA device, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1` with triton
installed); skipped otherwise (CI has no triton: the CPU engine uses the torch twins, tested elsewhere).
"""

from __future__ import annotations

import os

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


@pytest.mark.parametrize("window", [None, 20], ids=["full", "sliding-window"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_attention_matches_gather_sdpa(dtype, window):
    """With a window of 20 the contexts of 70 and 112 tokens start inside a tile and a block."""
    from fulcrum.rollout.native.kernels import paged_decode_attention

    torch.manual_seed(0)
    batch, heads, kv_heads, dim, block = 5, 14, 2, 64, 16
    k_cache = torch.randn(40 * block, kv_heads, dim, device=DEVICE, dtype=dtype)
    v_cache = torch.randn(40 * block, kv_heads, dim, device=DEVICE, dtype=dtype)
    tables = torch.randperm(39, device=DEVICE)[: batch * 7].view(batch, 7).int() + 1
    context = torch.tensor([1, 15, 16, 70, 112], device=DEVICE, dtype=torch.int32)
    q = torch.randn(batch, heads, dim, device=DEVICE, dtype=dtype)
    expected = ops.decode_attention_gather(q, k_cache, v_cache, tables, context, 112, block, 0.125, window)
    got = paged_decode_attention(q, k_cache, v_cache, tables, context, block, 0.125, window=window)
    torch.testing.assert_close(got, expected, **tol(dtype))


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

    tokens, heads, kv_heads, dim = 7, 14, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=DEVICE, dtype=dtype)
    positions = torch.tensor([0, 1, 5, 9, 3, 100, 2], device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=DEVICE).float() / dim))
    cos_sin = ops.rope_cos_sin(inv_freq, 128, 1.0)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    expected_q, expected_k = ops.apply_rope(q, positions, cos_sin), ops.apply_rope(k, positions, cos_sin)
    kernels.rope_inplace(q, k, positions, cos_sin)
    torch.testing.assert_close(q, expected_q, **tol(dtype))
    torch.testing.assert_close(k, expected_k, **tol(dtype))

    gate_up = torch.randn(4, 2 * 300, device=DEVICE, dtype=dtype)
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), ops.silu_and_mul(gate_up), **tol(dtype))


def test_gumbel_sampler_follows_the_tempered_distribution_and_greedy_is_argmax():
    from fulcrum.rollout.native.kernels import gumbel_sample

    seed = torch.tensor([123], dtype=torch.int64, device=DEVICE)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], device=DEVICE).repeat(4000, 1)
    tokens, logprobs = gumbel_sample(logits, 0.5, seed)
    expected = (logits[0] / 0.5).softmax(-1)
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    torch.testing.assert_close(freq, expected, atol=0.02, rtol=0)
    torch.testing.assert_close(logprobs, expected.log()[tokens])
    wide = torch.randn(4, 5000, device=DEVICE)
    tokens, logprobs = gumbel_sample(wide, 0.0, seed)
    assert tokens.tolist() == wide.argmax(-1).tolist()
    torch.testing.assert_close(logprobs, wide.log_softmax(-1).gather(-1, tokens[:, None])[:, 0])
    a, _ = gumbel_sample(wide, 1.0, torch.tensor([7], device=DEVICE))
    b, _ = gumbel_sample(wide, 1.0, torch.tensor([7], device=DEVICE))
    assert a.tolist() == b.tolist()  # the seed decides the sample
