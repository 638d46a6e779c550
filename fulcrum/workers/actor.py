"""The actor (policy) worker and the reference worker: a Hugging Face causal LM, its log-probs, and
the PPO policy update (ppo_epochs × shuffled mini-batches × micro-batches with gradient accumulation).

No global state: everything lives on the instance (`model`, `optimizer`, `lr_scheduler`). With several
ranks the model is replicated or FSDP2-sharded in place (`fulcrum.workers.placement`) and the update
loop is the same.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch

from fulcrum.algo.kl import kl_penalty
from fulcrum.algo.losses import agg_loss
from fulcrum.algo.policy_losses import compute_policy_loss
from fulcrum.algo.rollout_correction import RolloutCorrection, bypass_policy_loss
from fulcrum.batch import Batch, host_to_device
from fulcrum.config.sections import ActorSection, ForwardSizes, ReferenceSection
from fulcrum.models.load import load_causal_lm
from fulcrum.parallel import rank_rows, reduce_metrics
from fulcrum.parallel.fsdp import full_named_tensors
from fulcrum.workers.micro_batch import restore_order
from fulcrum.workers.optim import build_lr_scheduler, build_optimizer, clip_and_step
from fulcrum.workers.placement import place_on_ranks
from fulcrum.workers.recipes import compute_sum_pi_squared
from fulcrum.workers.runner import ModelRunner

logger = logging.getLogger(__name__)


def compute_log_prob(
    runner: ModelRunner,
    batch: Batch,
    sizes: ForwardSizes,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(response) (B, R) and entropy (B, R) on the CPU, float32, no gradient, micro-batched.

    Results stay on the device until the pass ends: one host copy, no sync per micro-batch.
    """
    micro, order = runner.micro_batches(
        batch,
        sizes.micro_batch_size,
        sizes.use_dynamic_bsz,
        sizes.max_token_len,
        sizes.key,
        sort_by_length=True,
    )
    model = runner.model
    was_training = model.training
    model.eval()  # no dropout: log-probs must match what the update's ratio starts from
    logps, ents = [], []
    try:
        with torch.no_grad(), runner.active():
            for mb in micro:
                logp, ent = runner.log_prob(mb, temperature, with_entropy)
                logps.append(logp)
                if ent is not None:
                    ents.append(ent)
    finally:
        model.train(was_training)
    logp_all = restore_order(logps, order).cpu()
    return logp_all, (restore_order(ents, order).cpu() if with_entropy else None)


class ReferenceWorker:
    """The frozen reference policy (the actor's initial weights): log-probs only."""

    def __init__(self, section: ReferenceSection, device: torch.device) -> None:
        self.device = device
        self.model = load_causal_lm(section.model_path, device).eval()
        self.model.requires_grad_(False)
        place_on_ranks(self.model, device, section.fsdp, "actor_rollout_ref.ref")
        self.runner = ModelRunner(
            self.model,
            device,
            section.use_remove_padding,
            "reference",
            use_torch_compile=section.use_torch_compile,
        )
        self.temperature = section.temperature
        self.sizes = section.log_prob

    def compute_ref_log_prob(self, batch: Batch) -> torch.Tensor:
        logp, _ = compute_log_prob(self.runner, batch, self.sizes, self.temperature, False)
        return logp


class ActorWorker:
    """Policy model + AdamW + LR schedule; `compute_log_prob` and `update_policy` as verl's DataParallelPPOActor."""

    def __init__(
        self, section: ActorSection, device: torch.device, total_training_steps: int, tokenizer: Any = None
    ) -> None:
        self.cfg = section.actor
        self.device = device
        self.tokenizer = tokenizer
        model = section.model
        self.model = load_causal_lm(model.path, device, model.enable_gradient_checkpointing)
        self.model.train()
        self.placement = place_on_ranks(self.model, device, self.cfg.fsdp_config, "actor_rollout_ref.actor")
        self.runner = ModelRunner(
            self.model,
            device,
            bool(model.use_remove_padding),
            "actor",
            use_torch_compile=bool(self.cfg.use_torch_compile),
        )
        self.optimizer = build_optimizer(self.model.parameters(), self.cfg.optim, device)
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer, self.cfg.optim, total_training_steps, "actor_rollout_ref.actor.optim"
        )
        self.temperature = section.temperature
        self.mini_batch_size = section.mini_batch_size  # responses per optimiser step
        self.micro_batch_size = section.micro_batch_size
        self.log_prob_sizes = section.log_prob
        self.shuffle_seed = section.seed
        # Rollout correction's bypass mode (set by the trainer): the loss corrects against the engine.
        self.bypass: RolloutCorrection | None = None

    def compute_log_prob(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Old log-probs and entropies (B, R) of the batch's responses under the current policy."""
        logp, ent = compute_log_prob(self.runner, batch, self.log_prob_sizes, self.temperature, True)
        assert ent is not None
        return logp, ent

    def compute_sum_pi_squared(self, batch: Batch) -> torch.Tensor:
        """sum_v pi_v^2 per response token (B, R) under the current policy (optimal_token_baseline)."""
        s = self.log_prob_sizes
        return compute_sum_pi_squared(
            self.model,
            batch,
            s.micro_batch_size,
            s.use_dynamic_bsz,
            s.max_token_len,
            self.temperature,
            self.device,
        )

    def update_policy(self, batch: Batch, global_step: int = 0) -> dict[str, float]:
        """ppo_epochs × mini-batches (shuffled) × micro-batches; one optimiser step per mini-batch.

        The shuffle is seeded by (trainer.seed, global_step) so a resumed run repeats it exactly.
        Needs `old_log_probs`, `advantages` (and `ref_log_prob` with use_kl_loss). The loss of each
        micro-batch is its share of the mini-batch loss (global-token normalisation, verl 0.9.1: the
        token or sequence count of `loss_agg_mode` is the mini-batch's), so the gradient does not
        depend on how the mini-batch is cut. Metrics: losses are per mini-batch, clip fractions and
        KL means over micro-batches, grad_norm per mini-batch, each then averaged (as verl reduces).
        """
        cfg = self.cfg
        if len(batch) % self.mini_batch_size != 0 and len(batch) > self.mini_batch_size:
            logger.warning(
                "actor: %d responses do not divide into mini-batches of %d", len(batch), self.mini_batch_size
            )
        self.model.train()
        metrics: dict[str, list[torch.Tensor | float]] = defaultdict(list)
        generator = torch.Generator().manual_seed(self.shuffle_seed * 1_000_003 + global_step)
        clip_low, clip_high = cfg.clip_ratio_low, cfg.clip_ratio_high  # resolved: follow clip_ratio when null
        assert clip_low is not None and clip_high is not None
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(len(batch), generator=generator)
            for mini in batch.select(order).split(self.mini_batch_size):
                agg = global_agg_kwargs(mini["response_mask"])  # the whole mini-batch's counts
                micro, _ = self.runner.micro_batches(
                    mini.select(rank_rows(len(mini))),  # this rank's share (all of it in one process)
                    self.micro_batch_size,
                    cfg.use_dynamic_bsz,
                    cfg.ppo_max_token_len_per_gpu,
                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                )
                self.optimizer.zero_grad(set_to_none=True)
                shares: dict[str, list[torch.Tensor]] = defaultdict(list)
                with self.runner.active():
                    for mb in micro:
                        step_metrics = self._micro_step(mb, agg, clip_low, clip_high)
                        self.runner.accumulate_grads()
                        for k, v in step_metrics.items():
                            if k in _LOSS_SHARES:
                                shares[k].append(v)  # type: ignore[arg-type]
                            else:
                                metrics[k].append(v)
                for k, parts in shares.items():
                    metrics[k].append(torch.stack(parts).sum())
                metrics["actor/grad_norm"].append(self._optimizer_step(float(cfg.grad_clip), "actor"))
        metrics["actor/lr"].append(self.lr_scheduler.get_last_lr()[0])
        self.lr_scheduler.step()
        return reduce_metrics(mean_metrics(metrics), sums=_LOSS_SHARES)

    def _micro_step(
        self, mb: Batch, agg: dict[str, float], clip_low: float, clip_high: float
    ) -> dict[str, torch.Tensor | float]:
        """Forward, loss (this micro-batch's share of the mini-batch loss), backward; detached metrics."""
        cfg = self.cfg
        mask = host_to_device(mb["response_mask"], self.device).float()
        with_entropy = float(cfg.entropy_coeff) != 0.0
        log_prob, entropy = self.runner.log_prob(mb, self.temperature, with_entropy, mask)
        old_log_prob = host_to_device(mb["old_log_probs"], self.device)
        advantages = host_to_device(mb["advantages"], self.device)
        clip = dict(
            cliprange=float(cfg.clip_ratio), cliprange_low=float(clip_low), cliprange_high=float(clip_high)
        )
        out: dict[str, torch.Tensor | float] = {}
        if self.bypass is not None:  # old log-probs are the engine's; correct against the current policy
            loss_out, corr_metrics = bypass_policy_loss(
                old_log_prob, log_prob, advantages, mask, self.bypass, **clip,
                clip_ratio_c=float(cfg.clip_ratio_c), loss_agg_mode=cfg.loss_agg_mode, **agg,
            )  # fmt: skip
            out.update(corr_metrics)
        else:
            weights = mb.tensors.get("rollout_is_weights")
            loss_out = compute_policy_loss(
                old_log_prob=old_log_prob,
                log_prob=log_prob,
                advantages=advantages,
                response_mask=mask,
                **clip,
                clip_ratio_c=float(cfg.clip_ratio_c),
                loss_agg_mode=cfg.loss_agg_mode,
                loss_mode=cfg.policy_loss.loss_mode,
                rollout_is_weights=host_to_device(weights, self.device) if weights is not None else None,
                tau_pos=float(cfg.tau_pos),
                tau_neg=float(cfg.tau_neg),
                **agg,
            )
        pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = loss_out
        policy_loss = pg_loss
        if entropy is not None:
            entropy_loss = agg_loss(entropy, mask, cfg.loss_agg_mode, **agg)
            policy_loss = policy_loss - float(cfg.entropy_coeff) * entropy_loss
        if cfg.use_kl_loss:
            kld = kl_penalty(log_prob, host_to_device(mb["ref_log_prob"], self.device), cfg.kl_loss_type)
            kl_loss = agg_loss(kld, mask, cfg.loss_agg_mode, **agg)
            policy_loss = policy_loss + float(cfg.kl_loss_coef) * kl_loss
            out["actor/kl_loss"] = kl_loss.detach()
            out["actor/kl_coef"] = float(cfg.kl_loss_coef)
        policy_loss.backward()
        out.update(
            {
                "actor/pg_loss": pg_loss.detach(),
                "actor/pg_clipfrac": pg_clipfrac,
                "actor/ppo_kl": ppo_kl,
                "actor/pg_clipfrac_lower": pg_clipfrac_lower,
            }
        )
        return out

    def _optimizer_step(self, grad_clip: float, role: str) -> float:
        return clip_and_step(self.model, self.optimizer, grad_clip, role, self.placement)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's whole weights under Hugging Face names, for `RolloutEngine.update_weights`
        (under FSDP all-gathered one at a time: every rank consumes them all)."""
        return full_named_tensors(self.model)


# Metrics that are a micro-batch's share of the mini-batch loss: summed per mini-batch (and over ranks).
_LOSS_SHARES = frozenset({"actor/pg_loss", "actor/kl_loss", "critic/vf_loss"})


def global_agg_kwargs(response_mask: torch.Tensor) -> dict[str, float]:
    """`agg_loss` keywords for a micro-batch of this mini-batch: its token and sequence counts.

    token-mean divides by the mini-batch's tokens, seq-mean-* by its sequences with a token, so the
    micro-batch losses add up to the mini-batch loss however it is cut (verl 0.9.1's global-token
    normalisation). Counted on the host (the batch lives there): no device sync.
    """
    tokens_per_seq = response_mask.sum(-1)  # (B,)
    return {
        "batch_num_tokens": max(float(tokens_per_seq.sum()), 1.0),
        "global_batch_size": max(float((tokens_per_seq > 0).sum()), 1.0),
    }


def mean_metrics(metrics: dict[str, list[torch.Tensor | float]]) -> dict[str, float]:
    """Mean of each metric's values; device tensors are brought to the host in one copy."""
    tensors = [(k, i) for k, v in metrics.items() for i, x in enumerate(v) if isinstance(x, torch.Tensor)]
    if tensors:
        stacked = torch.stack([metrics[k][i].detach().float().reshape(()) for k, i in tensors])  # type: ignore[union-attr]
        for (k, i), value in zip(tensors, stacked.cpu().tolist(), strict=True):
            metrics[k][i] = value
    return {k: float(sum(float(x) for x in v) / len(v)) for k, v in metrics.items()}
