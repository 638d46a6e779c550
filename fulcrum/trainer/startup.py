"""What a run decides and says before its first step: the seeds, the KL line, the number of steps.

Kept apart from the loop (fulcrum.trainer.ppo_trainer) so that module holds only the step's stages.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from fulcrum.config import FulcrumConfig


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
