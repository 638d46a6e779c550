"""KL estimators between the policy and the reference, the in-reward KL penalty, and KL controllers.

Estimators per token (J. Schulman, "Approximating KL divergence", 2020), with d = logp - logp_ref:
    kl  / k1:         d                      (unbiased, high variance, can be negative)
    abs:              |d|
    mse / k2:         d^2 / 2                (biased, its gradient is the KL's gradient)
    low_var_kl / k3:  e^(-d) + d - 1, clamped to [-10, 10] (d clamped to ±20 first): unbiased, >= 0
    full:             sum_v p_v (log p_v - log q_v), exact, from the two (B, T, V) logit tensors
A '+' suffix (e.g. "low_var_kl+") keeps the estimator's value but takes the gradient of k2
(straight-through), as verl; for k2 and full, whose gradients are already right, '+' changes nothing.
verl: `kl_penalty` and `kl_penalty_forward` in core_algos.py, `apply_kl_penalty` in ray_trainer.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from fulcrum.algo.masked import masked_mean

KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")
# Every accepted name: each estimator with and without the straight-through '+'.
KL_PENALTY_NAMES = KL_ESTIMATORS + tuple(name + "+" for name in KL_ESTIMATORS)

K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0


def full_kl_from_logits(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(p || q) per position, p = softmax(logits), q = softmax(ref_logits): (B, T, V) x2 -> (B, T).

    KL = sum_v p_v (log p_v - log q_v), from log-softmax (numerically stable); half precision in float32.
    """
    if logits.dim() < 3:
        raise ValueError(
            "KL estimator 'full' needs the (B, T, V) logits of the policy and the reference, got a tensor of "
            f"shape {tuple(logits.shape)} (log-probs?); use low_var_kl, kl, abs or mse with log-probs"
        )
    if logits.shape != ref_logits.shape:
        raise ValueError(
            f"full KL needs logits of equal shape, got {tuple(logits.shape)} and {tuple(ref_logits.shape)}"
        )
    log_p = torch.log_softmax(logits.float(), dim=-1)
    log_q = torch.log_softmax(ref_logits.float(), dim=-1)
    # p = 0 tokens add nothing; where() keeps 0 * (-inf) from turning into NaN.
    gap = torch.where(log_p.isneginf(), torch.zeros((), device=log_p.device), log_p - log_q)
    return (log_p.exp() * gap).sum(dim=-1)


def kl_estimate(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """The value of estimator `kind` (no '+'): (B, T) log-probs -> (B, T); for "full", (B, T, V) logits."""
    if kind in ("kl", "k1"):
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kind in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(ref_logprob - logprob, min=-K3_LOG_RATIO_CLAMP, max=K3_LOG_RATIO_CLAMP)
        k3 = torch.exp(log_ratio) - log_ratio - 1
        return torch.clamp(k3, min=-K3_VALUE_CLAMP, max=K3_VALUE_CLAMP)
    if kind == "full":
        return full_kl_from_logits(logprob, ref_logprob)
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {KL_PENALTY_NAMES}")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of the policy from the reference: (B, T) -> (B, T); see the module docstring.

    With a '+' suffix: value of `kind`, gradient of k2 = d^2 / 2 (i.e. d/d logp = logp - logp_ref).
    For "full", `logprob` and `ref_logprob` are the (B, T, V) logits of the policy and the reference.
    """
    if kind not in KL_PENALTY_NAMES:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {KL_PENALTY_NAMES}")
    base = kind.removesuffix("+")
    value = kl_estimate(logprob, ref_logprob, base)
    if not kind.endswith("+") or base in ("mse", "k2", "full"):
        return value
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + value.detach()


class KLPenaltyOutput(NamedTuple):
    token_level_rewards: torch.Tensor  # (B, T): scores - beta * KL
    current_kl: float  # batch mean of the per-sequence mean KL (verl's actor/reward_kl_penalty)


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: str = "kl",
) -> KLPenaltyOutput:
    """In-reward KL penalty; verl `apply_kl_penalty` (ray_trainer.py) without the controller update.

    KL_t = kl_penalty(logp_old, logp_ref, kind) * mask_t;  rewards_t = scores_t - beta * KL_t;  all (B, T).
    current_kl = mean_i (masked mean over t of KL_i,t). The caller then does
    `controller.update(current_kl, n_steps=batch_size)` and logs beta = kl_coef as
    actor/reward_kl_penalty_coeff.
    """
    with torch.no_grad():
        kld = kl_penalty(old_log_prob, ref_log_prob, kind) * response_mask
        rewards = token_level_scores - kl_coef * kld
        current_kl = masked_mean(kld, response_mask, axis=-1).mean().item()
    return KLPenaltyOutput(rewards, current_kl)


class FixedKLController:
    """A constant KL coefficient (algorithm.kl_ctrl.type=fixed); verl `FixedKLController`."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No change: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593); verl `AdaptiveKLController`.

    After each step: e = clip(KL / target - 1, -0.2, 0.2);  beta <- beta * (1 + e * n_steps / horizon).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0:
            raise ValueError(
                f"algorithm.kl_ctrl.target_kl must be positive for the adaptive controller, got {target_kl}"
            )
        if horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon must be positive, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": float(self.horizon)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # Only the coefficient is state; target and horizon come from the (possibly changed) configuration.
        self.value = float(state["value"])


KLController = FixedKLController | AdaptiveKLController


def build_kl_controller(kl_ctrl: Any) -> KLController:
    """The controller of `algorithm.kl_ctrl` (an object or mapping with type, kl_coef, target_kl, horizon)."""

    def get(key: str) -> Any:
        return kl_ctrl[key] if isinstance(kl_ctrl, Mapping) else getattr(kl_ctrl, key)

    kind = get("type")
    if kind == "fixed":
        return FixedKLController(get("kl_coef"))
    if kind == "adaptive":
        return AdaptiveKLController(get("kl_coef"), get("target_kl"), get("horizon"))
    raise ValueError(f"algorithm.kl_ctrl.type={kind!r} is not one of ['fixed', 'adaptive']")
