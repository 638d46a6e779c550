"""Loss aggregation, the PPO and GSPO policy losses and the value loss (log-probabilities and entropy:
`fulcrum.models.logprob`). The other policy losses and the `actor.policy_loss.loss_mode` registry are in
fulcrum.algo.policy_losses.

verl's semantics (verl/trainer/ppo/core_algos.py and verl/utils/torch_functional.py). Shapes:
(B, T) per-token tensors over the response, `response_mask` 1 = the token counts; logits (B, T, V).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fulcrum.algo.masked import masked_mean, masked_sum

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# log(pi / pi_old) is clamped to this before exp, so one wild token cannot overflow the ratio (as verl).
LOG_RATIO_CLAMP = 20.0
# GSPO clamps the log of its sequence ratio from above only (as verl).
GSPO_LOG_RATIO_MAX = 10.0


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


class PolicyLossOutput(NamedTuple):
    """verl's return order: pg_loss (scalar, differentiable), then three detached scalar metrics."""

    pg_loss: torch.Tensor
    pg_clipfrac: torch.Tensor
    ppo_kl: torch.Tensor
    pg_clipfrac_lower: torch.Tensor


def _clip_bounds(
    cliprange: float | None, cliprange_low: float | None, cliprange_high: float | None
) -> tuple[float, float]:
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    if low is None or high is None:
        raise ValueError("policy loss needs actor.clip_ratio (or both clip_ratio_low and clip_ratio_high)")
    return float(low), float(high)


def vanilla_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange: float | None = 0.2,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    **agg_kwargs: float | torch.Tensor | None,
) -> PolicyLossOutput:
    """PPO clipped surrogate with dual clip (Schulman et al. 2017; Ye et al. 2020); verl `compute_policy_loss_vanilla`.

    ratio = exp(clamp(logp - logp_old, ±20)),  all (B, T):
        L1 = -A * ratio,  L2 = -A * clip(ratio, 1 - eps_low, 1 + eps_high),  L = max(L1, L2)
        for A < 0 the loss is also capped: L = min(L, -A * c)   (dual clip, c = clip_ratio_c > 1)
    pg_loss = agg_loss(L * w) with w = rollout_is_weights (optional importance weights, (B, T)).
    pg_clipfrac = masked mean of [L2 > L1]; pg_clipfrac_lower = masked mean of [max(L1, L2) > -A c and A < 0];
    ppo_kl = masked mean of (logp_old - logp) (after the clamp).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"actor.clip_ratio_c must be greater than 1.0 for dual-clip PPO, got {clip_ratio_c}")
    eps_low, eps_high = _clip_bounds(cliprange, cliprange_low, cliprange_high)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    pg_clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).float(), response_mask)

    loss_cap = -advantages * clip_ratio_c
    loss_dual = torch.minimum(loss_cap, loss_ppo)
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean((torch.gt(loss_ppo, loss_cap) & negative).float(), response_mask)

    pg_losses = torch.where(negative, loss_dual, loss_ppo)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)  # type: ignore[arg-type]
    return PolicyLossOutput(pg_loss, pg_clipfrac.detach(), ppo_kl.detach(), pg_clipfrac_lower.detach())


def gspo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange: float | None = 0.2,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    **agg_kwargs: float | torch.Tensor | None,
) -> PolicyLossOutput:
    """Group Sequence Policy Optimisation (Zheng et al. 2025); verl `compute_policy_loss_gspo`.

    Sequence ratio s_i = exp(mean_t over valid tokens of (logp - logp_old)), used per token as
        s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]   (value s_i, gradient of the token's own log-prob)
    with log s_i,t clamped to <= 10. Then L = max(-A s, -A clip(s, 1 - eps_low, 1 + eps_high)) (no dual clip:
    clip_ratio_c is ignored). The paper aggregates with seq-mean-token-mean; verl (and we) use `loss_agg_mode`.
    pg_clipfrac_lower is 0; ppo_kl = masked mean of (logp_old - logp).
    """
    eps_low, eps_high = _clip_bounds(cliprange, cliprange_low, cliprange_high)
    log_ratio = log_prob - old_log_prob  # (B, T)
    seq_len = response_mask.sum(dim=-1).clamp(min=1)  # (B,)
    seq_log_ratio = masked_sum(log_ratio, response_mask, axis=-1) / seq_len  # (B,)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX))  # (B, T)

    loss_unclipped = -advantages * seq_ratio
    loss_clipped = -advantages * torch.clamp(seq_ratio, 1 - eps_low, 1 + eps_high)
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)  # type: ignore[arg-type]

    pg_clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).float(), response_mask)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    zero = torch.zeros((), device=pg_loss.device)
    return PolicyLossOutput(pg_loss, pg_clipfrac.detach(), ppo_kl.detach(), zero)


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
