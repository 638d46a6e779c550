"""Worker-side parts of verl's recipes: the per-token sum of squared probabilities the optimal-token-baseline
estimator needs (actor.calculate_sum_pi_squared), computed in its own no-grad pass over the batch."""

from __future__ import annotations

import torch
from torch import nn

from fulcrum.batch import Batch, host_to_device
from fulcrum.models.load import autocast_for
from fulcrum.models.logprob import response_logits, sum_pi_squared
from fulcrum.workers.micro_batch import (
    _pad_right,
    make_micro_batches,
    restore_order,
    trimmed_inputs,
)


@torch.no_grad()
def compute_sum_pi_squared(
    model: nn.Module,
    batch: Batch,
    micro_batch_size: int | None,
    use_dynamic_bsz: bool,
    max_token_len: int | None,
    temperature: float,
    device: torch.device,
) -> torch.Tensor:
    """sum_v pi_v^2 at every response position (B, R), float32 on the CPU, 0 outside the response mask.

    One extra forward per step, only when the estimator needs it (verl computes it in the old-log-prob pass).
    """
    micro, order = make_micro_batches(
        batch,
        micro_batch_size,
        use_dynamic_bsz,
        max_token_len,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        sort_by_length=True,
        model=model,
    )
    was_training = model.training
    model.eval()
    parts = []
    try:
        for mb in micro:
            ids, mask, pos, r_kept = trimmed_inputs(mb, device)
            with autocast_for(device):
                logits = response_logits(model, ids, mask, pos, r_kept)
            values = _pad_right(sum_pi_squared(logits, temperature), mb.response_length)
            parts.append(values * host_to_device(mb["response_mask"], device))
    finally:
        model.train(was_training)
    return restore_order(parts, order).cpu()  # one copy back, not one (and a wait) per micro-batch
