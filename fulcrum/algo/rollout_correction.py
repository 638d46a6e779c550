"""Rollout correction: importance weights and rejection sampling between the rollout engine's log-probs
and the trainer's, with verl's keys, semantics and `rollout_corr/*` metrics
(verl/trainer/ppo/rollout_corr_helper.py; algorithm.rollout_correction.*).

The engine samples from pi_rollout (here: bf16 kernels, KV cache), the trainer's loss assumes pi_old
(the trainer's own forward). Per token log r = logp_old - logp_rollout (B, T). Two corrections:

- importance sampling (rollout_is = token | sequence): weights w multiply the per-token policy loss.
  token: w_t = exp(clamp(log r_t, ±20)); sequence: w = exp(clamp(sum_t log r_t, ±20)) on every token.
  rollout_is_threshold "U" truncates (TIS: w = min(w, U)); "L_U" zeroes weights outside [L, U] (IcePop).
  rollout_is_batch_normalize rescales w to mean 1 over the batch (tokens, or sequences).
- rejection sampling (rollout_rs, a comma list): tokens or whole sequences whose divergence exceeds a
  bound leave the response mask. k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r, per token or as a
  sequence sum / mean / max; k1 options take "L_U" ratio bounds (compared in log space), k2/k3 an upper.

bypass_mode uses the engine's log-probs as old log-probs (no old-log-prob forward) and corrects inside
the loss against the current policy: `bypass_policy_loss`, registered as the policy loss "bypass_mode"
(as verl registers it), its settings in the loss's `config.rollout_correction`. This module is long (≈400 lines) because the
metrics follow verl's one by one so dashboards carry over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fulcrum.algo.masked import masked_mean, masked_sum
from fulcrum.algo.policy_losses import (
    LossConfig,
    register_policy_loss,
    reinforce_policy_loss,
    vanilla_policy_loss,
)

# exp(±20) bounds every weight before truncation (as verl's SAFETY_BOUND).
SAFETY_BOUND = 20.0
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
IS_LEVELS = ("token", "sequence")
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")


@dataclass
class RolloutCorrection:
    """algorithm.rollout_correction.* (verl's defaults): what to correct and how."""

    rollout_is: str | None = None
    rollout_is_threshold: str | float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: str | float | None = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"


def parse_is_threshold(spec: str | float) -> tuple[float, float | None]:
    """rollout_is_threshold -> (upper, lower or None): 2.0 / "2.0" is TIS, "0.5_5.0" is IcePop."""
    key = "algorithm.rollout_correction.rollout_is_threshold"
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"{key} must be a number or 'lower_upper', got {spec!r}")
    text = str(spec).strip()
    try:
        lower_text, upper_text = text.split("_", 1) if "_" in text else (None, text)
        upper = float(upper_text)
        lower = float(lower_text) if lower_text is not None else None
    except ValueError as exc:
        raise ValueError(f"{key}={spec!r} is not a number or 'lower_upper'") from exc
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"{key}={spec!r}: bounds must be positive with lower <= upper")
    return upper, lower


def parse_rs_options(rollout_rs: str, threshold: str | float | None) -> dict[str, tuple[float | None, float]]:
    """rollout_rs "a,b" and rollout_rs_threshold (one per option, or one shared) -> {option: (lower, upper)}.

    k1 options: "L_U" ratio bounds, or "U" meaning [1/U, U]; k2/k3 options: an upper bound only.
    """
    key = "algorithm.rollout_correction.rollout_rs"
    options = list(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))
    if not options:
        raise ValueError(f"{key} is empty")
    for option in options:
        if option not in RS_OPTIONS:
            raise ValueError(f"{key}: {option!r} is not one of {RS_OPTIONS}")
    if threshold is None:
        raise ValueError(f"{key}={rollout_rs} needs algorithm.rollout_correction.rollout_rs_threshold")
    specs = [s.strip() for s in str(threshold).split(",") if s.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(
            f"algorithm.rollout_correction.rollout_rs_threshold has {len(specs)} values for {len(options)} options"
        )
    specs = specs * len(options) if len(specs) == 1 else specs
    bounds: dict[str, tuple[float | None, float]] = {}
    for option, spec in zip(options, specs, strict=True):
        where = f"algorithm.rollout_correction.rollout_rs_threshold={spec!r} for {option}"
        if option.endswith("k1"):
            lower_text, upper_text = spec.split("_", 1) if "_" in spec else (str(1.0 / float(spec)), spec)
            lower, upper = float(lower_text), float(upper_text)
            if not 0 < lower <= upper:
                raise ValueError(f"{where}: bounds must be positive with lower <= upper")
            bounds[option] = (lower, upper)
        else:
            if "_" in spec:
                raise ValueError(f"{where}: k2/k3 options take one upper bound")
            if float(spec) <= 0:
                raise ValueError(f"{where}: must be positive")
            bounds[option] = (None, float(spec))
    return bounds


def _masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return values.masked_fill(~mask.bool(), float("-inf")).max()


def _masked_min(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return values.masked_fill(~mask.bool(), float("inf")).min()


def _clamped_std(values: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> float:
    """sqrt(masked E[x^2] - E[x]^2) of values clamped to [low, high] (0 with fewer than 2 tokens)."""
    if mask.sum() <= 1:
        return 0.0
    clamped = values.clamp(min=low, max=high)
    mean = masked_mean(clamped, mask)
    return float(torch.sqrt(torch.clamp(masked_mean(clamped.square(), mask) - mean.square(), min=0.0)))


def importance_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: str | float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated (TIS) or IcePop importance weights (B, T), detached, 0 on padding; verl
    `compute_rollout_correction_weights`. Metrics `rollout_is_*` (mean, max, min, std, ESS, seq_*)."""
    if rollout_is not in IS_LEVELS:
        raise ValueError(f"algorithm.rollout_correction.rollout_is={rollout_is!r} is not one of {IS_LEVELS}")
    upper, lower = parse_is_threshold(rollout_is_threshold)
    mask = response_mask
    if rollout_is == "token":
        log_ratio_stat = log_ratio
        raw = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    else:
        log_ratio_stat = masked_sum(log_ratio, mask, axis=-1).unsqueeze(-1)  # (B, 1)
        raw = torch.exp(torch.clamp(log_ratio_stat, -SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))

    low_bound = 1.0 / upper if lower is None else lower
    metrics: dict[str, float] = {}
    if rollout_is == "sequence":
        metrics["rollout_is_max"] = math.exp(min(float(log_ratio_stat.max()), SAFETY_BOUND))
        metrics["rollout_is_min"] = float(torch.exp(log_ratio_stat.min()))
        metrics["rollout_is_mean"] = float(masked_mean(weights, mask))
        metrics["rollout_is_ratio_fraction_high"] = float((log_ratio_stat > math.log(upper)).float().mean())
        metrics["rollout_is_ratio_fraction_low"] = float(
            (log_ratio_stat < math.log(low_bound)).float().mean()
        )
    else:
        metrics["rollout_is_mean"] = float(masked_mean(weights, mask))
        metrics["rollout_is_ratio_fraction_high"] = float(masked_mean((raw > upper).float(), mask))
        metrics["rollout_is_ratio_fraction_low"] = float(masked_mean((raw < low_bound).float(), mask))
        metrics["rollout_is_max"] = float(_masked_max(weights, mask))
        metrics["rollout_is_min"] = float(_masked_min(weights, mask))
    metrics["rollout_is_std"] = _clamped_std(weights, mask, 0.0, upper)
    ess_weights = weights.clamp(min=0.0, max=upper)
    normalised = ess_weights / (masked_mean(ess_weights, mask) + 1e-8)
    metrics["rollout_is_eff_sample_size"] = 1.0 / float(masked_mean(normalised.square(), mask))
    seq_weights = masked_mean(weights, mask, axis=-1)  # (B,)
    metrics["rollout_is_seq_mean"] = float(seq_weights.mean())
    metrics["rollout_is_seq_std"] = float(seq_weights.std()) if seq_weights.numel() > 1 else 0.0
    metrics["rollout_is_seq_max"] = float(seq_weights.max())
    metrics["rollout_is_seq_min"] = float(seq_weights.min())
    metrics["rollout_is_seq_max_deviation"] = float((seq_weights - 1.0).abs().max())
    raw_seq = masked_mean(raw, mask, axis=-1)
    metrics["rollout_is_seq_fraction_high"] = float((raw_seq > upper).float().mean())
    metrics["rollout_is_seq_fraction_low"] = float((raw_seq < low_bound).float().mean())
    if lower is not None:
        outside = (raw < lower) | (raw > upper)
        metrics["rollout_is_oob_ratio"] = float(masked_mean(outside.float(), mask))

    weights = weights.detach()  # weights change the measure, not the objective: no gradient through them
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = masked_mean(weights, mask)
        else:
            has_tokens = (mask.sum(dim=-1) > 0).to(weights.dtype)
            mean = (masked_mean(weights, mask, axis=-1) * has_tokens).sum() / has_tokens.sum().clamp_min(1e-8)
        if mean > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = float(mean)
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def _rs_option_metrics(
    option: str,
    stat: torch.Tensor,
    seq_stat: torch.Tensor | None,
    mask: torch.Tensor,
    upper: float,
    lower: float | None,
) -> dict[str, float]:
    """verl's `compute_rs_metrics` for one option: the statistic's mean/max/min/std and the fractions
    beyond the bounds (k1 bounds in log space), at token or sequence level."""
    p = f"rollout_rs_{option}"
    seq_valid = mask.sum(dim=-1) > 0
    seq_values = (seq_stat if seq_stat is not None else masked_mean(stat, mask, axis=-1))[seq_valid]
    low = lower if lower is not None else 0.0
    out = {f"{p}_mean": float(masked_mean(stat, mask))}
    if seq_stat is not None and seq_values.numel() > 0:
        out[f"{p}_max"], out[f"{p}_min"] = float(seq_values.max()), float(seq_values.min())
        out[f"{p}_fraction_high"] = float((seq_values > upper).float().mean())
        out[f"{p}_fraction_low"] = float((seq_values < low).float().mean()) if lower is not None else 0.0
    else:
        out[f"{p}_max"], out[f"{p}_min"] = float(_masked_max(stat, mask)), float(_masked_min(stat, mask))
        out[f"{p}_fraction_high"] = float(masked_mean((stat > upper).float(), mask))
        out[f"{p}_fraction_low"] = (
            float(masked_mean((stat < low).float(), mask)) if lower is not None else 0.0
        )
    out[f"{p}_std"] = _clamped_std(stat, mask, low, upper)
    if seq_values.numel() > 0:
        out[f"{p}_seq_mean"] = float(seq_values.mean())
        out[f"{p}_seq_std"] = float(seq_values.std()) if seq_values.numel() > 1 else 0.0
        out[f"{p}_seq_max"] = float(seq_values.max())
        out[f"{p}_seq_min"] = float(seq_values.min())
        out[f"{p}_seq_max_deviation"] = float(seq_values.abs().max())
        out[f"{p}_seq_fraction_high"] = float((seq_values > upper).float().mean())
        if lower is not None:
            out[f"{p}_seq_fraction_low"] = float((seq_values < low).float().mean())
    return out


def rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str,
    rollout_rs_threshold: str | float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The response mask with rejected tokens / sequences set to 0 (every option must pass); verl
    `compute_rollout_rejection_mask`. Metrics `rollout_rs_*`, per option and overall."""
    bounds = parse_rs_options(rollout_rs, rollout_rs_threshold)
    mask = response_mask
    if log_ratio.shape[0] == 0:
        return mask, {}
    safe = torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -safe, "k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1.0 - safe}
    valid = mask.bool()
    seq_valid = mask.sum(dim=-1) > 0
    combined = torch.ones_like(mask, dtype=log_ratio.dtype)
    metrics: dict[str, float] = {}
    for option, (lower, upper) in bounds.items():
        level, kind = option.rsplit("_", 1)
        token_stat = per_token[kind]
        # k1 bounds are ratios, compared with -log r in log space (as verl); k2/k3 take the upper bound.
        lo, hi = (math.log(lower), math.log(upper)) if lower is not None else (None, upper)
        seq_stat: torch.Tensor | None = None
        if level == "token":
            stat = token_stat
        else:
            if level == "seq_sum":
                seq_stat = masked_sum(token_stat, mask, axis=-1)
            elif level == "seq_mean":
                seq_stat = masked_mean(token_stat, mask, axis=-1)
            else:  # seq_max
                peak = token_stat.masked_fill(~valid, float("-inf")).max(dim=-1).values
                seq_stat = torch.where(peak == float("-inf"), torch.zeros_like(peak), peak)
            stat = seq_stat.unsqueeze(-1).expand_as(mask)
        keep = stat <= hi if lo is None else (stat >= lo) & (stat <= hi)
        metrics.update(_rs_option_metrics(option, stat, seq_stat, mask, hi, lo))
        keep_f = keep.to(log_ratio.dtype)
        combined = combined * keep_f
        seq_kept = (~((~keep) & valid)).all(dim=-1)
        metrics[f"rollout_rs_{option}_masked_fraction"] = float(masked_mean(1 - keep_f, mask))
        n_valid = seq_valid.float().sum()
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (
            float(((~seq_kept).float() * seq_valid.float()).sum() / n_valid) if n_valid > 0 else 0.0
        )
    metrics["rollout_rs_masked_fraction"] = float(masked_mean(1 - combined, mask))
    kept = (combined > 0.5) & valid
    metrics["rollout_rs_seq_masked_fraction"] = float((~kept & valid).any(dim=-1).float().mean())
    return (mask * combined).to(mask.dtype), metrics


def offpolicy_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """verl `compute_offpolicy_metrics`: how far the engine is from the trainer, all (B, T) inputs.

    kl = E[logp_rollout - logp_old]; k3_kl = E[r - log r - 1]; training/rollout ppl = batch mean of
    exp(-mean_t logp) per row (and the log-ppl); log_ppl_diff (mean, |mean|, max, min) of the rows'
    mean_t(logp_rollout - logp_old); ppl_ratio = mean exp(log_ppl_diff); chi2_token = E[r^2] - 1;
    chi2_seq = mean_i exp(2 sum_t log r) - 1 (log-ratios clamped to ±20).
    """
    mask = response_mask
    mean_old = masked_mean(old_log_prob, mask, axis=-1)  # (B,)
    mean_rollout = masked_mean(rollout_log_prob, mask, axis=-1)
    log_ratio = old_log_prob - rollout_log_prob
    log_ppl_diff = mean_rollout - mean_old
    safe = torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    seq_log_ratio = torch.clamp(masked_sum(log_ratio, mask, axis=-1), -SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": float(torch.exp(-mean_old).mean()),
        "training_log_ppl": float((-mean_old).mean()),
        "kl": float(masked_mean(rollout_log_prob - old_log_prob, mask)),
        "k3_kl": float(masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask)),
        "rollout_ppl": float(torch.exp(-mean_rollout).mean()),
        "rollout_log_ppl": float((-mean_rollout).mean()),
        "log_ppl_diff": float(log_ppl_diff.mean()),
        "log_ppl_abs_diff": float(log_ppl_diff.abs().mean()),
        "log_ppl_diff_max": float(log_ppl_diff.max()),
        "log_ppl_diff_min": float(log_ppl_diff.min()),
        "ppl_ratio": float(torch.exp(log_ppl_diff).mean()),
        "chi2_token": float(masked_mean(torch.exp(safe).square(), mask) - 1.0),
        "chi2_seq": float(torch.exp(2.0 * seq_log_ratio).mean() - 1.0),
    }


def compute_rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrection,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """(IS weights (B, T) or None when rollout_is is null, the response mask after rejection, metrics).

    verl `compute_rollout_correction_and_rejection_mask`; every metric is prefixed `rollout_corr/`.
    A batch without a single response token is returned unchanged, with no metrics.
    """
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(
            f"rollout correction: old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob "
            f"{tuple(rollout_log_prob.shape)} and response_mask {tuple(response_mask.shape)} differ in shape"
        )
    if not response_mask.any():
        return None, response_mask, {}
    with torch.no_grad():
        log_ratio = old_log_prob - rollout_log_prob
        metrics: dict[str, float] = {}
        weights = None
        if config.rollout_is is not None and config.rollout_is_threshold is not None:
            weights, is_metrics = importance_weights(
                log_ratio,
                response_mask,
                config.rollout_is,
                config.rollout_is_threshold,
                config.rollout_is_batch_normalize,
            )
            metrics.update(is_metrics)
        mask = response_mask.clone()
        if config.rollout_rs is not None:
            mask, rs_metrics = rejection_mask(
                log_ratio, response_mask, config.rollout_rs, config.rollout_rs_threshold
            )
            metrics.update(rs_metrics)
        metrics.update(offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}


@register_policy_loss("bypass_mode")
def bypass_policy_loss(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: LossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """Bypass mode's loss; verl `compute_policy_loss_bypass_mode`. old log-probs = the engine's; the
    settings are `config.rollout_correction` (a `RolloutCorrection`); `rollout_is_weights` is unused
    (the weights are computed here).

    IS weights and the rejection mask are computed between the *current* policy and the engine
    (no gradient), then loss_type=reinforce: L = -w A logp on the kept tokens; loss_type=ppo_clip:
    PPO's clipped loss with ratio pi / pi_rollout on the kept tokens (the ratio already corrects, so
    no weights). Returns the loss and its metrics with the `rollout_corr/*` ones.
    """
    correction = config.rollout_correction
    if not isinstance(correction, RolloutCorrection):
        raise ValueError(
            "actor_rollout_ref.actor.policy_loss.loss_mode='bypass_mode' is rollout correction's bypass mode: "
            "set algorithm.rollout_correction.bypass_mode=True (and loss_mode=vanilla) instead"
        )
    if correction.loss_type not in BYPASS_LOSS_TYPES:
        raise ValueError(
            f"algorithm.rollout_correction.loss_type={correction.loss_type!r} is not one of {BYPASS_LOSS_TYPES}"
        )
    weights, mask, metrics = compute_rollout_correction(
        log_prob.detach(), rollout_log_prob, response_mask, correction
    )
    if correction.loss_type == "reinforce":
        loss, loss_metrics = reinforce_policy_loss(
            rollout_log_prob, log_prob, advantages, mask, loss_agg_mode, config, weights
        )
    else:
        loss, loss_metrics = vanilla_policy_loss(
            rollout_log_prob, log_prob, advantages, mask, loss_agg_mode, config
        )
    return loss, {**metrics, **loss_metrics}
