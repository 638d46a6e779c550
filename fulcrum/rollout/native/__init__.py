"""The native rollout engine (paged KV cache, continuous batching, CUDA graphs, in-place weight sync).

`build_native_engine(rollout_cfg, hf_model, eos_ids, pad_id, device)` is what `fulcrum.rollout.build_rollout`
calls; `NATIVE_ARCHITECTURES` are the HF `model_type`s it runs (the specs of `fulcrum.models.arch`), and
`native_unsupported_reason(rollout_cfg, config)` names what of a config it does not honour (the caller
then samples with `hf`). Under torchrun, `rollout.tensor_model_parallel_size` consecutive ranks run one
engine together (tensor parallelism).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from fulcrum.config.schema_rollout import RolloutConfig
from fulcrum.models.arch import SPECS, causal_lm_config, unsupported_reason
from fulcrum.parallel.tensor_parallel import TensorParallel, tensor_parallel_group
from fulcrum.rollout.native.config import EngineConfig, engine_config_from
from fulcrum.rollout.native.engine import NativeEngine

NATIVE_ARCHITECTURES = frozenset(SPECS)
logger = logging.getLogger(__name__)

__all__ = [
    "NATIVE_ARCHITECTURES",
    "EngineConfig",
    "NativeEngine",
    "build_native_engine",
    "native_unsupported_reason",
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


def _engine_config(rollout_cfg: RolloutConfig, hf_config: object, lm_head_fp32: bool = False) -> EngineConfig:
    max_len = int(getattr(causal_lm_config(hf_config), "max_position_embeddings", 4096))
    return engine_config_from(rollout_cfg, max_len, lm_head_fp32)


def native_unsupported_reason(rollout_cfg: RolloutConfig, hf_config: object) -> str | None:
    """What of `hf_config` the engine that `rollout_cfg` builds does not run (naming it), or None."""
    return unsupported_reason(hf_config, _engine_config(rollout_cfg, hf_config).max_model_len)


def build_native_engine(
    rollout_cfg: RolloutConfig,
    hf_model: nn.Module,
    eos_ids: list[int],
    pad_id: int,
    device: torch.device,
    lm_head_fp32: bool = False,
) -> NativeEngine:
    config = _engine_config(rollout_cfg, hf_model.config, lm_head_fp32)
    return NativeEngine(hf_model, eos_ids, pad_id, config, device, engine_tensor_parallel(rollout_cfg))
