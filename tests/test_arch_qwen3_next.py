"""Qwen3-Next is refused by the native engine, with one line naming the shared expert it has no slot for,
and sampled by the `hf` backend instead; its padded training path gives HF's log-probs."""

from __future__ import annotations

import logging

import pytest
import torch
from arch_checks import CPU, EOS, GATED_DELTANET_SHAPE, TOL, VOCAB, StubTokenizer, engine_config, prompts_of
from helpers import log_probs_of
from test_workers_units import make_batch, unpadded_log_probs

from fulcrum.config.schema_rollout import RolloutConfig
from fulcrum.rollout import HFRollout, build_rollout
from fulcrum.rollout.base import SamplingParams
from fulcrum.rollout.native import NativeEngine
from fulcrum.rollout.testing import random_causal_lm

# Three Gated DeltaNet layers and one attention layer; every MLP sparse, 4 experts (top 2) and a shared one.
SHAPE = dict(
    GATED_DELTANET_SHAPE,
    vocab_size=VOCAB,
    num_hidden_layers=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    return random_causal_lm("qwen3_next", init_std=0.1, **SHAPE)


def test_the_engine_names_the_shared_expert_and_hf_samples_it(
    model: torch.nn.Module, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ValueError, match=r"model_type='qwen3_next' \(shared_expert_intermediate_size=48"):
        NativeEngine(model, [EOS], 0, engine_config(), CPU)
    rollout = RolloutConfig(name="native", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    with caplog.at_level(logging.WARNING, logger="fulcrum.rollout"):
        engine = build_rollout(rollout, model, StubTokenizer(), CPU)
    assert isinstance(engine, HFRollout)
    assert [r.getMessage() for r in caplog.records if "shared_expert_gate" in r.getMessage()]
    prompt = prompts_of([7])[0]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6, min_new_tokens=6)
    assert out.token_ids[0] == expected[0, len(prompt) :].tolist()


def test_padded_training_log_probs_equal_hf(model: torch.nn.Module) -> None:
    """Left-padded prompts: the linear-attention layers' states start at each row's first real token."""
    batch = make_batch(b=5, p=12, r=9)
    expected = unpadded_log_probs(model, batch, 0.7).float()
    with torch.no_grad():
        logp, _ = log_probs_of(model, batch, 0.7, False, CPU, packed=False)
    assert (logp - expected)[batch["response_mask"].bool()].abs().max() < TOL
