"""The native rollout engine (paged KV cache, continuous batching, CUDA graphs, in-place weight sync).

`build_native_engine(rollout_cfg, hf_model, eos_ids, pad_id, device)` is what `fulcrum.rollout.build_rollout`
calls; `NATIVE_ARCHITECTURES` are the HF `model_type`s it runs, and `unsupported_reason(config)` names a
config field it does not honour (models/fields.py: the caller then samples with `hf`). Under torchrun,
`rollout.tensor_model_parallel_size` consecutive ranks run one engine together (tensor parallelism).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from fulcrum.config.schema_rollout import RolloutConfig
from fulcrum.parallel.tensor_parallel import TensorParallel, tensor_parallel_group
from fulcrum.rollout.native.config import EngineConfig, engine_config_from
from fulcrum.rollout.native.engine import NativeEngine
from fulcrum.rollout.native.models.fields import unsupported_reason
from fulcrum.rollout.native.models.qwen2 import SUPPORTED_MODEL_TYPES

NATIVE_ARCHITECTURES = frozenset(SUPPORTED_MODEL_TYPES)
logger = logging.getLogger(__name__)

__all__ = [
    "NATIVE_ARCHITECTURES",
    "EngineConfig",
    "NativeEngine",
    "build_native_engine",
    "unsupported_reason",
]


def engine_tensor_parallel(rollout_cfg: RolloutConfig) -> TensorParallel:
    """This rank's engine group for `rollout.tensor_model_parallel_size` (every rank calls this).

    A size that does not divide the world size (a single process included) runs without tensor
    parallelism, with one log line: verl's default of 2 must not stop a one-device run.
    """
    size = rollout_cfg.tensor_model_parallel_size
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if size > 1 and world % size:
        logger.info(
            "rollout: tensor_model_parallel_size=%d does not divide the %d process(es): one engine per process",
            size,
            world,
        )
        return TensorParallel()
    return tensor_parallel_group(size)


def build_native_engine(
    rollout_cfg: RolloutConfig, hf_model: nn.Module, eos_ids: list[int], pad_id: int, device: torch.device
) -> NativeEngine:
    max_len = int(getattr(hf_model.config, "max_position_embeddings", 4096))
    config = engine_config_from(rollout_cfg, max_len)
    return NativeEngine(hf_model, eos_ids, pad_id, config, device, engine_tensor_parallel(rollout_cfg))
