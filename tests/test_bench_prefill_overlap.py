"""bench/tools/prefill_overlap.py: the FLOPs it divides by (the figures of BENCHMARKS.md's 8k prefill), and
on the CPU the two halves' layers give the packed prefill's outputs (the mechanics; streams and timing need a
GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from prefill_overlap import layer_flops, main
from shapes import shape_of
from transformers import AutoConfig

from fulcrum.models.arch import model_shape


def test_a_layers_flops_are_the_products_and_causal_attention() -> None:
    model_type, fields = shape_of("qwen2.5-0.5b")
    shape = model_shape(AutoConfig.for_model(model_type, **fields))
    # the four products: 29.8 MFLOP a token a layer at Qwen2.5-0.5B's shape
    assert layer_flops(shape, [1]) == pytest.approx(29_818_880 + 2 * 896)  # + one token's attention
    # 16 prompts of 8k over 24 layers: 93.8 TFLOP of products and 46.2 of causal attention
    total = layer_flops(shape, [8192] * 16) * 24
    assert total == pytest.approx(93.8e12 + 46.2e12, rel=2e-3)


def test_two_halves_of_a_prefill_give_the_packed_prefills_outputs(tmp_path: Path) -> None:
    out = tmp_path / "overlap.json"
    assert main(["--small", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["prompts"] == 2 and summary["layers"] == 2
    assert summary["max_abs"] > 0.1 and summary["max_abs_diff"] < 1e-4
    assert "two_over_one" not in summary  # no streams nor timing without a GPU: said by their absence
