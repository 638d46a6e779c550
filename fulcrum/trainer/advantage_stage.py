"""Stage 4 of a step: the rewards (scores, minus the KL penalty when it is in the reward), rollout
correction against the engine's log-probs, the advantages and returns, then PF-PPO's resampling.
"""

from __future__ import annotations

from typing import Any

import torch

from fulcrum.algo.advantages import compute_advantage
from fulcrum.algo.kl import KLController, apply_kl_penalty
from fulcrum.algo.pf_ppo import pf_ppo_resample_indices
from fulcrum.algo.rollout_correction import RolloutCorrection, compute_rollout_correction
from fulcrum.batch import Batch


def kl_in_reward(batch: Batch, kl_ctrl: KLController, kind: str) -> tuple[torch.Tensor, dict[str, float]]:
    """rewards = scores - β·KL(old ‖ ref) per token; the controller then adapts β (verl)."""
    beta = kl_ctrl.value
    out = apply_kl_penalty(
        token_level_scores=batch["token_level_scores"],
        old_log_prob=batch["old_log_probs"],
        ref_log_prob=batch["ref_log_prob"],
        response_mask=batch["response_mask"].float(),
        kl_coef=beta,
        kind=kind,
    )
    kl_ctrl.update(current_kl=out.current_kl, n_steps=len(batch))
    return out.token_level_rewards, {
        "actor/reward_kl_penalty": out.current_kl,
        "actor/reward_kl_penalty_coeff": beta,
    }


def advantages_of(batch: Batch, alg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) (B, R) by algorithm.adv_estimator; grpo/rloo group rows by prompt uid."""
    return compute_advantage(
        alg.adv_estimator,
        token_level_rewards=batch["token_level_rewards"],
        response_mask=batch["response_mask"].float(),
        values=batch.tensors.get("values"),
        index=batch.non_tensors["uid"],
        reward_baselines=batch.tensors.get("reward_baselines"),
        gamma=float(alg.gamma),
        lam=float(alg.lam),
        norm_adv_by_std_in_grpo=bool(alg.norm_adv_by_std_in_grpo),
        old_log_probs=batch.tensors.get("old_log_probs"),
        sum_pi_squared=batch.tensors.get("sum_pi_squared"),
        rollout_is_weights=batch.tensors.get("rollout_is_weights"),
    )


def rollout_correction_of(cfg: Any) -> RolloutCorrection | None:
    """algorithm.rollout_correction as the maths takes it, or None when nothing asks for it (verl computes
    the `rollout_corr/*` metrics when weights, rejection or bypass are on, or the engine's log-probs are
    requested with rollout.calculate_log_probs)."""
    rc = cfg.algorithm.rollout_correction
    wanted = (
        rc.rollout_is is not None
        or rc.rollout_rs is not None
        or rc.bypass_mode
        or cfg.actor_rollout_ref.rollout.calculate_log_probs
    )
    if not wanted:
        return None
    return RolloutCorrection(
        rollout_is=rc.rollout_is,
        rollout_is_threshold=rc.rollout_is_threshold,
        rollout_is_batch_normalize=bool(rc.rollout_is_batch_normalize),
        rollout_rs=rc.rollout_rs,
        rollout_rs_threshold=rc.rollout_rs_threshold,
        bypass_mode=bool(rc.bypass_mode),
        loss_type=rc.loss_type,
    )


def correct_batch(batch: Batch, correction: RolloutCorrection) -> dict[str, float]:
    """Decoupled mode: importance weights (`rollout_is_weights`) and rejection (a narrower response mask)
    between the engine's log-probs and the old ones; returns the `rollout_corr/*` metrics."""
    mask = batch["response_mask"]
    weights, kept, metrics = compute_rollout_correction(
        batch["old_log_probs"], batch["rollout_log_probs"], mask.float(), correction
    )
    batch["response_mask"] = kept.to(mask.dtype)
    if weights is not None:
        batch["rollout_is_weights"] = weights
    return metrics


def pf_ppo_resample(batch: Batch, pf_ppo: Any, generator: torch.Generator | None = None) -> Batch:
    """PF-PPO: B rows drawn with replacement by the rows' summed scores (after gae, as verl)."""
    scores = batch["token_level_scores"].sum(dim=-1)
    rows = pf_ppo_resample_indices(scores, pf_ppo.reweight_method, float(pf_ppo.weight_pow), generator)
    return batch.select(rows)
