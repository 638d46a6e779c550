"""The trainer's side of verl's recipes, one small function per stage so `train_step` stays readable:
scoring with a reward model and/or the reward manager, rollout correction of a batch, PF-PPO
resampling, and the start-up lines that say which recipe keys act and which do not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fulcrum.algo.pf_ppo import pf_ppo_resample_indices
from fulcrum.algo.rollout_correction import RolloutCorrection, compute_rollout_correction
from fulcrum.batch import Batch
from fulcrum.models.reward_model import RewardModel
from fulcrum.reward.manager import RewardResult


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


def reward_model_of(cfg: Any, policy_tokenizer: Any, device: torch.device) -> RewardModel | None:
    rm = cfg.reward_model
    if not rm.enable:
        return None
    return RewardModel(
        rm.model.path,
        policy_tokenizer,
        device,
        micro_batch_size=rm.micro_batch_size_per_gpu
        or rm.micro_batch_size,  # None: 8 (verl's reward loop)  # None: 8 (verl's reward loop)
        max_length=rm.max_length,
    )


def reward_model_scores(batch: Batch, reward_model: RewardModel) -> torch.Tensor:
    """The reward model's score (B,) of each row's prompt and response."""
    prompt_mask = batch["attention_mask"][:, : batch.prompt_length].bool()
    prompts = [row[keep].tolist() for row, keep in zip(batch["prompts"], prompt_mask, strict=True)]
    lengths = batch["response_mask"].sum(-1).tolist()
    responses = [batch["responses"][i, : int(n)].tolist() for i, n in enumerate(lengths)]
    return reward_model.score(prompts, responses, batch.non_tensors.get("raw_prompt"))


def score(
    batch: Batch,
    score_rules: Callable[[Batch], tuple[torch.Tensor, RewardResult]],
    reward_model: RewardModel | None,
    custom_reward: bool,
) -> tuple[torch.Tensor, RewardResult]:
    """token_level_scores (B, R) and the scoring result, as verl combines a reward model with rules:
    without a custom reward function the reward model's score is the reward; with one, that function
    decides and finds the model's score in `extra_info["rm_score"]`. `score_rules` runs the reward manager."""
    if reward_model is None:
        return score_rules(batch)
    rm_scores = reward_model_scores(batch, reward_model)
    if custom_reward:
        infos = [
            dict(info or {}, rm_score=float(s))
            for info, s in zip(batch.non_tensors["extra_info"], rm_scores, strict=True)
        ]
        with_scores = Batch(batch.tensors, dict(batch.non_tensors, extra_info=infos))
        return score_rules(with_scores)
    token_level = torch.zeros(batch["responses"].shape, dtype=torch.float32)
    lengths = batch["response_mask"].sum(-1).long()
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    token_level[rows, lengths[rows] - 1] = rm_scores[rows]
    return token_level, RewardResult(scores=rm_scores.tolist())


def startup_lines(cfg: Any) -> list[str]:
    """One line per recipe setting whose effect a verl user should hear about at start-up."""
    lines = []
    rm, alg = cfg.reward_model, cfg.algorithm
    if rm.enable:
        combined = (
            "decides, given extra_info['rm_score']" if cfg.custom_reward_function.path else "is not used"
        )
        lines.append(
            f"reward: reward model {rm.model.path} scores each response; the rule-based function {combined}"
        )
    if rm.use_reward_loop or rm.num_workers or rm.rollout:
        lines.append(
            "note: reward_model.{use_reward_loop, num_workers, rollout.*} have no effect: rewards are scored in "
            "this process (verl's reward loop runs reward workers and a reward-model server)"
        )
    if rm.reward_manager != "naive":
        lines.append(f"reward: manager {rm.reward_manager}")
    rc = alg.rollout_correction
    if rc.bypass_mode:
        lines.append(
            f"rollout correction: bypass mode ({rc.loss_type}): the engine's log-probs are the old ones, no "
            "old-log-prob pass"
        )
    elif rc.rollout_is or rc.rollout_rs:
        lines.append(f"rollout correction: importance weights {rc.rollout_is}, rejection {rc.rollout_rs}")
    if alg.filter_groups.enable:
        lines.append(
            f"dynamic sampling: groups whose {alg.filter_groups.metric} is equal across responses are dropped; "
            f"up to {alg.filter_groups.max_num_gen_batches or 'unlimited'} generation rounds per step"
        )
    if alg.use_pf_ppo and alg.adv_estimator != "gae":
        lines.append("note: algorithm.use_pf_ppo has no effect: PF-PPO resamples after gae only (as verl)")
    return lines
