"""Loss aggregation and the value loss (the policy losses: fulcrum.algo.policy_losses; log-probabilities
and entropy: `fulcrum.models.logprob`).

verl's semantics (verl/trainer/ppo/core_algos.py and verl/utils/torch_functional.py). Shapes:
(B, T) per-token tensors over the response, `response_mask` 1 = the token counts; logits (B, T, V).
"""

from __future__ import annotations

import torch

from fulcrum.algo.masked import masked_mean, masked_sum

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    batch_num_tokens: float | torch.Tensor | None = None,
    global_batch_size: float | torch.Tensor | None = None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) loss matrix to a scalar; verl `agg_loss`.

    token-mean:              sum_{i,t} m l / N_tok
    seq-mean-token-sum:      sum_i (sum_t m l) / N_seq
    seq-mean-token-mean:     sum_i (sum_t m l / (sum_t m + 1e-8)) / N_seq
    seq-mean-token-sum-norm: sum_i (sum_t m l) / N_seq / S,   S = loss_scale_factor or T (Dr. GRPO)
    N_tok = sum(m), N_seq = rows with at least one valid token (fully masked rows are left out).
    For gradient accumulation over micro-batches, pass the whole mini-batch's `batch_num_tokens` /
    `global_batch_size` (times `dp_size` across data-parallel ranks, whose gradients are averaged):
    the micro-batch losses then add up to exactly the mini-batch loss.
    """
    if loss_agg_mode == "token-mean":
        num_tokens = loss_mask.sum().clamp(min=1) if batch_num_tokens is None else batch_num_tokens
        return masked_sum(loss_mat, loss_mask) / num_tokens * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        tokens_per_seq = loss_mask.sum(dim=-1)  # (B,)
        seq_losses = masked_sum(loss_mat, loss_mask, axis=-1)  # (B,)
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = seq_losses / (tokens_per_seq + 1e-8)
        has_tokens = (tokens_per_seq > 0).to(loss_mat.dtype)
        num_seqs = has_tokens.sum().clamp(min=1) if global_batch_size is None else global_batch_size
        loss = masked_sum(seq_losses, has_tokens) / num_seqs * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    raise ValueError(f"actor.loss_agg_mode={loss_agg_mode!r} is not one of {LOSS_AGG_MODES}")


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    **agg_kwargs: float | torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO2); verl `compute_value_loss`: (vf_loss, vf_clipfrac).

    v_clip = clip(vpreds, values - c, values + c), c = cliprange_value; all (B, T):
        vf_loss = 0.5 * agg_loss(max((vpreds - R)^2, (v_clip - R)^2))
        vf_clipfrac = masked mean of [(v_clip - R)^2 > (vpreds - R)^2]
    """
    vpred_clipped = torch.maximum(torch.minimum(vpreds, values + cliprange_value), values - cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpred_clipped - returns) ** 2
    vf_losses = torch.maximum(loss_unclipped, loss_clipped)
    vf_loss = 0.5 * agg_loss(vf_losses, response_mask, loss_agg_mode, **agg_kwargs)  # type: ignore[arg-type]
    vf_clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).float(), response_mask)
    return vf_loss, vf_clipfrac.detach()
