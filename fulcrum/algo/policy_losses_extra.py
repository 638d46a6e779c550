"""More of verl's policy losses (verl/trainer/ppo/core_algos.py), with the signature and registry of
fulcrum.algo.policy_losses; importing `fulcrum.algo` registers them.

- `clip_cov`, `kl_cov`: Clip-Cov and KL-Cov ("The Entropy Mechanism of Reinforcement Learning for Reasoning
  Language Models", Cui et al. 2025). PPO's surrogate, except on a few tokens whose advantage and log-prob
  covary most (the tokens that drive the policy's entropy down): Clip-Cov cuts their gradient, KL-Cov adds
  a |log-ratio| penalty to them. The covariance is taken over the micro-batch's valid tokens, as verl.
- `dppo_tv`, `dppo_kl`: DPPO with a binary total-variation or binary KL trust region (arXiv 2602.04879):
  a policy gradient with truncated importance ratios that drops the tokens whose probability moved too far
  from the old policy's, in the direction the advantage pushes.
- `dro`: Direct Reward Optimisation, -A log π with a quadratic penalty on the log-ratio.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fulcrum.algo.losses import agg_loss
from fulcrum.algo.masked import masked_mean
from fulcrum.algo.policy_losses import (
    LossConfig,
    Metrics,
    _clamped_log_ratio,
    _clip_bounds,
    _metrics,
    _weighted,
    register_policy_loss,
)

DRO_BETA_KEY = "actor_rollout_ref.actor.policy_loss.dro_beta"
# Added to 1 - p in the binary KL's log, so a token of probability 1 gives a finite value (as verl).
BINARY_KL_EPS = 1e-8
# (old_log_prob, log_prob, eps_low, eps_high) -> (where a token may move when A > 0, where when A <= 0)
TrustRegion = Callable[[torch.Tensor, torch.Tensor, float, float], tuple[torch.Tensor, torch.Tensor]]


def _ppo_surrogates(
    advantages: torch.Tensor, ratio: torch.Tensor, config: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's two terms (-A ρ, -A clip(ρ, 1 - eps_low, 1 + eps_high)), both (B, T)."""
    eps_low, eps_high = _clip_bounds(config)
    return -advantages * ratio, -advantages * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)


def _clip_cov_cut(
    advantages: torch.Tensor,
    log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    candidates: torch.Tensor,
    config: LossConfig,
) -> torch.Tensor:
    """Clip-Cov's token factor (B, T): 0 on the tokens whose gradient is cut, 1 elsewhere.

    `candidates` (bool, B, T) are the tokens Clip-Cov may cut; of those whose covariance
    c = (A - mean A)(logp - mean logp) (masked means) lies in (clip_cov_lb, clip_cov_ub), k =
    min(max(int(clip_cov_ratio * N_tok), 1), their count) are drawn with torch.randperm on torch's global
    generator. verl draws the same permutation of the same row-major list, so a seeded run cuts the same
    tokens as verl's.
    """
    keys = config.policy_loss
    with torch.no_grad():
        centred_logp = log_prob - masked_mean(log_prob, response_mask)
        cov = (advantages - masked_mean(advantages, response_mask)) * centred_logp
        in_band = (cov > keys.clip_cov_lb) & (cov < keys.clip_cov_ub) & candidates
        # The row-major flat positions of the candidates: the list verl permutes. Their number and the
        # token count reach the host each micro-batch, as in verl: randperm and the budget need them.
        positions = torch.nonzero(in_band.reshape(-1)).squeeze(1)
        # Contiguous, so that the flat positions address it through view(-1).
        cut = torch.ones(advantages.shape, dtype=advantages.dtype, device=advantages.device)
        if len(positions) > 0:
            budget = max(int(keys.clip_cov_ratio * float(response_mask.sum())), 1)
            drawn = torch.randperm(len(positions))[:budget].to(positions.device)
            cut.view(-1)[positions[drawn]] = 0
    return cut


@register_policy_loss("clip_cov")
def clip_cov_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: LossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clip-Cov (Cui et al. 2025); verl `compute_policy_loss_clip_cov`.

    ratio = exp(logp - logp_old) (not clamped, as verl), all (B, T):
        L1 = -A * ratio,  L2 = -A * clip(ratio, 1 - eps_low, 1 + eps_high)
        L = max(L1, L2) * cut                     (* w with rollout IS weights)
    where cut = 0 on k random valid tokens that PPO's clip leaves alone (L2 <= L1) and whose
    c = (A - mean A)(logp - mean logp) lies in (clip_cov_lb, clip_cov_ub), k = min(max(int(clip_cov_ratio *
    N_tok), 1), their count), and 1 elsewhere (no dual clip). pg_loss = agg_loss(L, loss_agg_mode);
    pg_clipfrac = share of valid tokens cut; ppo_kl = masked mean of (logp_old - logp). verl reports no
    pg_clipfrac_lower.
    """
    log_ratio = log_prob - old_log_prob
    loss_unclipped, loss_clipped = _ppo_surrogates(advantages, torch.exp(log_ratio), config)
    # Tokens PPO's clip already holds back get no further cut (verl sets their covariance to -inf).
    candidates = (response_mask > 0) & ~(loss_clipped > loss_unclipped)
    cut = _clip_cov_cut(advantages, log_prob, response_mask, candidates, config)
    pg_losses = _weighted(torch.maximum(loss_unclipped, loss_clipped) * cut, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **config.global_batch_info)
    return pg_loss, {
        "actor/pg_clipfrac": masked_mean((cut == 0).float(), response_mask).detach(),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }


def _kl_cov_tokens(
    advantages: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor, share: float
) -> torch.Tensor:
    """KL-Cov's penalised tokens (bool, B, T): the max(1, int(share * N_tok)) valid tokens of largest
    c = (A - mean A)(logp - mean logp), means over the valid tokens."""
    valid = response_mask > 0
    chosen = torch.zeros(valid.shape, dtype=torch.bool, device=valid.device)  # contiguous: view(-1) below
    # On the host, as verl: the means' summation order and topk's order among equal covariances are
    # then verl's, so the same tokens are chosen.
    adv = advantages[valid].detach().cpu()
    logp = log_prob[valid].detach().cpu()
    if adv.numel() == 0:
        return chosen
    cov = (adv - adv.mean()) * (logp - logp.mean())
    top = torch.topk(cov, max(1, int(adv.numel() * share))).indices
    positions = torch.nonzero(valid.reshape(-1)).squeeze(1)
    chosen.view(-1)[positions[top.to(positions.device)]] = True
    return chosen


@register_policy_loss("kl_cov")
def kl_cov_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: LossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """KL-Cov (Cui et al. 2025); verl `compute_policy_loss_kl_cov`.

    d = logp - logp_old (not clamped), all (B, T):
        L = -A * exp(d) + ppo_kl_coef * |d|   on the max(1, int(kl_cov_ratio * N_tok)) valid tokens of
                                               largest c = (A - mean A)(logp - mean logp)
        L = -A * exp(d)                        elsewhere (no clip)     (* w with rollout IS weights)
    pg_loss = agg_loss(L, loss_agg_mode); ppo_kl = masked mean of |d| (verl's, not logp_old - logp).
    No clip fractions.
    """
    log_ratio = log_prob - old_log_prob
    abs_log_ratio = log_ratio.abs()
    loss_pg = -advantages * torch.exp(log_ratio)
    loss_penalised = loss_pg + config.policy_loss.ppo_kl_coef * abs_log_ratio
    chosen = _kl_cov_tokens(advantages, log_prob, response_mask, config.policy_loss.kl_cov_ratio)
    pg_losses = _weighted(torch.where(chosen, loss_penalised, loss_pg), rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **config.global_batch_info)
    return pg_loss, {"actor/ppo_kl": masked_mean(abs_log_ratio, response_mask).detach()}


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
    eps_low, eps_high = _clip_bounds(config)
    clip_ratio_c = float(config.clip_ratio_c)
    log_ratio = _clamped_log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    # A truncated importance weight instead of PPO's dual clip (the paper's Section 5.4).
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()
    may_rise, may_fall = trust_region(old_log_prob.detach(), log_prob.detach(), eps_low, eps_high)
    valid = torch.where(advantages > 0, may_rise, may_fall).float()
    pg_losses = _weighted(-advantages * truncated * log_prob * valid, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **config.global_batch_info)
    return pg_loss, _metrics(
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
    pg_losses = _weighted(-(log_prob * advantages - 0.5 * beta * log_ratio.square()), rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **config.global_batch_info)
    return pg_loss, {"actor/ppo_kl": masked_mean(-log_ratio, response_mask).detach()}
