"""Float32 LM-head logits (`actor_rollout_ref.model.lm_head_fp32`) in the engine and the training path.

What a user relies on with the key on: both sides take log-probs from the float32 accumulator of the
bf16 product h Wᵀ (never rounded to bf16), the stored head keeps its dtype (a tied head is the
embedding), the rollout-vs-training gap shrinks, and a backend that cannot follow is refused.
"""

from __future__ import annotations

import pytest
import torch
from helpers import log_probs_of

from fulcrum.config import FulcrumConfig, validate
from fulcrum.config.keys import ConfigError
from fulcrum.config.schema_rollout import RolloutConfig
from fulcrum.models.head_logits import head_logits
from fulcrum.models.linear_logprob import linear_log_softmax
from fulcrum.models.packed import enable_packed_attention
from fulcrum.rollout import SamplingParams, build_rollout
from fulcrum.rollout.native import EngineConfig, NativeEngine
from fulcrum.rollout.testing import random_causal_lm, scoring_batch
from fulcrum.workers.forwards import ModelForwards

CPU = torch.device("cpu")
BF16 = torch.bfloat16
EOS = 1
KEY = "actor_rollout_ref.model.lm_head_fp32"


def bf16_lm(head_scale: float = 1.0, **shape) -> torch.nn.Module:
    """A tiny random bf16 Qwen2; `head_scale` multiplies the LM head (larger logits, coarser bf16 grid)."""
    model = random_causal_lm("qwen2", init_std=0.2, dtype=BF16, **shape)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


def engine_for(model: torch.nn.Module, lm_head_fp32: bool, **overrides) -> NativeEngine:
    config = dict(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=256, decode_steps=4)
    return NativeEngine(
        model, [EOS], 0, EngineConfig(**{**config, **overrides}, lm_head_fp32=lm_head_fp32), CPU
    )


def float32_reference(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h Wᵀ of the same bf16 values, in float32 (exact operands, float32 sums)."""
    return hidden.float() @ weight.float().T


def test_head_logits_keep_the_float32_accumulator_and_the_weights_dtype() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 64, generator=g).to(BF16)
    weight = (torch.randn(300, 64, generator=g) * 4).to(BF16)
    bias = torch.randn(300, generator=g).to(BF16)
    z = head_logits(hidden, weight, bias, fp32=True)
    assert z.dtype == torch.float32 and weight.dtype == BF16
    torch.testing.assert_close(z, float32_reference(hidden, weight) + bias.float(), atol=0, rtol=0)
    rounded = head_logits(hidden, weight, bias, fp32=False)
    assert rounded.dtype == BF16
    torch.testing.assert_close(rounded, hidden @ weight.T + bias, atol=0, rtol=0)
    assert (z - rounded.float()).abs().max() > 0.01  # the grid the key avoids


@pytest.mark.parametrize("with_grad", [False, True])
def test_training_log_probs_equal_the_float32_logit_reference(with_grad: bool) -> None:
    g = torch.Generator().manual_seed(1)
    m, v, tau = 13, 300, 0.7
    hidden = torch.randn(m, 64, generator=g).to(BF16).requires_grad_(with_grad)
    weight = (torch.randn(v, 64, generator=g) / 4).to(BF16).requires_grad_(with_grad)  # logits of a few units
    labels = torch.randint(0, v, (m,), generator=g)
    z = float32_reference(hidden, weight) / tau
    ref_lp = z.log_softmax(-1).gather(1, labels[:, None])[:, 0]
    ref_ent = z.logsumexp(-1) - (z.softmax(-1) * z).sum(-1)
    with torch.set_grad_enabled(with_grad):
        lp, ent = linear_log_softmax(hidden, weight, labels, tau, True, rows=4, fp32_logits=True)
        off, _ = linear_log_softmax(hidden, weight, labels, tau, False, rows=4)
    assert ent is not None  # float32 arithmetic both sides: equal to 1e-6 plus float32's own relative step
    torch.testing.assert_close(lp, ref_lp, atol=1e-6, rtol=1e-6)
    # entropy = lse − Σ p z: a difference of two sums over V, float32 summation order shows at ~1e-6
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    assert (off - ref_lp).abs().max() > 1e-3  # bf16 logits: off the float32 reference
    if with_grad:  # the recomputed backward sees the same float32 logits (gradients themselves in bf16)
        got = torch.autograd.grad((lp + 0.1 * ent).sum(), (hidden, weight))
        want = torch.autograd.grad((ref_lp + 0.1 * ref_ent).sum(), (hidden, weight))
        for a, b in zip(got, want, strict=True):
            assert a.dtype == BF16
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tied", [False, True])
def test_engine_logits_are_the_float32_product_and_the_head_stays_bf16(tied: bool) -> None:
    model = bf16_lm(tie_word_embeddings=tied)
    engine = engine_for(model, lm_head_fp32=True)
    decoder = engine.model
    assert (decoder.lm_head is decoder.embed) == tied
    hidden = torch.randn(6, decoder.hidden).to(BF16)
    z = decoder.logits(hidden)
    assert z.dtype == torch.float32 and decoder.lm_head.dtype == BF16 and decoder.embed.dtype == BF16
    torch.testing.assert_close(z, float32_reference(hidden, decoder.lm_head), atol=0, rtol=0)
    assert engine_for(model, lm_head_fp32=False).model.logits(hidden).dtype == BF16


def test_engine_sampled_log_probs_come_from_float32_logits() -> None:
    """Each sampled token's log-prob is log softmax(fp32(h) fp32(W)ᵀ / T) of the hidden state the
    engine computed for it (one sequence: one row per logits call, in token order)."""
    model = bf16_lm(head_scale=4.0)
    engine = engine_for(model, lm_head_fp32=True)
    seen: list[torch.Tensor] = []
    logits_of = engine.model.logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden.detach().clone())
        return logits_of(hidden)

    engine.model.logits = recording  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.9, max_tokens=12, seed=5, ignore_eos=True)
    out = engine.generate([[5, 9, 40, 77, 3, 120]], params)
    (tokens,), (logprobs,) = out.token_ids, out.logprobs
    assert len(seen) >= len(tokens)
    for k, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
        z = float32_reference(seen[k][:1], engine.model.lm_head)[0] / 0.9
        assert abs(logprob - float(z.log_softmax(-1)[token])) <= 1e-6


def rollout_gap(model: torch.nn.Module, lm_head_fp32: bool) -> float:
    """Mean |engine log-prob − training-path log-prob| over sampled tokens, both sides in bf16 with the key
    set the same way (the `rollout_corr` gap a run logs)."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (4, 17, 33, 9)]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=7, ignore_eos=True)
    out = engine_for(model, lm_head_fp32).generate(prompts, params)
    batch = scoring_batch([prompts[i] for i in out.prompt_index], out.token_ids)
    with torch.no_grad():
        logp, _ = log_probs_of(model, batch, 1.0, False, CPU, packed=True, fp32_logits=lm_head_fp32)
    engine = torch.zeros_like(logp)
    for i, row in enumerate(out.logprobs):
        engine[i, : len(row)] = torch.tensor(row)
    mask = batch["response_mask"].bool()
    return float((engine - logp)[mask].abs().mean())


def test_the_rollout_vs_training_gap_shrinks_with_float32_logits() -> None:
    model = bf16_lm(head_scale=8.0)  # logits of tens: a bf16 step of 0.125 or more
    enable_packed_attention(model)
    off, on = rollout_gap(model, False), rollout_gap(model, True)
    assert on < off, (on, off)


def test_a_side_that_cannot_follow_is_refused() -> None:
    class Tok:
        eos_token_id = EOS
        pad_token_id = 0

    model = bf16_lm()
    hf = RolloutConfig(name="hf", max_num_seqs=4, max_model_len=64)
    with pytest.raises(ValueError, match="lm_head_fp32=True needs the native rollout engine"):
        build_rollout(hf, model, Tok(), CPU, lm_head_fp32=True)
    with pytest.raises(ConfigError, match="needs the packed path"):
        ModelForwards(model, CPU, use_remove_padding=False, role="actor", lm_head_fp32=True)
    cfg = FulcrumConfig()
    cfg.actor_rollout_ref.model.lm_head_fp32 = True
    cfg.actor_rollout_ref.rollout.name = "hf"
    cfg.actor_rollout_ref.model.use_remove_padding = False
    keys = {key for finding in validate(cfg) for key in finding.keys}
    assert {KEY, "actor_rollout_ref.rollout.name", "actor_rollout_ref.model.use_remove_padding"} <= keys
