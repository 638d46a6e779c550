"""Gemma 3 (text) in the native engine and the training path: (1 + w) RMSNorms on the layer input,
the attention output, the MLP input and output, and per head on q and k; embeddings scaled by
sqrt(hidden); scores scaled by query_pre_attn_scalar ** -0.5; local layers with a sliding window
and their own RoPE base interleaved with global ones; a GELU-tanh MLP.

The window (6 or 16 tokens) is shorter than the sequences here, so a layer that ignored it, or a
table of the wrong base, would change the tokens."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from arch_checks import (
    CPU,
    EOS,
    arch_model,
    check_bf16_gap_on_gpu,
    check_greedy_equals_hf_generate,
    check_tensor_parallel_equals_one_rank,
    check_training_log_probs_equal_hf,
    engine_config,
)
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from fulcrum.models.arch import model_shape, unsupported_reason
from fulcrum.models.arch.spec import param_count
from fulcrum.models.gguf_import import import_gguf
from fulcrum.rollout.base import SamplingParams
from fulcrum.rollout.native import NativeEngine

ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
}
SHAPE = dict(
    head_dim=24,
    query_pre_attn_scalar=32,
    sliding_window=16,
    layer_types=["sliding_attention", "full_attention"],
    rope_parameters=ROPE,
)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    return arch_model("gemma3_text", SHAPE)


def test_the_shape_counts_every_parameter_four_norms_a_layer(model: torch.nn.Module) -> None:
    shape = model_shape(model.config)
    assert (shape.head_dim, shape.qk_norm, shape.norms_per_layer) == (24, True, 4)
    assert param_count(shape) == sum(p.numel() for p in model.parameters())


def test_greedy_equals_hf_generate(model: torch.nn.Module) -> None:
    check_greedy_equals_hf_generate(model)


@pytest.mark.parametrize("window", [16, 6])
def test_training_log_probs_equal_hf_padded_and_packed(window: int) -> None:
    """make_batch's sequences run to 21 tokens: both windows slide over them."""
    check_training_log_probs_equal_hf(arch_model("gemma3_text", dict(SHAPE, sliding_window=window)))


def test_tensor_parallel_shards_load() -> None:
    check_tensor_parallel_equals_one_rank("gemma3_text", SHAPE)


def test_soft_capping_and_the_multimodal_model_are_refused_in_one_line() -> None:
    capped = arch_model("gemma3_text", dict(SHAPE, final_logit_softcapping=30.0))
    with pytest.raises(
        ValueError, match=r"final_logit_softcapping=30.0 \(it runs no final-logit soft-capping\)"
    ):
        NativeEngine(capped, [EOS], 0, engine_config(), CPU)
    assert "attn_logit_softcapping=50.0" in unsupported_reason(
        AutoConfig.for_model("gemma3_text", attn_logit_softcapping=50.0)
    )
    assert "model_type gemma3_text" in unsupported_reason(AutoConfig.for_model("gemma3"))


REAL = Path(os.environ.get("FULCRUM_GEMMA3_GGUF", "/nonexistent"))


@pytest.mark.slow
@pytest.mark.skipif(not REAL.is_file(), reason="set FULCRUM_GEMMA3_GGUF to the Gemma-3-270m Q4_K_M GGUF file")
def test_real_gemma3_270m_imports_and_samples_as_hf(tmp_path: Path) -> None:
    """The real checkpoint (imported from its GGUF): the native engine's greedy tokens equal
    transformers' for two questions, in fp32 on the CPU."""
    import_gguf(REAL, tmp_path / "gemma", torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "gemma")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "gemma", dtype=torch.float32).eval()
    questions = [
        "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts?",
        "2 + 3 =",
    ]
    prompts = [tokenizer(f"Question: {q}\nAnswer:")["input_ids"] for q in questions]
    engine = NativeEngine(model, [tokenizer.eos_token_id], 0, engine_config(max_model_len=128), CPU)
    got = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)).token_ids
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            expected = model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=32, min_new_tokens=32, pad_token_id=0
            )
        assert tokens == expected[0, len(prompt) :].tolist()


@pytest.mark.gpu
def test_bf16_log_probs_on_gpu() -> None:
    check_bf16_gap_on_gpu(
        "gemma3_text",
        dict(
            SHAPE, hidden_size=256, num_attention_heads=8, head_dim=64, num_hidden_layers=6, sliding_window=64
        )
        | {"layer_types": ["sliding_attention"] * 5 + ["full_attention"], "query_pre_attn_scalar": 64},
    )
