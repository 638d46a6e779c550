"""Rollout backends behind one protocol (`fulcrum.rollout.base`): `native` (ours) and `hf` (reference).

`build_rollout(cfg.actor_rollout_ref.rollout, actor_module, tokenizer, device)` picks the backend:
`name=hf` always gives `hf`; `name=native` gives the native engine (any device); verl's engine names
(`vllm`, `sglang`) and `auto` mean "the fast one": `native` on CUDA, `hf` on the CPU. An
architecture the native engine does not implement falls back to `hf` with one log line, except when
the run needs the native engine: multi-turn rollouts, or float32 LM-head logits (`lm_head_fp32`,
which `transformers.generate` cannot follow: its head rounds to the model's dtype).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from fulcrum.config.schema_rollout import RolloutConfig
from fulcrum.rollout.base import (
    FinishReason,
    RequestEngine,
    RolloutEngine,
    RolloutOutput,
    SamplingParams,
    SequenceOutput,
)
from fulcrum.rollout.driver import AsyncRollout
from fulcrum.rollout.hf import HFRollout
from fulcrum.rollout.metrics import logprob_diff

__all__ = [
    "AsyncRollout",
    "FinishReason",
    "HFRollout",
    "RequestEngine",
    "RolloutEngine",
    "RolloutOutput",
    "SamplingParams",
    "SequenceOutput",
    "build_rollout",
    "eos_token_ids_of",
    "logprob_diff",
    "sampling_params",
    "uses_native_engine",
]

logger = logging.getLogger(__name__)

FAST_ENGINE_NAMES = ("native", "vllm", "sglang", "auto")
# Hugging Face generate's head rounds its logits to the model's dtype; sampling from those while the
# actor scores float32 logits would widen the rollout-vs-training gap the key is there to shrink.
HF_CANNOT_FOLLOW = (
    "actor_rollout_ref.model.lm_head_fp32=True needs the native rollout engine (rollout.name=native): "
    "the hf backend's logits are rounded to the model's dtype"
)
HF_NO_TURNS = (
    "actor_rollout_ref.rollout.multi_turn.enable=True needs the native rollout engine (rollout.name=native): "
    "the hf backend only generates whole batches, not conversations turn by turn"
)


def eos_token_ids_of(model: nn.Module, tokenizer: Any) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS plus the model's generation_config EOS ids."""
    ids: list[int] = []
    candidates: list[Any] = [getattr(tokenizer, "eos_token_id", None)]
    generation_config = getattr(model, "generation_config", None)
    candidates.append(getattr(generation_config, "eos_token_id", None))
    for value in candidates:
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    if not ids:
        raise ValueError("the tokenizer and the model's generation_config name no eos_token_id")
    return ids


def pad_token_id_of(tokenizer: Any, eos_ids: list[int]) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else eos_ids[0]


def native_requested(rollout_cfg: RolloutConfig, device: torch.device) -> bool:
    """Whether `rollout.name` asks for the native engine on `device` (it may still fall back to `hf`).
    Multi-turn rollouts take it on any device: it is the backend that serves conversations."""
    name = rollout_cfg.name
    fast_here = torch.device(device).type == "cuda" or rollout_cfg.multi_turn.enable
    return name == "native" or (name in FAST_ENGINE_NAMES and fast_here)


def uses_native_engine(rollout_cfg: RolloutConfig, model_config: Any, device: torch.device) -> bool:
    """Whether `build_rollout` gives the native engine (which keeps its own copy of the weights)."""
    if not native_requested(rollout_cfg, device):
        return False
    from fulcrum.rollout.native import unsupported_reason

    return unsupported_reason(model_config) is None


def build_rollout(
    rollout_cfg: RolloutConfig,
    model: nn.Module,
    tokenizer: Any,
    device: torch.device,
    lm_head_fp32: bool = False,
) -> RolloutEngine:
    """The rollout engine that the resolved `cfg.actor_rollout_ref.rollout` asks for on `device`;
    `lm_head_fp32` is `actor_rollout_ref.model.lm_head_fp32` (the native engine only)."""
    device = torch.device(device)
    name = rollout_cfg.name
    if name != "hf" and name not in FAST_ENGINE_NAMES:
        raise ValueError(
            f"actor_rollout_ref.rollout.name={name!r} is not a rollout backend; choose 'native' or 'hf'"
        )
    eos_ids = eos_token_ids_of(model, tokenizer)
    pad_id = pad_token_id_of(tokenizer, eos_ids)
    # What only the native engine does: a run that needs it is refused rather than sent to hf.
    needs_native = [
        why
        for on, why in ((lm_head_fp32, HF_CANNOT_FOLLOW), (rollout_cfg.multi_turn.enable, HF_NO_TURNS))
        if on
    ]
    if native_requested(rollout_cfg, device):
        from fulcrum.rollout.native import build_native_engine, native_unsupported_reason

        reason = native_unsupported_reason(rollout_cfg, model.config)
        if reason is None:
            return build_native_engine(rollout_cfg, model, eos_ids, pad_id, device, lm_head_fp32)
        if needs_native:
            raise ValueError(f"{needs_native[0]}; the native engine does not run {reason}")
        logger.warning("rollout: the native engine does not run %s; using the hf backend", reason)
    elif needs_native:
        raise ValueError(f"{needs_native[0]}; here rollout.name={name} on {device} gives the hf backend")
    elif name != "hf":
        logger.info(
            "rollout: name=%s on %s: using the hf backend (the native engine is for CUDA)", name, device
        )
    return HFRollout(model, eos_ids, pad_id, device, max_num_seqs=rollout_cfg.max_num_seqs)


def sampling_params(
    rollout_cfg: RolloutConfig, response_length: int, seed: int, validate: bool
) -> SamplingParams:
    """Training sampling (rollout.*) or validation sampling (rollout.val_kwargs; greedy unless do_sample)."""
    src = rollout_cfg.val_kwargs if validate else rollout_cfg
    greedy = not bool(src.do_sample)
    return SamplingParams(
        n=int(src.n),
        temperature=0.0 if greedy else float(src.temperature),
        top_p=float(src.top_p),
        top_k=int(src.top_k),
        max_tokens=response_length,
        ignore_eos=False if validate else bool(rollout_cfg.ignore_eos),
        seed=seed,
    )
