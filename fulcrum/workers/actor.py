"""The actor (policy) worker and the reference worker: a Hugging Face causal LM, its log-probs, and
the PPO policy update: the loss of one micro-batch, run by the shared loop of fulcrum.workers.update.

No global state: everything lives on the instance (`model`, `optimizer`, `lr_scheduler`). With several
ranks the model is replicated or FSDP2-sharded in place (`fulcrum.workers.placement`) and the update
loop is the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from fulcrum.algo.rollout_correction import RolloutCorrection
from fulcrum.batch import Batch
from fulcrum.config.sections import ActorSection, ReferenceSection
from fulcrum.models.load import load_causal_lm
from fulcrum.models.lora import Adapters, LoraSettings
from fulcrum.parallel.fsdp import full_named_tensors
from fulcrum.workers.actor_loss import ActorLoss, PolicyForward
from fulcrum.workers.forwards import LogProbHead, ModelForwards, PiSquaredHead
from fulcrum.workers.micro_batch import MicroInputs
from fulcrum.workers.optim import build_lr_scheduler, build_optimizer
from fulcrum.workers.placement import place_on_ranks
from fulcrum.workers.state_parking import OptimizerStateParking
from fulcrum.workers.update import Metrics, Step, UpdatePlan, one_optimizer_step, ppo_update


def reference_worker(section: ReferenceSection, device: torch.device, actor: ActorWorker) -> Any:
    """The reference policy: the LoRA actor's own weights with its adapters off, or a model of its own."""
    if actor.adapters is not None:
        return AdaptersOffReference(section, actor)
    return ReferenceWorker(section, device)


class AdaptersOffReference:
    """The reference policy of a LoRA actor: its frozen base, i.e. the actor with the adapters disabled.

    verl's rule for LoRA: the reference is the base model, not the adapters the run started from.
    No second model is loaded; the forwards are the actor's (same layout and precision), micro-batched
    by the reference's sizes.
    """

    def __init__(self, section: ReferenceSection, actor: ActorWorker) -> None:
        assert actor.adapters is not None
        self.adapters = actor.adapters
        self.forwards = actor.forwards
        self.temperature = section.temperature
        self.sizes = section.log_prob

    def compute_ref_log_prob(self, batch: Batch) -> torch.Tensor:
        with self.adapters.disabled():
            return self.forwards.no_grad_pass(batch, self.sizes, LogProbHead(self.temperature))[0]


class ReferenceWorker:
    """The frozen reference policy (the actor's initial weights): log-probs only."""

    def __init__(self, section: ReferenceSection, device: torch.device) -> None:
        self.device = device
        self.model = load_causal_lm(
            section.model_path, device, override_config=section.override_config
        ).eval()
        self.model.requires_grad_(False)
        place_on_ranks(self.model, device, section.fsdp, "actor_rollout_ref.ref")
        self.forwards = ModelForwards(
            self.model,
            device,
            section.use_remove_padding,
            "reference",
            use_torch_compile=section.use_torch_compile,
            sp_size=section.ulysses_sequence_parallel_size,
            sp_key="actor_rollout_ref.ref.ulysses_sequence_parallel_size",
            lm_head_fp32=section.lm_head_fp32,
            cuda_graphs=section.cuda_graphs,
            cpp_wrapper=section.inductor_cpp_wrapper,
        )
        self.temperature = section.temperature
        self.sizes = section.log_prob

    def compute_ref_log_prob(self, batch: Batch) -> torch.Tensor:
        """log π_ref(response) (B, R) on the CPU, float32, no gradient, micro-batched."""
        return self.forwards.no_grad_pass(batch, self.sizes, LogProbHead(self.temperature))[0]


class ActorWorker:
    """Policy model + AdamW + LR schedule; `compute_log_prob` and `update_policy` as verl's DataParallelPPOActor."""

    def __init__(
        self,
        section: ActorSection,
        device: torch.device,
        total_training_steps: int,
        tokenizer: Any = None,
        bypass: RolloutCorrection | None = None,
    ) -> None:
        """`bypass`: rollout correction in bypass mode, whose loss corrects against the engine's log-probs
        (the batch's old_log_probs)."""
        self.cfg = section.actor
        self.device = device
        self.tokenizer = tokenizer
        model = section.model
        lora = LoraSettings.of(model, "actor_rollout_ref.model")
        dtype = lora.base_dtype(device)  # LoRA: the frozen base loads in the compute dtype, once
        self.model = load_causal_lm(
            model.path,
            device,
            model.enable_gradient_checkpointing,
            dtype=dtype,
            override_config=model.override_config,
        )
        # LoRA: adapters injected in place (the module keeps its class and names), the base frozen.
        self.adapters = Adapters(self.model, lora, model.path) if lora.enabled else None
        self.model.train()
        self.placement = place_on_ranks(self.model, device, self.cfg.fsdp_config, "actor_rollout_ref.actor")
        self.forwards = ModelForwards(
            self.model,
            device,
            bool(model.use_remove_padding),
            "actor",
            use_torch_compile=bool(self.cfg.use_torch_compile),
            sp_size=int(self.cfg.ulysses_sequence_parallel_size),
            sp_key="actor_rollout_ref.actor.ulysses_sequence_parallel_size",
            lm_head_fp32=bool(model.lm_head_fp32),
            cuda_graphs=bool(self.cfg.cuda_graphs),
            cpp_wrapper=bool(self.cfg.inductor_cpp_wrapper),
        )
        self.optimizer = build_optimizer(self.model.parameters(), self.cfg.optim, device)
        self.parking: OptimizerStateParking | None = None  # set by a trainer that updates several models
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer, self.cfg.optim, total_training_steps, "actor_rollout_ref.actor.optim"
        )
        self.temperature = section.temperature
        self.log_prob_sizes = section.log_prob
        cfg = self.cfg
        self.plan = UpdatePlan(
            role="actor",
            ppo_epochs=cfg.ppo_epochs,
            mini_batch_size=section.mini_batch_size,
            micro_batch_size=section.micro_batch_size,
            use_dynamic_bsz=cfg.use_dynamic_bsz,
            max_token_len=cfg.ppo_max_token_len_per_gpu,
            micro_batch_key="actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
            grad_clip=float(cfg.grad_clip),
            seed=section.seed,
        )
        self.bypass = bypass
        self.loss = ActorLoss(cfg, self.forwards, bypass)

    def compute_log_prob(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Old log-probs and entropies (B, R) of the batch's responses under the current policy, float32 on
        the CPU, no gradient, micro-batched."""
        logp, ent = self.forwards.no_grad_pass(
            batch, self.log_prob_sizes, LogProbHead(self.temperature, True)
        )
        return logp, ent

    def compute_sum_pi_squared(self, batch: Batch) -> torch.Tensor:
        """sum_v pi_v^2 per response token (B, R) under the current policy (actor.calculate_sum_pi_squared,
        for the optimal-token-baseline estimator), float32 on the CPU; padded micro-batches over the float32
        weights. One extra forward per step, only when the estimator needs it (verl computes it in the
        old-log-prob pass)."""
        return self.forwards.no_grad_pass(
            batch, self.log_prob_sizes, PiSquaredHead(self.temperature), padded=True
        )[0]

    def update_policy(
        self, batch: Batch, global_step: int = 0
    ) -> tuple[dict[str, float], tuple[torch.Tensor, torch.Tensor] | None]:
        """One PPO update (fulcrum.workers.update.ppo_update) of the actor's loss (`ActorLoss`); its metrics,
        and for a batch without `old_log_probs` the ones its forward gave.

        Needs `advantages` (and `ref_log_prob` with use_kl_loss). A strictly on-policy update (one
        optimiser step, `one_optimizer_step`) sees the weights the batch was scored under: outside bypass
        mode its loss takes its own forward's log-probs, detached, as the old ones (ratio exactly 1, as
        verl's dp_actor), so it needs no `old_log_probs`; without them it returns its forward's
        log-probs and entropies (B, R), float32 on the CPU in the batch's row order: what the old-log-prob
        pass gives (fulcrum/trainer/old_log_probs.py).
        """
        gives_old = "old_log_probs" not in batch
        on_policy = one_optimizer_step(self.plan, len(batch))
        if gives_old and not on_policy:
            raise ValueError(
                f"actor update: the batch has no old_log_probs, and {len(batch)} responses over "
                f"mini-batches of {self.plan.mini_batch_size} x {self.plan.ppo_epochs} epochs take "
                "more than one optimiser step (only a strictly on-policy update can do without them)"
            )
        ratio_one = on_policy and self.bypass is None
        keys = self.loss.keys(ratio_one, "rollout_is_weights" in batch)
        # Eager, not replayed: bypass mode's loss reads its correction's statistics on the host, and a
        # graph's stream holds its bucket's padding tokens, which the router term would count as real.
        device_only = self.bypass is None and self.loss.router is None
        step = Step(keys, (ratio_one, gives_old), 2 if gives_old else 0, device_only=device_only)
        metrics, given = ppo_update(self, batch, global_step, step)
        return metrics, ((given[0], given[1]) if gives_old else None)

    def fwd_bwd(
        self, inputs: MicroInputs, ratio_one: bool, gives_old: bool
    ) -> tuple[Metrics, tuple[torch.Tensor, ...]]:
        """The micro-batch's forward, loss (its share of the mini-batch loss) and backward, from its inputs
        alone; its detached metrics, and with `gives_old` its log-probs and entropies (B, R)."""
        head = LogProbHead(self.temperature, entropy=self.loss.entropy or gives_old)
        with self.loss.routed() as router_logits:
            log_prob, *entropy = self.forwards.forward(inputs, head)
        ent = entropy.pop() if entropy else None
        if ent is not None and not self.loss.entropy:
            ent = ent.detach()  # returned only: its autograd graph (the padded path's saved logits) goes now
        mask = inputs.rows["response_mask"].float()
        loss, metrics = self.loss(PolicyForward(inputs, log_prob, ent, mask, router_logits, ratio_one))
        self.forwards.backward(loss)
        return metrics, ((log_prob.detach(), ent) if gives_old and ent is not None else ())

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What the rollout engine needs after an update, under Hugging Face names, for
        `RolloutEngine.update_weights`: the policy's whole weights (under FSDP all-gathered one at a
        time: every rank consumes them all) or, with LoRA, only the adapted modules' merged weights
        W + scale·B·A (the frozen rest never changes)."""
        if self.adapters is not None:
            return self.adapters.merged_weights()
        return full_named_tensors(self.model)
