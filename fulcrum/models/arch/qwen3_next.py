"""Qwen3-Next (`model_type` qwen3_next): refused by the native decoder, which samples it through the `hf`
backend; the padded training path runs it (Hugging Face's forward). Its layers mix Gated DeltaNet and
output-gated attention as Qwen3.5's do (`qwen3_5.py`), with what the decoder has no slot for:

- sparse MLP layers whose routed experts (Qwen3-MoE's softmax top-k router, which `moe.py` runs) sit
  beside a shared expert (`shared_expert_intermediate_size`) scaled by a sigmoid gate of its own;
- the Gated DeltaNet projections fused and interleaved per key-head group (`in_proj_qkvz`,
  `in_proj_ba`), where Qwen3.5 has one projection per part.
"""

from __future__ import annotations

from typing import Any

from fulcrum.models.arch.spec import config_value

MODEL_TYPES = ("qwen3_next",)


def refused_reason(config: Any) -> str:
    """Why the decoder does not run this Qwen3-Next config (object or config.json dict), naming its fields."""
    shared = config_value(config, "shared_expert_intermediate_size")
    return (
        f"shared_expert_intermediate_size={shared!r}: Qwen3-Next's sparse MLP layers add a shared expert, "
        "scaled by a sigmoid gate (shared_expert_gate), to the routed ones, which the MoE path has no slot "
        "for; and its Gated DeltaNet projections are fused per key-head group (in_proj_qkvz, in_proj_ba)"
    )
