"""Where a worker's model lives when torchrun started several ranks: replicated on each, or sharded by
FSDP2 (`fulcrum.parallel.layout.choose_layout` decides from verl's `fsdp_config`); nothing changes in
one process."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from fulcrum.config.schema import FSDPConfig
from fulcrum.parallel import current
from fulcrum.parallel.fsdp import FSDPSettings
from fulcrum.parallel.layout import Layout, choose_layout, training_state_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    layout: Layout | None = None  # None: one process
    optimizer_offload: bool = False  # fsdp_config.optimizer_offload, with several ranks

    @property
    def replicated(self) -> bool:
        return self.layout == "replicated"


ONE_PROCESS = Placement()


def device_memory_bytes(device: torch.device) -> int | None:
    """The CUDA device's total memory; None elsewhere."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


def place_on_ranks(
    model: nn.Module, device: torch.device, fsdp: FSDPConfig, role: str, keep_fp32: tuple[str, ...] = ()
) -> Placement:
    """Lay `model` out over the ranks (in place): replicated, or FSDP2 with the keys of verl's
    `fsdp_config` that act (offloads, reshard_after_forward). `role` (its config prefix, e.g.
    `actor_rollout_ref.actor`) names it in the log line. One process: nothing to do."""
    info = current()
    if not info.distributed:
        return ONE_PROCESS
    n_params = sum(p.numel() for p in model.parameters())
    state_bytes = training_state_bytes(model)  # a LoRA model: its adapters' state and the frozen base
    layout = choose_layout(
        int(fsdp.fsdp_size), state_bytes, device_memory_bytes(device), bool(fsdp.param_offload)
    )
    if layout == "sharded":
        from fulcrum.parallel.fsdp import shard_model

        settings = FSDPSettings(
            param_offload=bool(fsdp.param_offload),
            optimizer_offload=bool(fsdp.optimizer_offload),
            reshard_after_forward=bool(fsdp.reshard_after_forward),
        )
        shard_model(model, device, settings, keep_fp32)
    if info.rank == 0:
        logger.info(
            "%s: %s over %d ranks (%.2fB parameters, %.1f GB of weights, gradients and Adam state)",
            role,
            "replicated" if layout == "replicated" else "FSDP2-sharded",
            info.world_size,
            n_params / 1e9,
            state_bytes / 1e9,
        )
    return Placement(layout, bool(fsdp.optimizer_offload))
