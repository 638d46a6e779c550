"""Actor and critic updates on a tiny model: metrics with verl's names, gradient accumulation exact,
the LR schedule stepping once per update, KL loss path, value loss lowering."""

from __future__ import annotations

import math

import pytest
import torch
from test_workers_units import make_batch  # tests/ is on sys.path under pytest

from fulcrum.algo.rollout_correction import RolloutCorrection
from fulcrum.config import load_config
from fulcrum.config.sections import actor_section, critic_section, reference_section
from fulcrum.workers.actor import ActorWorker, ReferenceWorker
from fulcrum.workers.critic import CriticWorker

CPU = torch.device("cpu")


def cfg_for(model: str, *extra: str):
    return load_config(
        [
            f"actor_rollout_ref.model.path={model}",
            f"critic.model.path={model}",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            "critic.model.enable_gradient_checkpointing=False",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=5",
            "critic.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "critic.optim.lr=1e-3",
            *extra,
        ]
    )


def rl_batch(seed: int = 0):
    batch = make_batch(b=8, p=10, r=7, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    mask = batch["response_mask"].float()
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=g) * mask
    batch["returns"] = torch.randn(batch["responses"].shape, generator=g) * mask
    return batch


def gradient_at_step(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Filled with the flattened gradient the optimiser steps on (the update releases it afterwards)."""
    seen: list[torch.Tensor] = []

    def grab(opt: torch.optim.Optimizer, *_: object) -> None:
        params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
        seen.append(torch.cat([p.grad.flatten() for p in params]))

    optimizer.register_step_pre_hook(grab)
    return seen


def test_actor_update_metrics_and_weights_change(tiny_dir: str) -> None:
    cfg = cfg_for(tiny_dir)
    actor = ActorWorker(actor_section(cfg), CPU, total_training_steps=10)
    batch = rl_batch()
    old, entropy = actor.compute_log_prob(batch)
    assert old.shape == batch["responses"].shape and (entropy[batch["response_mask"].bool()] > 0).all()
    batch["old_log_probs"] = old
    before = [p.detach().clone() for p in actor.model.parameters()]
    metrics, _ = actor.update_policy(batch, global_step=1)
    for key in (
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_lower",
        "actor/ppo_kl",
        "actor/grad_norm",
    ):
        assert key in metrics and math.isfinite(metrics[key]), key
    # First update: ratio = 1 → no clipping, KL 0 (old log-probs came from the same weights).
    assert metrics["actor/pg_clipfrac"] == 0.0 and abs(metrics["actor/ppo_kl"]) < 1e-5
    assert metrics["actor/lr"] == pytest.approx(1e-3)
    assert any(not torch.equal(b, p) for b, p in zip(before, actor.model.parameters(), strict=True))
    # Spent gradients are not kept (they would sit in memory through generation and the critic's passes).
    assert all(p.grad is None for p in actor.model.parameters())


def test_gradient_accumulation_matches_one_big_micro_batch(tiny_dir: str) -> None:
    """seq-mean-token-mean is a mean over sequences, so micro-batches of 2 scaled by 2/8 sum to the batch of 8."""
    grads = []
    for micro in (2, 8):
        cfg = cfg_for(
            tiny_dir,
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
            "actor_rollout_ref.actor.grad_clip=1e9",
        )
        torch.manual_seed(0)
        actor = ActorWorker(actor_section(cfg), CPU, total_training_steps=10)
        stepped = gradient_at_step(actor.optimizer)
        batch = rl_batch()
        batch["old_log_probs"] = actor.compute_log_prob(batch)[0] - 0.05  # ratio ≠ 1
        actor.update_policy(batch, global_step=1)
        grads.append(stepped[0])
    # float32 summation in another order (4 micro-batches, and torch's CPU threads) moves entries by up to
    # ~5e-7 of gradients up to 0.6; a mis-scaled micro-batch share would move them by a quarter or more.
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=2e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_packed_update_does_not_depend_on_the_micro_batch_cut(tiny_dir: str, mode: str) -> None:
    """Global-token normalisation: token budgets of 1, 3 and 8 rows' width give the same gradient as
    the padded path in one micro-batch, for a token mean too (verl 0.9.1)."""
    grads = []
    for micro, packed in ((8, False), (1, True), (3, True), (8, True)):
        cfg = cfg_for(
            tiny_dir,
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
            f"actor_rollout_ref.model.use_remove_padding={packed}",
            f"actor_rollout_ref.actor.loss_agg_mode={mode}",
            "actor_rollout_ref.actor.grad_clip=1e9",
        )
        torch.manual_seed(0)
        actor = ActorWorker(actor_section(cfg), CPU, total_training_steps=10)
        assert actor.forwards.packed == packed
        stepped = gradient_at_step(actor.optimizer)
        batch = rl_batch()
        batch["old_log_probs"] = actor.compute_log_prob(batch)[0] - 0.05
        metrics, _ = actor.update_policy(batch, global_step=1)
        grads.append(stepped[0])
        if micro == 8 and not packed:
            loss = metrics["actor/pg_loss"]
        else:  # the logged loss is the mini-batch's, whatever the cut
            assert metrics["actor/pg_loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    for g in grads[1:]:
        assert torch.allclose(g, grads[0], rtol=1e-4, atol=1e-6)


def test_kl_loss_needs_reference_and_is_logged(tiny_dir: str) -> None:
    cfg = cfg_for(
        tiny_dir, "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.1"
    )
    actor = ActorWorker(actor_section(cfg), CPU, total_training_steps=10)
    ref = ReferenceWorker(reference_section(cfg), CPU)
    batch = rl_batch()
    batch["old_log_probs"] = actor.compute_log_prob(batch)[0]
    batch["ref_log_prob"] = ref.compute_ref_log_prob(batch)
    assert torch.allclose(batch["ref_log_prob"], batch["old_log_probs"], atol=1e-5)  # same initial weights
    assert not any(p.requires_grad for p in ref.model.parameters())
    metrics, _ = actor.update_policy(batch, global_step=1)
    assert metrics["actor/kl_loss"] == pytest.approx(0.0, abs=1e-5)
    assert metrics["actor/kl_coef"] == 0.1


def test_warmup_schedule_steps_once_per_update(tiny_dir: str) -> None:
    cfg = cfg_for(tiny_dir, "actor_rollout_ref.actor.optim.lr_warmup_steps=2")
    actor = ActorWorker(actor_section(cfg), CPU, total_training_steps=10)
    batch = rl_batch()
    batch["old_log_probs"] = actor.compute_log_prob(batch)[0]
    lrs = [actor.update_policy(batch, global_step=s)[0]["actor/lr"] for s in range(3)]
    assert lrs == pytest.approx([0.0, 5e-4, 1e-3])


def test_critic_values_and_update_reduce_value_loss(tiny_dir: str) -> None:
    cfg = cfg_for(tiny_dir, "critic.ppo_epochs=4", "critic.cliprange_value=100")
    critic = CriticWorker(critic_section(cfg), CPU, total_training_steps=10)
    batch = rl_batch()
    batch["values"] = critic.compute_values(batch)
    assert (batch["values"][batch["response_mask"] == 0] == 0).all()
    first = critic.update_critic(batch, global_step=1)
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr"):
        assert key in first and math.isfinite(first[key]), key
    batch["values"] = critic.compute_values(batch)
    second = critic.update_critic(batch, global_step=2)
    assert second["critic/vf_loss"] < first["critic/vf_loss"]
    assert all(p.grad is None for p in critic.model.parameters())


def test_bypass_mode_is_the_registered_loss_an_actor_takes_with_its_correction(tiny_dir: str) -> None:
    """verl registers bypass as the policy loss "bypass_mode" and switches to it with rollout correction's
    bypass mode (set by hand without it, the configuration refuses it: tests/test_config.py)."""
    bypass = RolloutCorrection(rollout_is="token", bypass_mode=True)
    actor = ActorWorker(actor_section(cfg_for(tiny_dir)), CPU, total_training_steps=1, bypass=bypass)
    batch = rl_batch()
    batch["old_log_probs"] = -6.0 * batch["response_mask"].float()  # the engine's, as the trainer sets them
    metrics, _ = actor.update_policy(batch, global_step=1)
    assert metrics["rollout_corr/rollout_is_mean"] > 0  # the correction, inside the loss
