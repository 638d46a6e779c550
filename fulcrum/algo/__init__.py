"""Core RL maths as pure tensor functions: advantages, policy/value losses, KL, masked statistics.

Mask convention everywhere: `response_mask` (B, T), 1 = the token counts. docs/algorithms.md lists
every estimator and loss with its formula and its verl name, and shows how to register a new one.
"""

from fulcrum.algo import covariance_losses as covariance_losses  # registers its losses on import
from fulcrum.algo import divergence_losses as divergence_losses  # registers its losses on import
from fulcrum.algo import rollout_correction as rollout_correction  # registers bypass_mode on import
from fulcrum.algo.advantages import ADVANTAGE_ESTIMATORS, compute_advantage, register_adv_est
from fulcrum.algo.kl import (
    KL_PENALTY_NAMES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_penalty,
)
from fulcrum.algo.losses import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_value_loss,
)
from fulcrum.algo.masked import masked_mean, masked_sum, masked_var, masked_whiten
from fulcrum.algo.policy_losses import POLICY_LOSSES, LossConfig, get_policy_loss_fn, register_policy_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_PENALTY_NAMES",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "LossConfig",
    "agg_loss",
    "apply_kl_penalty",
    "build_kl_controller",
    "compute_advantage",
    "compute_value_loss",
    "get_policy_loss_fn",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_adv_est",
    "register_policy_loss",
]
