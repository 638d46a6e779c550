"""The policy losses by `actor_rollout_ref.actor.policy_loss.loss_mode`, verl's names and semantics.

vanilla (PPO clip) and gspo live in fulcrum.algo.losses; this module adds GMPO (`geo_mean`), GPG
(`gpg`), CISPO (`cispo`), SAPO (`sapo`) and REINFORCE with importance weights (used by rollout
correction's bypass mode), and holds the registry `POLICY_LOSSES` the actor calls by name.
Each function mirrors verl's `compute_policy_loss_<name>` in verl/trainer/ppo/core_algos.py and
returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower); a metric a loss does not define is 0
(verl leaves it out of its metrics dict). Shapes: (B, T); `response_mask` 1 = the token counts.
"""

from __future__ import annotations

from typing import Protocol

import torch

from fulcrum.algo.losses import (
    LOG_RATIO_CLAMP,
    PolicyLossOutput,
    _clip_bounds,
    agg_loss,
    gspo_policy_loss,
    vanilla_policy_loss,
)
from fulcrum.algo.masked import MEAN_EPS, masked_mean, masked_sum

# verl's defaults for SAPO's gate temperatures (actor.tau_pos, actor.tau_neg).
SAPO_TAU_POS = 1.0
SAPO_TAU_NEG = 1.05


def _zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), device=like.device)


def geo_mean_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange: float | None = 0.2,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    **_unused: object,
) -> PolicyLossOutput:
    """Geometric-Mean Policy Optimisation (GMPO, Zhao et al. 2025); verl `compute_policy_loss_geo_mean`.

    Per token d = logp - logp_old (not clamped), clipped in the direction of the advantage's sign:
        d' = sgn(A) * min(sgn(A) * d, sgn(A) * clip(d, -eps_low, eps_high))
    per sequence (n_i = valid tokens, means over valid tokens):
        ratio_i = exp(sum_t d'_i,t / n_i),   A_i = sum_t A_i,t / n_i,   L_i = -A_i * ratio_i
    pg_loss = mean_i L_i over all B rows (loss_agg_mode is not used, as verl). With rollout IS weights
    w (B, T), L_i is multiplied by their geometric mean exp(sum_t log(w + 1e-10) / n_i).
    pg_clipfrac = masked mean of [d clipped and A > 0]; pg_clipfrac_lower the same for A < 0.
    """
    eps_low, eps_high = _clip_bounds(cliprange, cliprange_low, cliprange_high)
    log_ratio = log_prob - old_log_prob
    ppo_kl = masked_mean(-log_ratio, response_mask)
    sign = torch.sign(advantages)
    log_ratio_clipped = torch.clamp(log_ratio, -eps_low, eps_high)
    log_ratio_min = sign * torch.minimum(sign * log_ratio, sign * log_ratio_clipped)
    n_tokens = response_mask.sum(dim=-1) + MEAN_EPS  # (B,)
    seq_ratio = torch.exp(masked_sum(log_ratio_min, response_mask, axis=-1) / n_tokens)  # (B,)
    seq_adv = masked_sum(advantages, response_mask, axis=-1) / n_tokens  # (B,)
    pg_losses = -seq_adv * seq_ratio
    if rollout_is_weights is not None:
        log_w = torch.log(rollout_is_weights + 1e-10)
        pg_losses = pg_losses * torch.exp(masked_sum(log_w, response_mask, axis=-1) / n_tokens)
    pg_loss = pg_losses.mean()
    clipped = (log_ratio != log_ratio_clipped).float()
    pg_clipfrac = masked_mean(clipped * (advantages > 0).float(), response_mask)
    pg_clipfrac_lower = masked_mean(clipped * (advantages < 0).float(), response_mask)
    return PolicyLossOutput(pg_loss, pg_clipfrac.detach(), ppo_kl.detach(), pg_clipfrac_lower.detach())


def cispo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange: float | None = 0.2,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    **agg_kwargs: float | torch.Tensor | None,
) -> PolicyLossOutput:
    """Clipped IS-weight Policy Optimisation (CISPO, MiniMax-M1 2025); verl `compute_policy_loss_cispo`.

    ratio = exp(clamp(logp - logp_old, ±20)); the clipped ratio is a constant weight, so every token
    keeps a gradient (PPO's clip would drop it):
        L = -sg[clip(ratio, 1 - eps_low, 1 + eps_high)] * A * logp      (* w with rollout IS weights)
    pg_loss = agg_loss(L, loss_agg_mode); pg_clipfrac = masked mean of [clip changed the ratio];
    pg_clipfrac_lower = 0; ppo_kl = masked mean of (logp_old - logp) (after the clamp).
    """
    agg_kwargs = {k: v for k, v in agg_kwargs.items() if k in _AGG_KEYS}
    eps_low, eps_high = _clip_bounds(cliprange, cliprange_low, cliprange_high)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    clipped_ratio = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    pg_clipfrac = masked_mean((ratio != clipped_ratio).float(), response_mask)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)  # type: ignore[arg-type]
    return PolicyLossOutput(pg_loss, pg_clipfrac.detach(), ppo_kl.detach(), _zero(pg_loss))


def sapo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    tau_pos: float = SAPO_TAU_POS,
    tau_neg: float = SAPO_TAU_NEG,
    rollout_is_weights: torch.Tensor | None = None,
    **agg_kwargs: float | torch.Tensor | None,
) -> PolicyLossOutput:
    """Soft Adaptive Policy Optimisation (SAPO, Gao et al. 2025); verl `compute_policy_loss_sapo`.

    A smooth gate instead of a hard clip: r = exp(clamp(logp - logp_old, ±20)),
        tau = tau_pos where A > 0, else tau_neg       (actor.tau_pos, actor.tau_neg)
        f(r) = sigmoid(tau * (r - 1)) * 4 / tau        (slope 1 at r = 1, flat far from it)
        L = -f(r) * A                                   (* w with rollout IS weights)
    pg_loss = agg_loss(L, "seq-mean-token-mean") whatever actor.loss_agg_mode says, as verl.
    pg_clipfrac and pg_clipfrac_lower are 0; ppo_kl = masked mean of (logp_old - logp) (after the clamp).
    """
    agg_kwargs = {k: v for k, v in agg_kwargs.items() if k in _AGG_KEYS}
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pos = torch.as_tensor(tau_pos, dtype=advantages.dtype, device=advantages.device)
    neg = torch.as_tensor(tau_neg, dtype=advantages.dtype, device=advantages.device)
    taus = torch.where(advantages > 0, pos, neg)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_losses = -gates * advantages
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean", **agg_kwargs)  # type: ignore[arg-type]
    ppo_kl = masked_mean(-log_ratio, response_mask)
    return PolicyLossOutput(pg_loss, _zero(pg_loss), ppo_kl.detach(), _zero(pg_loss))


def reinforce_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    **agg_kwargs: float | torch.Tensor | None,
) -> PolicyLossOutput:
    """REINFORCE with optional importance weights; verl `compute_policy_loss_reinforce`.

    L = -A * logp * w (w = rollout IS weights, 1 without), pg_loss = agg_loss(L, loss_agg_mode);
    ppo_kl = masked mean of (logp_old - logp), where `old_log_prob` is the rollout engine's log-prob
    (rollout correction's bypass mode with loss_type=reinforce). The clip fractions are 0.
    It is also Group Policy Gradient's loss (GPG, Chu et al. 2025; verl `compute_policy_loss_gpg`,
    loss_mode=gpg, paired with algorithm.adv_estimator=gpg): verl's -logp * A equals -A * logp to the bit.
    """
    agg_kwargs = {k: v for k, v in agg_kwargs.items() if k in _AGG_KEYS}
    pg_losses = -advantages * log_prob
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)  # type: ignore[arg-type]
    ppo_kl = masked_mean(old_log_prob - log_prob, response_mask)
    return PolicyLossOutput(pg_loss, _zero(pg_loss), ppo_kl.detach(), _zero(pg_loss))


# agg_loss's keyword arguments: the only extra keywords a loss passes on (others, e.g. tau_pos, are its own).
_AGG_KEYS = frozenset({"batch_num_tokens", "global_batch_size", "dp_size", "loss_scale_factor"})


class PolicyLossFn(Protocol):
    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        **kwargs: object,
    ) -> PolicyLossOutput: ...


# actor.policy_loss.loss_mode -> loss function (verl's names). Plain REINFORCE has no mode of its own:
# verl reaches it through rollout correction's bypass mode (fulcrum.algo.rollout_correction) and as gpg.
POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "vanilla": vanilla_policy_loss,  # type: ignore[dict-item]
    "gspo": gspo_policy_loss,  # type: ignore[dict-item]
    "geo_mean": geo_mean_policy_loss,  # type: ignore[dict-item]
    "gpg": reinforce_policy_loss,  # type: ignore[dict-item]
    "cispo": cispo_policy_loss,  # type: ignore[dict-item]
    "sapo": sapo_policy_loss,  # type: ignore[dict-item]
}


def compute_policy_loss(
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
    loss_mode: str = "vanilla",
    rollout_is_weights: torch.Tensor | None = None,
    tau_pos: float = SAPO_TAU_POS,
    tau_neg: float = SAPO_TAU_NEG,
    **agg_kwargs: float | torch.Tensor | None,
) -> PolicyLossOutput:
    """The policy loss named `loss_mode` (a key of POLICY_LOSSES): (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower).

    Inputs (B, T); the keyword names are those of verl's `compute_policy_loss`; `tau_pos`/`tau_neg` are
    SAPO's (actor.tau_pos / actor.tau_neg). `agg_kwargs` go to `agg_loss`.
    """
    if loss_mode not in POLICY_LOSSES:
        raise ValueError(
            f"actor.policy_loss.loss_mode={loss_mode!r} is not supported; choose one of {sorted(POLICY_LOSSES)}"
        )
    own: dict[str, object] = {}
    if loss_mode in ("vanilla", "gspo", "geo_mean", "cispo"):
        own.update(cliprange=cliprange, cliprange_low=cliprange_low, cliprange_high=cliprange_high)
    if loss_mode in ("vanilla", "gspo"):
        own["clip_ratio_c"] = clip_ratio_c
    if loss_mode == "sapo":
        own.update(tau_pos=tau_pos, tau_neg=tau_neg)
    else:
        own["loss_agg_mode"] = loss_agg_mode
    return POLICY_LOSSES[loss_mode](
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        rollout_is_weights=rollout_is_weights,
        **own,
        **agg_kwargs,
    )
