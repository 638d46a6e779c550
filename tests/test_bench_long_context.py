"""bench/long_context.py: the roofline arithmetic counts what the model holds (KV bytes a token, the
decoder's matmul weights), and the smoke path on the CPU runs every row and reports every figure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from long_context import decode_bytes_per_step, hbm_bandwidth, main, prefill_flops
from shapes import shape_of

from fulcrum.models.arch import model_shape
from fulcrum.models.arch.spec import kv_bytes_per_token
from fulcrum.rollout.testing import random_causal_lm


def test_kv_bytes_a_token_are_the_shapes_own() -> None:
    from transformers import AutoConfig

    kib = {}
    for name in ("qwen3-0.6b", "qwen2.5-0.5b"):
        model_type, fields = shape_of(name)
        kib[name] = kv_bytes_per_token(model_shape(AutoConfig.for_model(model_type, **fields))) / 1024
    assert kib == {"qwen3-0.6b": 112, "qwen2.5-0.5b": 12}
    # 36 sequences of 16k at Qwen3-0.6B's shape: 64 GiB of K/V read a step beside 1.2 GB of weights.
    assert decode_bytes_per_step(1_200_000_000, 36, 112 * 1024, 16_448) == pytest.approx(
        1.2e9 + 36 * 112 * 1024 * 16_448
    )


def test_prefill_flops_count_the_decoder_linears_the_head_once_and_causal_attention() -> None:
    model_type, fields = shape_of("qwen3-0.6b", tiny=True)
    model = random_causal_lm(model_type, **fields)
    shape = model_shape(model.config)
    linears = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    head = 2 * shape.vocab * shape.hidden
    q = shape.heads * shape.head_dim
    # One token: the linears and the head; no key before it but itself (1² / 2 of a square).
    assert prefill_flops(shape, 1, 1) == pytest.approx(2 * linears + head + shape.attention_layers * 2 * q)
    # Doubling the context doubles the linears and quadruples the attention.
    c = 1000
    attention = prefill_flops(shape, 1, 2 * c) - 2 * prefill_flops(shape, 1, c) + head
    assert attention == pytest.approx(shape.attention_layers * 2 * q * (4 * c * c - 2 * c * c))
    assert prefill_flops(shape, 3, c) == pytest.approx(3 * prefill_flops(shape, 1, c))


def test_bandwidth_is_read_from_the_device_name() -> None:
    assert hbm_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert hbm_bandwidth("NVIDIA H200") == 4.8e12
    assert hbm_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert hbm_bandwidth("NVIDIA A10") is None  # unknown: no fraction, not a guess


def test_the_smoke_run_measures_every_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary_path = tmp_path / "summary.json"
    assert main(["--smoke", "--json", str(summary_path)]) == 0
    summary = json.loads(summary_path.read_text())
    rows = summary["rows"]
    assert [(r["shape"], r["context"]) for r in rows] == [
        ("qwen3-0.6b", 96),
        ("qwen2.5-0.5b", 96),
        ("qwen3-0.6b", 48),
        ("qwen2.5-0.5b", 48),
    ]
    for row in rows:
        assert row["sequences"] == 3 and row["repeats"] == 2
        assert row["decode_tok_per_s"] > 0 and row["prefill_tok_per_s"] > 0
        assert row["decode_roofline_fraction"] is None  # no GPU here: said, not invented
        assert f"{row['sequences']} x " in row["arithmetic"]
        # The profiled prefill of the row's prompts: a step at least, its host time, no device figure.
        split = row["prefill_split"]
        assert split["steps"] >= 1 and split["host_s"] > 0 and "gpu_busy_s" not in split
        # The prefill timed again under the cuDNN key (SDPA here, as the CPU has no cuDNN attention).
        cudnn = row["prefill_by_kernel"]["cudnn"]
        assert len(cudnn["prefill_s"]) == 2 and cudnn["over_flash"] > 0 and cudnn["peak_fraction"] is None
    assert rows[0]["decode_bytes_per_step"] > rows[2]["decode_bytes_per_step"]  # longer context, more K/V
    out = capsys.readouterr().out
    assert "| qwen3-0.6b | 96 | 3 |" in out
