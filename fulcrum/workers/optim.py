"""AdamW and verl's learning-rate schedules (linear warm-up, then constant or cosine to min_lr_ratio)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR


def warmup_steps(optim_cfg: Any, total_steps: int) -> int:
    """verl's rule: `lr_warmup_steps` when >= 0, else `lr_warmup_steps_ratio` × total training steps."""
    steps = int(_get(optim_cfg, "lr_warmup_steps", -1) or -1)
    if steps < 0:
        ratio = float(_get(optim_cfg, "lr_warmup_steps_ratio", 0.0) or 0.0)
        steps = int(ratio * total_steps)
    return steps


def constant_with_warmup(step: int, num_warmup: int) -> float:
    """lr multiplier: step / warmup during warm-up, then 1 (step 0 of a warm-up trains at lr 0, as verl)."""
    if step < num_warmup:
        return float(step) / float(max(1, num_warmup))
    return 1.0


def cosine_with_warmup(step: int, num_warmup: int, total_steps: int, min_lr_ratio: float) -> float:
    """lr multiplier: linear warm-up, then m + (1 - m)·½(1 + cos(π·progress)), progress ∈ [0, 1]."""
    if step < num_warmup:
        return float(step) / float(max(1, num_warmup))
    progress = float(step - num_warmup) / float(max(1, total_steps - num_warmup))
    progress = min(progress, 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    params: Iterable[torch.nn.Parameter], optim_cfg: Any, device: torch.device
) -> torch.optim.AdamW:
    betas = tuple(_get(optim_cfg, "betas", (0.9, 0.999)))
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["fused"] = True  # one kernel for all fp32 master weights
    return torch.optim.AdamW(
        [p for p in params if p.requires_grad],
        lr=float(optim_cfg.lr),
        betas=(float(betas[0]), float(betas[1])),
        weight_decay=float(_get(optim_cfg, "weight_decay", 0.01)),
        **kwargs,
    )


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, optim_cfg: Any, total_steps: int, key: str
) -> LambdaLR:
    """The schedule named by `warmup_style` / `lr_scheduler_type` (constant | cosine); stepped once per update."""
    style = _get(optim_cfg, "lr_scheduler_type", None) or _get(optim_cfg, "warmup_style", None) or "constant"
    num_warmup = warmup_steps(optim_cfg, total_steps)
    if style == "constant":
        return LambdaLR(optimizer, lambda s: constant_with_warmup(s, num_warmup))
    if style == "cosine":
        min_lr_ratio = float(_get(optim_cfg, "min_lr_ratio", 0.0) or 0.0)
        return LambdaLR(optimizer, lambda s: cosine_with_warmup(s, num_warmup, total_steps, min_lr_ratio))
    raise ValueError(
        f"{key}.lr_scheduler_type / warmup_style: unknown schedule {style!r} (constant | cosine)"
    )


def _get(cfg: Any, name: str, default: Any) -> Any:
    return getattr(cfg, name, default) if not isinstance(cfg, dict) else cfg.get(name, default)
