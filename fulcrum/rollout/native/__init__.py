"""The native rollout engine (paged KV cache, continuous batching, CUDA graphs, in-place weight sync).

`build_native_engine(rollout_cfg, hf_model, eos_ids, pad_id, device)` is what `fulcrum.rollout.build_rollout`
calls; `NATIVE_ARCHITECTURES` are the HF `model_type`s it runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fulcrum.rollout.native.config import EngineConfig, engine_config_from
from fulcrum.rollout.native.engine import NativeEngine
from fulcrum.rollout.native.models.qwen2 import SUPPORTED_MODEL_TYPES, unsupported_reason

NATIVE_ARCHITECTURES = frozenset(SUPPORTED_MODEL_TYPES)

__all__ = [
    "NATIVE_ARCHITECTURES",
    "EngineConfig",
    "NativeEngine",
    "build_native_engine",
    "unsupported_reason",
]


def build_native_engine(
    rollout_cfg: Any, hf_model: nn.Module, eos_ids: list[int], pad_id: int, device: torch.device
) -> NativeEngine:
    max_len = int(getattr(hf_model.config, "max_position_embeddings", 4096))
    return NativeEngine(hf_model, eos_ids, pad_id, engine_config_from(rollout_cfg, max_len), device)
