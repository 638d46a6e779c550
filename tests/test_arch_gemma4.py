"""Gemma 4 is refused by the native engine, with one line naming the config fields it has no slot for,
and sampled by the `hf` backend instead; the multimodal gemma4 is refused the same way."""

from __future__ import annotations

import logging

import pytest
import torch
from arch_checks import CPU, EOS, StubTokenizer, engine_config
from transformers import AutoConfig

from fulcrum.config.schema_rollout import RolloutConfig
from fulcrum.rollout import HFRollout, build_rollout
from fulcrum.rollout.base import SamplingParams
from fulcrum.rollout.native import NativeEngine, unsupported_reason
from fulcrum.rollout.testing import random_causal_lm

# E2B-like: per-layer input embeddings, K/V shared by the last layers, final-logit soft-capping.
SHAPE = dict(
    num_hidden_layers=4,
    head_dim=16,
    global_head_dim=32,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=256,
    num_kv_shared_layers=2,
    final_logit_softcapping=30.0,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
)


def test_the_engine_names_the_fields_and_hf_samples_it(caplog: pytest.LogCaptureFixture) -> None:
    model = random_causal_lm("gemma4_text", **SHAPE)
    with pytest.raises(ValueError, match=r"model_type='gemma4_text' \(Gemma 4's global layers") as err:
        NativeEngine(model, [EOS], 0, engine_config(), CPU)
    for named in (
        "per_layer_config",
        "'proportional'",
        "hidden_size_per_layer_input=8",
        "num_kv_shared_layers=2",
        "final_logit_softcapping=30.0",
    ):
        assert named in str(err.value)
    rollout = RolloutConfig(name="native", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    with caplog.at_level(logging.WARNING, logger="fulcrum.rollout"):
        engine = build_rollout(rollout, model, StubTokenizer(), CPU)
    assert isinstance(engine, HFRollout)
    assert [r.getMessage() for r in caplog.records if "gemma4_text" in r.getMessage()]
    out = engine.generate([[5, 9, 40]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([[5, 9, 40]]), do_sample=False, max_new_tokens=4, min_new_tokens=4
        )
    assert out.token_ids[0] == expected[0, 3:].tolist()


def test_the_multimodal_model_is_named_with_its_text_fields() -> None:
    reason = unsupported_reason(
        AutoConfig.for_model("gemma4", text_config=dict(SHAPE, attention_k_eq_v=True))
    )
    assert reason is not None and reason.startswith("model_type='gemma4' (the multimodal Gemma 4")
    assert "attention_k_eq_v=True (keys reused as values)" in reason
