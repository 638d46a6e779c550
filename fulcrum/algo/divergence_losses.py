"""Policy losses that bound or penalise how far the policy moves by a divergence other than PPO's clipped
ratio (verl/trainer/ppo/core_algos.py), with the signature and registry of fulcrum.algo.policy_losses;
importing `fulcrum.algo` registers them.

- `dppo_tv`, `dppo_kl`: DPPO with a binary total-variation or binary KL trust region (arXiv 2602.04879):
  a policy gradient with truncated importance ratios that drops the tokens whose probability moved too far
  from the old policy's, in the direction the advantage pushes.
- `dro`: Direct Reward Optimisation, -A log π with a quadratic penalty on the log-ratio.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fulcrum.algo.masked import masked_mean
from fulcrum.algo.policy_losses import (
    LossConfig,
    Metrics,
    aggregate,
    clamped_log_ratio,
    clip_bounds,
    clip_metrics,
    register_policy_loss,
)

DRO_BETA_KEY = "actor_rollout_ref.actor.policy_loss.dro_beta"
# Added to 1 - p in the binary KL's log, so a token of probability 1 gives a finite value (as verl).
BINARY_KL_EPS = 1e-8
# (old_log_prob, log_prob, eps_low, eps_high) -> (where a token may move when A > 0, where when A <= 0)
TrustRegion = Callable[[torch.Tensor, torch.Tensor, float, float], tuple[torch.Tensor, torch.Tensor]]


def _dppo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: LossConfig,
    rollout_is_weights: torch.Tensor | None,
    trust_region: TrustRegion,
) -> tuple[torch.Tensor, Metrics]:
    """DPPO's loss, the trust region aside (the one thing dppo_tv and dppo_kl differ in).

    ratio = exp(clamp(logp - logp_old, ±20)); `trust_region` says per token whether it may still move:
        valid = trust_region's first mask where A > 0, its second where A <= 0
        L = -A * sg[min(ratio, C)] * logp * valid        (C = clip_ratio_c; * w with rollout IS weights)
    pg_loss = agg_loss(L, loss_agg_mode); pg_clipfrac = share of valid tokens outside the region;
    pg_clipfrac_lower = share inside it whose ratio exceeds C (truncated); ppo_kl = masked mean of
    (logp_old - logp) (after the clamp).
    """
    eps_low, eps_high = clip_bounds(config)
    clip_ratio_c = float(config.clip_ratio_c)
    log_ratio = clamped_log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    # A truncated importance weight instead of PPO's dual clip (the paper's Section 5.4).
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()
    may_rise, may_fall = trust_region(old_log_prob.detach(), log_prob.detach(), eps_low, eps_high)
    valid = torch.where(advantages > 0, may_rise, may_fall).float()
    pg_losses = -advantages * truncated * log_prob * valid
    pg_loss = aggregate(pg_losses, rollout_is_weights, response_mask, loss_agg_mode, config)
    return pg_loss, clip_metrics(
        masked_mean(1.0 - valid, response_mask),
        masked_mean(-log_ratio, response_mask),
        masked_mean((ratio > clip_ratio_c).float() * valid, response_mask),
    )


def _total_variation_region(
    old_log_prob: torch.Tensor, log_prob: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Binary TV: the sampled token's probability rose by at most eps_high / fell by at most eps_low."""
    moved = torch.exp(log_prob) - torch.exp(old_log_prob)
    return moved <= eps_high, moved >= -eps_low


def _binary_kl_region(
    old_log_prob: torch.Tensor, log_prob: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Binary KL between Bernoulli(p_old) and Bernoulli(p) of the sampled token, at most eps_high (A > 0)
    or eps_low (A <= 0); a token moving against the advantage's push is always inside."""
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + BINARY_KL_EPS) / (1.0 - prob + BINARY_KL_EPS)
    )
    return (binary_kl <= eps_high) | (prob <= old_prob), (binary_kl <= eps_low) | (prob >= old_prob)


@register_policy_loss("dppo_tv")
def dppo_tv_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: LossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """DPPO-Binary-TV (arXiv 2602.04879); verl `compute_policy_loss_dppo_tv`.

    L = -A * sg[min(ratio, clip_ratio_c)] * logp * valid, metrics as `_dppo_policy_loss` says; the trust
    region bounds the total variation of the sampled token's probability p = exp(logp):
        valid = [p - p_old <= eps_high] where A > 0,  [p - p_old >= -eps_low] where A <= 0
    (eps_low / eps_high: clip_ratio_low / clip_ratio_high, here TV thresholds rather than ratio bounds).
    """
    return _dppo_policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
        _total_variation_region,
    )


@register_policy_loss("dppo_kl")
def dppo_kl_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: LossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """DPPO-Binary-KL (arXiv 2602.04879); verl `compute_policy_loss_dppo_kl`.

    L = -A * sg[min(ratio, clip_ratio_c)] * logp * valid, metrics as `_dppo_policy_loss` says; the trust
    region bounds the KL between Bernoulli(p_old) and Bernoulli(p), p = exp(logp) the sampled token's:
        D = p_old (logp_old - logp) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        valid = [D <= eps_high or p <= p_old] where A > 0,  [D <= eps_low or p >= p_old] where A <= 0
    (eps_low / eps_high: clip_ratio_low / clip_ratio_high, here KL thresholds rather than ratio bounds).
    """
    return _dppo_policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
        _binary_kl_region,
    )


@register_policy_loss("dro")
def dro_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: LossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Direct Reward Optimisation with a quadratic log-ratio penalty; verl `compute_policy_loss_dro`.

    d = logp - logp_old (not clamped), all (B, T):
        L = -(logp * A - beta / 2 * d^2)          (beta = policy_loss.dro_beta > 0; * w with rollout IS weights)
    pg_loss = agg_loss(L, loss_agg_mode); ppo_kl = masked mean of (logp_old - logp). No clip fractions.
    """
    beta = config.policy_loss.dro_beta
    if beta is None or beta <= 0:
        raise ValueError(f"{DRO_BETA_KEY} must be a positive number with loss_mode=dro, got {beta}")
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * beta * log_ratio.square())
    pg_loss = aggregate(pg_losses, rollout_is_weights, response_mask, loss_agg_mode, config)
    return pg_loss, {"actor/ppo_kl": masked_mean(-log_ratio, response_mask).detach()}
