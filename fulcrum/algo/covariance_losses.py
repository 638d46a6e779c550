"""Clip-Cov and KL-Cov ("The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
Cui et al. 2025; verl/trainer/ppo/core_algos.py), with the signature and registry of
fulcrum.algo.policy_losses; importing `fulcrum.algo` registers them.

PPO's surrogate, except on a few tokens whose advantage and log-prob covary most (the tokens that drive the
policy's entropy down): `clip_cov` cuts their gradient, `kl_cov` adds a |log-ratio| penalty to them. The
covariance is taken over the micro-batch's valid tokens, as verl.
"""

from __future__ import annotations

import torch

from fulcrum.algo.masked import masked_mean
from fulcrum.algo.policy_losses import LossConfig, Metrics, aggregate, ppo_surrogates, register_policy_loss


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
    loss_unclipped, loss_clipped = ppo_surrogates(advantages, torch.exp(log_ratio), config)
    # Tokens PPO's clip already holds back get no further cut (verl sets their covariance to -inf).
    candidates = (response_mask > 0) & ~(loss_clipped > loss_unclipped)
    cut = _clip_cov_cut(advantages, log_prob, response_mask, candidates, config)
    pg_losses = torch.maximum(loss_unclipped, loss_clipped) * cut
    pg_loss = aggregate(pg_losses, rollout_is_weights, response_mask, loss_agg_mode, config)
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
    pg_losses = torch.where(chosen, loss_penalised, loss_pg)
    pg_loss = aggregate(pg_losses, rollout_is_weights, response_mask, loss_agg_mode, config)
    return pg_loss, {"actor/ppo_kl": masked_mean(abs_log_ratio, response_mask).detach()}
