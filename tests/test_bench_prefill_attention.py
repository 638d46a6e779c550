"""bench/tools/prefill_attention.py: the FLOPs it divides by, the prompts a prefill step holds, the K/V
heads repeated for the kernels that take no grouped heads (fulcrum.models.packed_attention), and its
refusal without a CUDA device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "tools"))
from prefill_attention import attention_flops, main, prompts_a_step

from fulcrum.models.packed_attention import repeat_kv_heads


def test_causal_attention_flops_are_half_of_two_square_products() -> None:
    # Qwen3-0.6B's 16 heads of 128 at 8k: QKᵀ and PV are 2 · 8192² · 2048 FLOPs each, half under the mask.
    assert attention_flops(1, 8192, 16, 128) == pytest.approx(2 * 8192**2 * 2048)
    assert attention_flops(2, 8192, 16, 128) == pytest.approx(2 * attention_flops(1, 8192, 16, 128))
    assert attention_flops(1, 2 * 1024, 14, 64) == pytest.approx(4 * attention_flops(1, 1024, 14, 64))


def test_a_step_of_16k_tokens_holds_two_8k_prompts_and_at_least_one() -> None:
    assert [prompts_a_step(c) for c in (2048, 8192, 16384, 32768)] == [8, 2, 1, 1]


def test_each_kv_head_serves_the_query_heads_of_its_group() -> None:
    k = torch.randn(5, 2, 8)
    repeated = repeat_kv_heads(k, 6)
    assert repeated.shape == (5, 6, 8)
    for head in range(
        6
    ):  # query heads 0-2 read K/V head 0, heads 3-5 head 1, as the flash kernel groups them
        assert torch.equal(repeated[:, head], k[:, head // 3])
    assert repeat_kv_heads(k, 2) is k


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without CUDA gets")
def test_without_cuda_it_says_what_it_needs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--shapes", "qwen3-0.6b", "--contexts", "64"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
