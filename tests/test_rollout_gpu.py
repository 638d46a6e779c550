"""The native engine on a CUDA device: Triton kernels and CUDA graphs against `hf`, and the bf16 gap.

Run on the device machine: `pytest -q -s tests/test_rollout_gpu.py` (-s shows the reported gap).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from arch_checks import hf_forward_log_probs  # tests/ is on sys.path under pytest

from fulcrum.rollout import HFRollout, SamplingParams, logprob_diff
from fulcrum.rollout.native import EngineConfig, NativeEngine
from fulcrum.rollout.testing import random_causal_lm

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
EOS = 1


def prompts_of(lengths: list[int], seed: int = 0, vocab: int = 256) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize(
    ("arch", "indirect", "overlap"), [("qwen2", False, False), ("llama", True, False), ("qwen2", False, True)]
)
def test_fp32_greedy_with_graphs_and_kernels_matches_hf(arch, indirect, overlap):
    """The third case launches each decode window before reading the last (overlap_windows)."""
    model = random_causal_lm(arch, init_std=0.2).to(CUDA)
    prompts = prompts_of([1, 300, 7, 64, 16, 150, 33, 2, 95, 17])
    hf = HFRollout(model, [EOS], 0, CUDA, autocast=False)  # an fp32 reference
    free = hf.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    stop = Counter(t for r in free.token_ids for t in r[1:]).most_common(1)[0][0]
    params = SamplingParams(n=2, temperature=0, max_tokens=24, stop_token_ids=[stop])
    expected = hf.generate(prompts, params)
    config = EngineConfig(
        max_num_seqs=16, max_num_batched_tokens=64, max_model_len=512, num_kv_blocks=24, headroom_tokens=0, decode_steps=4,
        dtype=torch.float32, indirect_kv_cache=indirect, overlap_windows=overlap,
        free_cache_engine=False,  # the cache stays between generates: the test sleeps the engine itself
    )  # fmt: skip
    engine = NativeEngine(model, [EOS], 0, config, CUDA)
    assert engine.runner.use_triton and engine.runner.use_graphs
    out = engine.generate(prompts, params)
    assert engine.stats["preemptions"] > 0
    assert out.token_ids == expected.token_ids and out.finish_reasons == expected.finish_reasons
    for ours, theirs in zip(out.logprobs, expected.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-4, rtol=0)
    # New weights land in place: the captured graphs replay them without a recapture.
    graphs = dict(engine.runner.graphs)
    changed = random_causal_lm(arch, seed=1, init_std=0.2).to(CUDA)
    engine.update_weights(changed.named_parameters())
    short = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert (
        engine.generate(prompts, short).token_ids
        == HFRollout(changed, [EOS], 0, CUDA, autocast=False).generate(prompts, short).token_ids
    )
    assert all(engine.runner.graphs[size] is graph for size, graph in graphs.items())
    # Sleep frees the cache. With the indirect cache the graphs read its address on the device and
    # survive the new one; without, they are dropped and recaptured on use.
    old_address = engine.runner.kv_cache.data_ptr()
    engine.sleep()
    assert engine.runner.kv_cache is None
    hog = torch.empty(1 << 28, device=CUDA)  # training takes memory meanwhile: the cache may move
    engine.wake_up()
    del hog
    moved = engine.runner.kv_cache.data_ptr() != old_address
    print(f"\nKV cache moved on wake-up: {moved}")
    kept = all(engine.runner.graphs.get(size) is graph for size, graph in graphs.items())
    assert kept == (indirect or not moved)
    capture_before = engine.runner.graph_capture_s
    # The cache is not zero-filled on this path: no slot may be read before it is written.
    engine.runner.kv_cache.fill_(float("nan"))
    assert (
        engine.generate(prompts, short).token_ids
        == HFRollout(changed, [EOS], 0, CUDA, autocast=False).generate(prompts, short).token_ids
    )
    # rollout/graph_capture_s is this call's recapture time, not the engine's total
    assert engine.metrics()["rollout/graph_capture_s"] == engine.runner.graph_capture_s - capture_before
    assert (engine.metrics()["rollout/graph_capture_s"] > 0) == (not kept)


def test_bf16_logprob_gap_against_the_hf_forward_is_reported():
    shape = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=4, num_attention_heads=14)
    shape |= dict(num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=True)
    with torch.device(CUDA):
        model = random_causal_lm("qwen2", dtype=torch.bfloat16, **shape)
    prompts = prompts_of([90, 120, 150, 200] * 8, vocab=4096)
    engine = NativeEngine(model, [EOS], 0, EngineConfig(max_num_seqs=64, max_model_len=512), CUDA)
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True, seed=0))
    rollout = torch.tensor(out.logprobs)
    actor = hf_forward_log_probs(model, prompts, out.token_ids)
    gap = logprob_diff(rollout, actor, torch.ones_like(rollout))
    print(f"\nbf16 log-prob gap, native engine vs HF forward: {gap}")
    assert gap["rollout/logprob_diff_mean"] < 0.05


def cumulative(lengths: list[int]) -> torch.Tensor:
    """Packed sequences' cumulative lengths (S + 1,), int32 on the GPU."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)


def qkv_row_views(
    tokens: int, heads: int, kv_heads: int, dim: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random bf16 q (tokens, heads, dim), k and v (tokens, kv_heads, dim) as views of one QKV row, the way
    the engine holds them after its fused projection (strided, each last dimension contiguous)."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=CUDA, generator=generator).bfloat16()
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return q.view(-1, heads, dim), k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim)


@pytest.mark.parametrize("native_gqa", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(14, 2, 64), (16, 8, 128)])
def test_cudnn_prefill_attention_equals_flash(heads: int, kv_heads: int, dim: int, native_gqa: bool) -> None:
    """The cuDNN prefill (dense batches by padded length) = aten's flash kernel on packed prompts of mixed
    lengths (two equal consecutive ones batched as a view), at Qwen2.5-0.5B's and Qwen3-0.6B's heads, in
    bf16, with K/V heads repeated for their groups and handed to cuDNN grouped."""
    from fulcrum.models.packed_attention import (
        cudnn_causal_attention,
        has_cudnn_attention,
        varlen_causal_attention,
    )

    lengths = [1, 37, 300, 1024, 1024, 2048, 2100]
    cu = cumulative(lengths)
    generator = torch.Generator(device=CUDA).manual_seed(0)
    n = sum(lengths)
    q = torch.randn(n, heads, dim, device=CUDA, generator=generator).bfloat16()
    k = torch.randn(n, kv_heads, dim, device=CUDA, generator=generator).bfloat16()
    v = torch.randn(n, kv_heads, dim, device=CUDA, generator=generator).bfloat16()
    assert has_cudnn_attention(q)
    expected = varlen_causal_attention(q, k, v, cu, max(lengths), dim**-0.5)
    got = cudnn_causal_attention(q, k, v, lengths, dim**-0.5, native_gqa=native_gqa)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(14, 2, 64), (16, 8, 128)])
def test_flash_reads_the_views_of_one_qkv_row_as_their_copies(heads: int, kv_heads: int, dim: int) -> None:
    """`strided_rows`: aten's flash kernel given q, k and v as views of one (N, (Hq + 2·Hkv)·D) row, as the
    engine holds them, returns exactly what it returns for their contiguous copies, at Qwen2.5-0.5B's and
    Qwen3-0.6B's heads, in bf16, on mixed lengths."""
    from fulcrum.models.packed_attention import varlen_causal_attention

    lengths = [1, 37, 300, 1024, 2100]
    cu = cumulative(lengths)
    generator = torch.Generator(device=CUDA).manual_seed(0)
    q, k, v = qkv_row_views(sum(lengths), heads, kv_heads, dim, generator)
    assert not q.is_contiguous() and not k.is_contiguous()
    expected = varlen_causal_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu, 2100, dim**-0.5)
    got = varlen_causal_attention(q, k, v, cu, 2100, dim**-0.5, strided_rows=True)
    assert torch.equal(got, expected)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(14, 2, 64), (16, 8, 128)])
def test_cudnn_reads_the_views_of_one_qkv_row_as_flash_reads_their_copies(
    heads: int, kv_heads: int, dim: int
) -> None:
    """`strided_rows` on the cuDNN prefill: the views of one QKV row, grouped heads handed over, two equal
    consecutive prompts batched as a view with the row's stride, give flash's result on the copies."""
    from fulcrum.models.packed_attention import cudnn_causal_attention, varlen_causal_attention

    lengths = [37, 1024, 1024, 2100]
    cu = cumulative(lengths)
    generator = torch.Generator(device=CUDA).manual_seed(0)
    q, k, v = qkv_row_views(sum(lengths), heads, kv_heads, dim, generator)
    expected = varlen_causal_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu, 2100, dim**-0.5)
    got = cudnn_causal_attention(q, k, v, lengths, dim**-0.5, native_gqa=True, strided_rows=True)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def counted_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> Counter:
    """The engine's attention module's `name` wrapped to count its calls, by the `kernel` keyword when
    given one (else under `name`)."""
    from fulcrum.rollout.native import attention

    calls: Counter = Counter()
    real = getattr(attention, name)

    def counted(*args, **kwargs):
        calls[kwargs.get("kernel", name)] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, name, counted)
    return calls


def test_the_engine_prefills_fresh_prompts_through_cudnn_and_continued_chunks_through_flash(monkeypatch):
    """prefill_attention=cudnn: a step of fresh prompts runs cuDNN's kernel, a chunk over a cached
    context flash's, and the first tokens' bf16 log-probs stay within the kernels' rounding of flash's."""
    calls = counted_calls(monkeypatch, "cudnn_causal_attention")
    model = random_causal_lm("qwen2", init_std=0.2).to(CUDA)
    # 700 > 512 tokens a step: its second chunk has a cached context; two prompts of 256 fill a step at
    # one padded length (cuDNN reads them as one batch, a view of the step's Q/K/V)
    for lengths in ([9, 300, 700, 64], [256, 256]):
        prompts = prompts_of(lengths)
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        first = {}
        calls.clear()
        for kernel in ("flash", "cudnn"):
            config = EngineConfig(
                max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024, prefill_attention=kernel
            )
            first[kernel] = NativeEngine(model, [EOS], 0, config, CUDA).generate(prompts, params)
            if kernel == "flash":
                assert calls["cudnn_causal_attention"] == 0
        layers = model.config.num_hidden_layers
        assert calls["cudnn_causal_attention"] > 0 and calls["cudnn_causal_attention"] % layers == 0
        for ours, theirs in zip(first["cudnn"].logprobs, first["flash"].logprobs, strict=True):
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=5e-2, rtol=0)


@pytest.mark.parametrize("pack_gqa", [None, False])
@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(14, 2, 64), (16, 8, 128)])
def test_fa4_prefill_attention_equals_flash(
    heads: int, kv_heads: int, dim: int, window: int | None, pack_gqa: bool | None, monkeypatch
) -> None:
    """FlashAttention-4's varlen forward (the fa4 extra) = aten's flash kernel at Qwen2.5-0.5B's and
    Qwen3-0.6B's heads in bf16: prompts of mixed lengths read as views of one QKV row, each sequence's
    queries the last of its keys (a chunk over a cached context), with and without a sliding window, with
    FA4's own `pack_gqa` and with each query head on its own rows."""
    pytest.importorskip("flash_attn.cute", reason="needs the fa4 extra")
    from fulcrum.models import packed_attention
    from fulcrum.models.packed_attention import varlen_causal_attention

    monkeypatch.setattr(packed_attention, "FA4_PACK_GQA", pack_gqa)
    q_lens, k_lens = [1, 37, 300, 1024, 2100], [1, 37, 812, 1024, 2400]  # the third and last: cached context
    cu_q, cu_k = cumulative(q_lens), cumulative(k_lens)
    generator = torch.Generator(device=CUDA).manual_seed(0)
    q = qkv_row_views(sum(q_lens), heads, kv_heads, dim, generator)[0]
    k = torch.randn(sum(k_lens), kv_heads, dim, device=CUDA, generator=generator).bfloat16()
    v = torch.randn(sum(k_lens), kv_heads, dim, device=CUDA, generator=generator).bfloat16()
    kwargs = {"cu_seqlens_k": cu_k, "max_seqlen_k": max(k_lens)}
    expected = varlen_causal_attention(q.contiguous(), k, v, cu_q, max(q_lens), dim**-0.5, window, **kwargs)
    got = varlen_causal_attention(q, k, v, cu_q, max(q_lens), dim**-0.5, window, kernel="fa4", **kwargs)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_the_engine_prefills_every_step_through_fa4(monkeypatch):
    """prefill_attention=fa4: fresh prompts and a chunk over a cached context both run FlashAttention-4,
    and the first tokens' bf16 log-probs stay within the kernels' rounding of flash's."""
    pytest.importorskip("flash_attn.cute", reason="needs the fa4 extra")
    calls = counted_calls(monkeypatch, "varlen_causal_attention")
    model = random_causal_lm("qwen2", init_std=0.2).to(CUDA)
    prompts = prompts_of([9, 300, 700, 64])  # 700 > 512 tokens a step: a second chunk over a cached context
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    first = {}
    for kernel in ("flash", "fa4"):
        config = EngineConfig(
            max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024, prefill_attention=kernel
        )
        first[kernel] = NativeEngine(model, [EOS], 0, config, CUDA).generate(prompts, params)
    layers = model.config.num_hidden_layers
    fa4_calls = calls["fa4"]
    assert fa4_calls >= 3 * layers and fa4_calls % layers == 0  # three prefill steps at least
    assert calls["flash"] >= 3 * layers  # the flash engine's
    for ours, theirs in zip(first["fa4"].logprobs, first["flash"].logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=5e-2, rtol=0)
