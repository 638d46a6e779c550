"""What a run decides and says before its first step: the seeds, the KL line, the recipe lines, the
number of steps.

Kept apart from the loop (fulcrum.trainer.ppo_trainer) so that module holds only the step's stages.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from fulcrum.config import FulcrumConfig
from fulcrum.models.load import load_causal_lm
from fulcrum.models.lora import base_view
from fulcrum.models.precision import compute_dtype
from fulcrum.parallel.fsdp import is_sharded
from fulcrum.rollout import uses_native_engine
from fulcrum.trainer.old_log_probs import update_can_give_old_log_probs
from fulcrum.workers.actor import ActorWorker


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def kl_startup_line(cfg: FulcrumConfig) -> str:
    """The one line that says which KL (if any) this run applies."""
    alg, actor = cfg.algorithm, cfg.actor_rollout_ref.actor
    parts = []
    if alg.use_kl_in_reward:
        parts.append(f"KL in reward ({alg.kl_penalty}, {alg.kl_ctrl.type} coef {alg.kl_ctrl.kl_coef})")
    if actor.use_kl_loss:
        parts.append(f"KL loss ({actor.kl_loss_type}, coef {actor.kl_loss_coef})")
    if parts:
        return "KL: " + " and ".join(parts) + "; reference policy loaded"
    return (
        "KL: none (algorithm.use_kl_in_reward and actor.use_kl_loss are both off, so "
        f"algorithm.kl_ctrl.kl_coef={alg.kl_ctrl.kl_coef} has no effect, as in verl); no reference policy"
    )


def resolve_total_steps(cfg: FulcrumConfig, steps_per_epoch: int) -> int:
    """trainer.total_training_steps when set, else steps_per_epoch × total_epochs (verl)."""
    total = steps_per_epoch * int(cfg.trainer.total_epochs)
    if cfg.trainer.total_training_steps is not None:
        total = int(cfg.trainer.total_training_steps)
    if total <= 0:
        raise ValueError(
            f"no training steps: {steps_per_epoch} steps per epoch × trainer.total_epochs={cfg.trainer.total_epochs} "
            f"(trainer.total_training_steps={cfg.trainer.total_training_steps}); is data.train_batch_size larger "
            "than the training set?"
        )
    return total


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
    if rm.use_reward_loop or rm.rollout:
        lines.append(
            "note: reward_model.{use_reward_loop, rollout.*} have no effect: rewards are scored in this process, "
            "sympy, Math-Verify and code in reward_model.num_workers processes (verl's reward loop runs reward "
            "workers and a reward-model server)"
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
    if update_can_give_old_log_probs(cfg):
        lines.append(
            "old log-probs: from the actor's update (one epoch, one mini-batch a step: strictly on-policy, ratio 1 "
            "as in verl); no old-log-prob pass, so rollout.log_prob_micro_batch_size_per_gpu has no effect"
        )
    if alg.use_pf_ppo and alg.adv_estimator != "gae":
        lines.append("note: algorithm.use_pf_ppo has no effect: PF-PPO resamples after gae only (as verl)")
    return lines


def engine_model_of(actor: ActorWorker, arr: Any, device: torch.device) -> torch.nn.Module:
    """The whole model the rollout engine starts from: the actor's module, or a plain copy in the
    compute dtype when FSDP shards it (with the actor's `override_config`: one config for both). A
    LoRA actor's module carries peft's layers, so an engine that copies the weights (the native one)
    starts from the base under its Hugging Face names (shared, not copied) and takes the adapters'
    merged effect with the first weight sync; the `hf` backend samples with the module itself."""
    if is_sharded(actor.model):  # in the dtype the engine runs in, not as float32 masters (28 GB at 7B)
        return load_causal_lm(
            arr.model.path, device, dtype=compute_dtype(device), override_config=arr.model.override_config
        )
    if actor.adapters is not None and uses_native_engine(arr.rollout, actor.model.config, device):
        return base_view(actor.model)
    return actor.model
