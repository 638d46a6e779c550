"""The policy losses, registered by name for `actor_rollout_ref.actor.policy_loss.loss_mode` (verl's names).

A loss has verl's shape (verl/trainer/ppo/core_algos.py, `register_policy_loss`):

    @register_policy_loss("my_loss")
    def my_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                rollout_is_weights=None) -> tuple[loss, dict[str, metric]]

Tensors (B, T), `response_mask` 1 = the token counts; `config` is a `LossConfig`: the actor's keys
(`config.clip_ratio`, `config.tau_pos`, ...) and `config.global_batch_info`, the mini-batch's counts
that `agg_loss` needs so the micro-batch losses add up to the mini-batch loss. The loss is a
differentiable scalar; metrics are detached scalars under verl's names (`actor/pg_clipfrac`, ...).
The actor looks the loss up by name, so a new loss (here, or in a user's file named by
`actor_rollout_ref.actor.policy_loss.path`) needs no change anywhere else. verl's Clip-Cov, KL-Cov,
DPPO and DRO losses are in fulcrum.algo.covariance_losses and fulcrum.algo.divergence_losses (importing
`fulcrum.algo` registers them).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from fulcrum.algo.losses import agg_loss
from fulcrum.algo.masked import MEAN_EPS, masked_mean, masked_sum
from fulcrum.algo.registry import registrar
from fulcrum.config.schema import ActorConfig

# log(pi / pi_old) is clamped to this before exp, so one wild token cannot overflow the ratio (as verl).
LOG_RATIO_CLAMP = 20.0
# GSPO clamps the log of its sequence ratio from above only (as verl).
GSPO_LOG_RATIO_MAX = 10.0
PATH_KEY = "actor_rollout_ref.actor.policy_loss.path"


@dataclass
class LossConfig(ActorConfig):
    """What a policy loss reads as `config`: every actor_rollout_ref.actor key, with its schema default,
    and `global_batch_info`, this mini-batch's `agg_loss` keywords (as verl's ActorConfig carries them)."""

    global_batch_info: dict[str, float] = field(default_factory=dict)
    # Bypass mode's settings (a `fulcrum.algo.rollout_correction.RolloutCorrection`, which imports this
    # module), as verl's policy_loss config carries its rollout_correction.
    rollout_correction: object | None = None

    @classmethod
    def of(
        cls, actor: ActorConfig, global_batch_info: dict[str, float], rollout_correction: object | None = None
    ) -> LossConfig:
        return cls(
            **{f.name: getattr(actor, f.name) for f in fields(ActorConfig)},
            global_batch_info=global_batch_info,
            rollout_correction=rollout_correction,
        )


Metrics = dict[str, torch.Tensor]
PolicyLossFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str, LossConfig, torch.Tensor | None],
    tuple[torch.Tensor, Metrics],
]
# loss_mode -> loss. Plain REINFORCE has no mode of its own: verl reaches it through rollout
# correction's bypass mode (fulcrum.algo.rollout_correction) and as gpg.
POLICY_LOSSES: dict[str, PolicyLossFn] = {}
register_policy_loss = registrar(POLICY_LOSSES, "policy loss")


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    if name not in POLICY_LOSSES:
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={name!r} is not supported; "
            f"choose one of {sorted(POLICY_LOSSES)} (or register yours: {PATH_KEY})"
        )
    return POLICY_LOSSES[name]


def import_policy_losses(path: str | None) -> None:
    """Import the user's module that registers losses: a Python file, or a module name on sys.path.

    A file is imported once per process under a name derived from its absolute path, so validation
    and the actor can both ask for it without registering its losses twice.
    """
    if not path:
        return
    file = Path(path).expanduser()
    try:
        if not path.endswith(".py"):
            importlib.import_module(path)
            return
        name = f"fulcrum_user_losses_{abs(hash(str(file.resolve())))}"
        if name in sys.modules:
            return
        spec = importlib.util.spec_from_file_location(name, file)
        if not file.is_file() or spec is None or spec.loader is None:
            raise FileNotFoundError(f"no Python file at {file}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    except Exception as err:
        raise ImportError(f"{PATH_KEY}={path}: importing it failed: {err!r}") from err


def policy_loss_names(path: str | None = None) -> tuple[str, ...]:
    """The registered loss modes, after importing the user's module at `path` (policy_loss.path)."""
    import_policy_losses(path)
    return tuple(POLICY_LOSSES)


def clip_bounds(config: LossConfig) -> tuple[float, float]:
    """(eps_low, eps_high): clip_ratio_low / clip_ratio_high, each following clip_ratio when null."""
    low = config.clip_ratio if config.clip_ratio_low is None else config.clip_ratio_low
    high = config.clip_ratio if config.clip_ratio_high is None else config.clip_ratio_high
    if low is None or high is None:
        raise ValueError("policy loss needs actor.clip_ratio (or both clip_ratio_low and clip_ratio_high)")
    return float(low), float(high)


def aggregate(
    pg_losses: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: LossConfig,
) -> torch.Tensor:
    """A loss's scalar from its token losses (B, T): agg_loss(L * w, loss_agg_mode) over this mini-batch's
    counts (`config.global_batch_info`), w the rollout importance weights when given."""
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **config.global_batch_info)


def ppo_surrogates(
    advantages: torch.Tensor, ratio: torch.Tensor, config: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's two terms (-A ratio, -A clip(ratio, 1 - eps_low, 1 + eps_high)), both (B, T)."""
    eps_low, eps_high = clip_bounds(config)
    return -advantages * ratio, -advantages * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)


def clamped_log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)


def clip_metrics(clipfrac: torch.Tensor, ppo_kl: torch.Tensor, clipfrac_lower: torch.Tensor) -> Metrics:
    return {
        "actor/pg_clipfrac": clipfrac.detach(),
        "actor/ppo_kl": ppo_kl.detach(),
        "actor/pg_clipfrac_lower": clipfrac_lower.detach(),
    }


@register_policy_loss("vanilla")
def vanilla_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: LossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate with dual clip (Schulman et al. 2017; Ye et al. 2020); verl `compute_policy_loss_vanilla`.

    ratio = exp(clamp(logp - logp_old, ±20)),  all (B, T):
        L1 = -A * ratio,  L2 = -A * clip(ratio, 1 - eps_low, 1 + eps_high),  L = max(L1, L2)
        for A < 0 the loss is also capped: L = min(L, -A * c)   (dual clip, c = clip_ratio_c > 1)
    pg_loss = agg_loss(L * w) with w = rollout_is_weights (optional importance weights, (B, T)).
    pg_clipfrac = masked mean of [L2 > L1]; pg_clipfrac_lower = masked mean of [max(L1, L2) > -A c and A < 0];
    ppo_kl = masked mean of (logp_old - logp) (after the clamp).
    """
    clip_ratio_c = float(config.clip_ratio_c)
    if clip_ratio_c <= 1.0:
        raise ValueError(f"actor.clip_ratio_c must be greater than 1.0 for dual-clip PPO, got {clip_ratio_c}")
    log_ratio = clamped_log_ratio(old_log_prob, log_prob)
    loss_unclipped, loss_clipped = ppo_surrogates(advantages, torch.exp(log_ratio), config)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    pg_clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).float(), response_mask)

    loss_cap = -advantages * clip_ratio_c
    loss_dual = torch.minimum(loss_cap, loss_ppo)
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean((torch.gt(loss_ppo, loss_cap) & negative).float(), response_mask)

    pg_losses = torch.where(negative, loss_dual, loss_ppo)
    pg_loss = aggregate(pg_losses, rollout_is_weights, response_mask, loss_agg_mode, config)
    return pg_loss, clip_metrics(pg_clipfrac, masked_mean(-log_ratio, response_mask), pg_clipfrac_lower)


@register_policy_loss("gspo")
def gspo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: LossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Group Sequence Policy Optimisation (Zheng et al. 2025); verl `compute_policy_loss_gspo`.

    Sequence ratio s_i = exp(mean_t over valid tokens of (logp - logp_old)), used per token as
        s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]   (value s_i, gradient of the token's own log-prob)
    with log s_i,t clamped to <= 10. Then L = max(-A s, -A clip(s, 1 - eps_low, 1 + eps_high)) (no dual clip:
    clip_ratio_c is ignored). The paper aggregates with seq-mean-token-mean; verl (and we) use `loss_agg_mode`.
    pg_clipfrac_lower is 0; ppo_kl = masked mean of (logp_old - logp).
    """
    log_ratio = log_prob - old_log_prob  # (B, T)
    seq_len = response_mask.sum(dim=-1).clamp(min=1)  # (B,)
    seq_log_ratio = masked_sum(log_ratio, response_mask, axis=-1) / seq_len  # (B,)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX))  # (B, T)

    loss_unclipped, loss_clipped = ppo_surrogates(advantages, seq_ratio, config)
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)
    pg_loss = aggregate(pg_losses, rollout_is_weights, response_mask, loss_agg_mode, config)
    pg_clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).float(), response_mask)
    zero = torch.zeros((), device=pg_loss.device)
    return pg_loss, clip_metrics(pg_clipfrac, masked_mean(-log_ratio, response_mask), zero)


@register_policy_loss("geo_mean")
def geo_mean_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: LossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Geometric-Mean Policy Optimisation (GMPO, Zhao et al. 2025); verl `compute_policy_loss_geo_mean`.

    Per token d = logp - logp_old (not clamped), clipped in the direction of the advantage's sign:
        d' = sgn(A) * min(sgn(A) * d, sgn(A) * clip(d, -eps_low, eps_high))
    per sequence (n_i = valid tokens, means over valid tokens):
        ratio_i = exp(sum_t d'_i,t / n_i),   A_i = sum_t A_i,t / n_i,   L_i = -A_i * ratio_i
    pg_loss = mean_i L_i over all B rows (loss_agg_mode is not used, as verl). With rollout IS weights
    w (B, T), L_i is multiplied by their geometric mean exp(sum_t log(w + 1e-10) / n_i).
    pg_clipfrac = masked mean of [d clipped and A > 0]; pg_clipfrac_lower the same for A < 0.
    """
    eps_low, eps_high = clip_bounds(config)
    log_ratio = log_prob - old_log_prob
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
    clipped = (log_ratio != log_ratio_clipped).float()
    return pg_losses.mean(), clip_metrics(
        masked_mean(clipped * (advantages > 0).float(), response_mask),
        masked_mean(-log_ratio, response_mask),
        masked_mean(clipped * (advantages < 0).float(), response_mask),
    )


@register_policy_loss("cispo")
def cispo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: LossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clipped IS-weight Policy Optimisation (CISPO, MiniMax-M1 2025); verl `compute_policy_loss_cispo`.

    ratio = exp(clamp(logp - logp_old, ±20)); the clipped ratio is a constant weight, so every token
    keeps a gradient (PPO's clip would drop it):
        L = -sg[clip(ratio, 1 - eps_low, 1 + eps_high)] * A * logp      (* w with rollout IS weights)
    pg_loss = agg_loss(L, loss_agg_mode); pg_clipfrac = masked mean of [clip changed the ratio];
    pg_clipfrac_lower = 0; ppo_kl = masked mean of (logp_old - logp) (after the clamp).
    """
    eps_low, eps_high = clip_bounds(config)
    log_ratio = clamped_log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    pg_loss = aggregate(pg_losses, rollout_is_weights, response_mask, loss_agg_mode, config)
    pg_clipfrac = masked_mean((ratio != clipped_ratio).float(), response_mask)
    zero = torch.zeros((), device=pg_loss.device)
    return pg_loss, clip_metrics(pg_clipfrac, masked_mean(-log_ratio, response_mask), zero)


@register_policy_loss("sapo")
def sapo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: LossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Soft Adaptive Policy Optimisation (SAPO, Gao et al. 2025); verl `compute_policy_loss_sapo`.

    A smooth gate instead of a hard clip: r = exp(clamp(logp - logp_old, ±20)),
        tau = tau_pos where A > 0, else tau_neg       (actor.tau_pos, actor.tau_neg)
        f(r) = sigmoid(tau * (r - 1)) * 4 / tau        (slope 1 at r = 1, flat far from it)
        L = -f(r) * A                                   (* w with rollout IS weights)
    pg_loss = agg_loss(L, "seq-mean-token-mean") whatever actor.loss_agg_mode says, as verl.
    pg_clipfrac and pg_clipfrac_lower are 0; ppo_kl = masked mean of (logp_old - logp) (after the clamp).
    """
    log_ratio = clamped_log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    pos = torch.as_tensor(float(config.tau_pos), dtype=advantages.dtype, device=advantages.device)
    neg = torch.as_tensor(float(config.tau_neg), dtype=advantages.dtype, device=advantages.device)
    taus = torch.where(advantages > 0, pos, neg)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_loss = aggregate(-gates * advantages, rollout_is_weights, response_mask, "seq-mean-token-mean", config)
    zero = torch.zeros((), device=pg_loss.device)
    return pg_loss, clip_metrics(zero, masked_mean(-log_ratio, response_mask), zero)


@register_policy_loss("gpg")
def reinforce_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: LossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """REINFORCE with optional importance weights; verl `compute_policy_loss_reinforce`.

    L = -A * logp * w (w = rollout IS weights, 1 without), pg_loss = agg_loss(L, loss_agg_mode);
    ppo_kl = masked mean of (logp_old - logp), where `old_log_prob` is the rollout engine's log-prob
    (rollout correction's bypass mode with loss_type=reinforce). It clips nothing.
    It is also Group Policy Gradient's loss (GPG, Chu et al. 2025; verl `compute_policy_loss_gpg`,
    loss_mode=gpg, paired with algorithm.adv_estimator=gpg): verl's -logp * A equals -A * logp to the bit.
    """
    pg_loss = aggregate(-advantages * log_prob, rollout_is_weights, response_mask, loss_agg_mode, config)
    return pg_loss, {"actor/ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}
