"""Qwen2 and Qwen3 with `use_sliding_window`: the layers from `max_window_layers` on slide, the others
see everything (`layer_types`); checked with a window shorter than the sequences, so that the local
layers differ from full attention, in the engine (prefill and decode) and the training path (padded
and packed)."""

from __future__ import annotations

import pytest
import torch
from arch_checks import arch_model, check_greedy_equals_hf_generate, check_training_log_probs_equal_hf

from fulcrum.models.arch import unsupported_reason


def windowed(window: int) -> dict[str, object]:
    """Two layers: the first global, the second local (max_window_layers 1)."""
    return dict(num_hidden_layers=2, use_sliding_window=True, sliding_window=window, max_window_layers=1)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_local_layers_are_local_and_run_natively(arch: str) -> None:
    model = arch_model(arch, windowed(16))
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    assert unsupported_reason(model.config) is None


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_training_log_probs_equal_hf_padded_and_packed(arch: str) -> None:
    """make_batch's sequences run to 21 tokens: a window of 6 slides over them on the local layer."""
    check_training_log_probs_equal_hf(arch_model(arch, windowed(6)))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_a_local_layer_samples_as_hf(arch: str) -> None:
    """Prompts of up to 40 tokens and 64 new ones over a window of 16: prefill and decode slide."""
    check_greedy_equals_hf_generate(arch_model(arch, windowed(16)))
