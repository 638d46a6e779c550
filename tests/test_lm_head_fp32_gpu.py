"""On a CUDA device: float32 LM-head logits (`actor_rollout_ref.model.lm_head_fp32`) through cuBLAS's
`mm` with `out_dtype`, inside a CUDA graph, in the torch.compile'd log-softmax chunks (forward and the
recomputing backward) and in the native engine with graphs."""

from __future__ import annotations

import pytest
import torch

from fulcrum.models.head_logits import head_logits
from fulcrum.models.linear_logprob import linear_log_softmax, use_compiled_chunks
from fulcrum.rollout import SamplingParams
from fulcrum.rollout.native import EngineConfig, NativeEngine
from fulcrum.rollout.testing import random_causal_lm

pytestmark = pytest.mark.gpu
CUDA, BF16 = torch.device("cuda"), torch.bfloat16


def operands(m: int = 300, v: int = 32000, h: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(m, h, generator=g).to(BF16)
    weight = (torch.randn(v, h, generator=g) / 8).to(BF16)
    labels = torch.randint(0, v, (m,), generator=g)
    return hidden.to(CUDA), weight.to(CUDA), labels.to(CUDA)


def test_mm_out_dtype_is_the_float32_product_in_and_out_of_a_graph() -> None:
    hidden, weight, _ = operands()
    want = hidden.double() @ weight.double().T  # exact products, so only float32 summation differs
    z = head_logits(hidden[::2], weight, None, fp32=True)  # a strided row view, the transposed weight
    assert z.dtype == torch.float32 and weight.dtype == BF16
    torch.testing.assert_close(z.double(), want[::2], atol=1e-4, rtol=1e-6)
    static = hidden.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        head_logits(static, weight, None, fp32=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = head_logits(static, weight, None, fp32=True)
    static.copy_(hidden.flip(0))
    graph.replay()
    torch.testing.assert_close(out, head_logits(hidden.flip(0), weight, None, fp32=True), atol=0, rtol=0)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_compiled_chunks_equal_eager_with_fp32_logits(with_entropy: bool) -> None:
    hidden, weight, labels = operands()
    results = []
    try:
        for compiled in (False, True):
            use_compiled_chunks(compiled)
            h = hidden.clone().requires_grad_(True)
            w = weight.clone().requires_grad_(True)
            lp, ent = linear_log_softmax(h, w, labels, 0.7, with_entropy, rows=128, fp32_logits=True)
            loss = lp.sum() + (0.1 * ent.sum() if ent is not None else 0.0)
            results.append((lp.detach(), ent, *torch.autograd.grad(loss, (h, w))))
    finally:
        use_compiled_chunks(False)
    (lp_e, ent_e, gh_e, gw_e), (lp_c, ent_c, gh_c, gw_c) = results
    assert lp_c.dtype == torch.float32
    # The compiled chunk sums the 32,000 float32 terms of each row in another order than eager: log-probs
    # (down to -15) and entropies (up to 7.4) agree to some float32 ulps of their size, not to 1e-6; a wrong
    # formula (a temperature or a max left out) moves them by more than 0.1.
    torch.testing.assert_close(lp_c, lp_e, atol=1e-5, rtol=1e-6)
    if with_entropy:
        torch.testing.assert_close(ent_c.detach(), ent_e.detach(), atol=1e-4, rtol=0)
    for got, want in ((gh_c, gh_e), (gw_c, gw_e)):  # bf16 gradients: one bf16 step apart at most
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


def test_engine_with_graphs_matches_eager_with_fp32_logits() -> None:
    model = random_causal_lm("qwen2", init_std=0.2, vocab_size=4096).to(CUDA)
    prompts = [[5, 9, 40, 77], list(range(3, 60)), [11] * 9]
    params = SamplingParams(n=2, temperature=0.9, max_tokens=24, seed=3, ignore_eos=True)
    outs = []
    for eager in (True, False):
        config = EngineConfig(max_num_seqs=8, max_model_len=256, enforce_eager=eager, lm_head_fp32=True)
        engine = NativeEngine(model, [1], 0, config, CUDA)
        assert engine.model.lm_head.dtype == BF16
        outs.append(engine.generate(prompts, params))
    assert outs[0].token_ids == outs[1].token_ids
    for a, b in zip(outs[0].logprobs, outs[1].logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)


def test_weight_gradient_chunks_add_into_float32_in_place() -> None:
    """`add_product_` adds a half-precision product into a float32 accumulator in one cuBLAS call:
    in place, and as exact as float32 summation allows (the product is not rounded to bf16 first,
    which the unfused `acc += a @ b` does)."""
    from fulcrum.models.linear_logprob import add_product_

    g = torch.Generator().manual_seed(1)
    acc = torch.randn(4096, 256, generator=g).to(CUDA)
    a = torch.randn(4096, 300, generator=g).to(BF16).to(CUDA)
    b = torch.randn(300, 256, generator=g).to(BF16).to(CUDA)
    want = acc.double() + a.double() @ b.double()
    rounded = acc + a @ b  # the product rounded to bf16, then added
    address = acc.data_ptr()
    add_product_(acc, a, b)
    assert acc.data_ptr() == address and acc.dtype == torch.float32
    error = (acc.double() - want).abs().max().item()
    assert error < 1e-3 < (rounded.double() - want).abs().max().item()
