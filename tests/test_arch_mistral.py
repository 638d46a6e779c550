"""Mistral in the native engine and the training path: a sliding window on every layer.

The engine runs a window that covers every sequence it serves (then windowed and full attention are
one function) and sends a shorter one to the hf backend with one line; the packed training path
applies the window itself, checked here with a window shorter than the sequences."""

from __future__ import annotations

import logging

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

from fulcrum.config.schema_rollout import RolloutConfig
from fulcrum.rollout import HFRollout, build_rollout
from fulcrum.rollout.native import NativeEngine

SHAPE = dict(sliding_window=4096)  # Mistral-7B v0.1's window, longer than any sequence here


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    return arch_model("mistral", SHAPE)


def test_greedy_equals_hf_generate(model: torch.nn.Module) -> None:
    check_greedy_equals_hf_generate(model)


@pytest.mark.parametrize("window", [4096, 6], ids=["window-covers", "window-slides"])
def test_training_log_probs_equal_hf_padded_and_packed(window: int) -> None:
    """make_batch's sequences run to 21 tokens: a window of 6 slides over them."""
    check_training_log_probs_equal_hf(arch_model("mistral", dict(sliding_window=window)))


def test_a_window_shorter_than_max_model_len_samples_with_hf_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    short = arch_model("mistral", dict(sliding_window=128))
    with pytest.raises(ValueError, match="sliding_window=128"):
        NativeEngine(short, [EOS], 0, engine_config(max_model_len=256), CPU)
    assert isinstance(NativeEngine(short, [EOS], 0, engine_config(max_model_len=128), CPU), NativeEngine)

    class Tokenizer:
        eos_token_id = EOS
        pad_token_id = 0

    rollout = RolloutConfig(name="native", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    with caplog.at_level(logging.WARNING, logger="fulcrum.rollout"):
        engine = build_rollout(rollout, short, Tokenizer(), CPU)
    assert isinstance(engine, HFRollout)
    assert [r.getMessage() for r in caplog.records] == [
        "rollout: the native engine does not run sliding_window=128 (it runs a window of at least "
        "rollout.max_model_len, or none); using the hf backend"
    ]


def test_tensor_parallel_shards_load() -> None:
    check_tensor_parallel_equals_one_rank("mistral", SHAPE)


@pytest.mark.gpu
def test_bf16_log_probs_on_gpu() -> None:
    check_bf16_gap_on_gpu("mistral", dict(SHAPE, hidden_size=256, num_attention_heads=8, num_hidden_layers=4))
