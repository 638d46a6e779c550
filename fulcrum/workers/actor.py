"""The actor (policy) worker and the reference worker: a Hugging Face causal LM, its log-probs, and
the PPO policy update: the loss of one micro-batch, run by the shared loop of fulcrum.workers.update.

No global state: everything lives on the instance (`model`, `optimizer`, `lr_scheduler`). With several
ranks the model is replicated or FSDP2-sharded in place (`fulcrum.workers.placement`) and the update
loop is the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from fulcrum.algo.kl import kl_penalty
from fulcrum.algo.losses import agg_loss
from fulcrum.algo.policy_losses import LossConfig, get_policy_loss_fn, import_policy_losses
from fulcrum.algo.rollout_correction import RolloutCorrection, bypass_policy_loss
from fulcrum.batch import Batch
from fulcrum.config.sections import ActorSection, ForwardSizes, ReferenceSection
from fulcrum.models.load import load_causal_lm
from fulcrum.models.lora import Adapters, LoraSettings
from fulcrum.models.router_loss import load_balancing_loss, recorded_router_logits, router_loss_settings
from fulcrum.parallel import all_gather_rows
from fulcrum.parallel.fsdp import full_named_tensors
from fulcrum.workers.forwards import ModelForwards
from fulcrum.workers.micro_batch import HostInputs, MicroInputs
from fulcrum.workers.optim import build_lr_scheduler, build_optimizer
from fulcrum.workers.placement import place_on_ranks
from fulcrum.workers.state_parking import OptimizerStateParking
from fulcrum.workers.step_graphs import micro_step
from fulcrum.workers.update import UpdatePlan, one_optimizer_step, ppo_update

# A batch column an update without old log-probs adds: each row's index, to put what it records in order.
ROW = "update_row"


def compute_log_prob(
    forwards: ModelForwards,
    batch: Batch,
    sizes: ForwardSizes,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(response) (B, R) and entropy (B, R) on the CPU, float32, no gradient, micro-batched."""

    def forward(inputs: MicroInputs) -> tuple[torch.Tensor, ...]:
        logp, ent = inputs.log_prob(forwards, temperature, with_entropy, inputs.row("response_mask"))
        return (logp,) if ent is None else (logp, ent)

    outputs = forwards.no_grad_pass(batch, sizes, forward, graph_key=("log_prob", temperature, with_entropy))
    return outputs[0], (outputs[1] if with_entropy else None)


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
            logp, _ = compute_log_prob(self.forwards, batch, self.sizes, self.temperature, False)
        return logp


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
        logp, _ = compute_log_prob(self.forwards, batch, self.sizes, self.temperature, False)
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
        import_policy_losses(cfg.policy_loss.path)
        self.policy_loss = get_policy_loss_fn(cfg.policy_loss.loss_mode)
        # A mixture of experts whose config sets output_router_logits: (router_aux_loss_coef, top-k).
        self.router_loss = router_loss_settings(self.model)
        # Rollout correction's bypass mode (set by the trainer): the loss corrects against the engine.
        self.bypass: RolloutCorrection | None = None
        # The update under way is strictly on-policy (one optimiser step); `recorded` gathers its forward's
        # (rows, log-probs, entropies) when the batch came without old log-probs.
        self.on_policy = False
        self.recorded: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def compute_log_prob(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Old log-probs and entropies (B, R) of the batch's responses under the current policy."""
        logp, ent = compute_log_prob(self.forwards, batch, self.log_prob_sizes, self.temperature, True)
        assert ent is not None
        return logp, ent

    def compute_sum_pi_squared(self, batch: Batch) -> torch.Tensor:
        """sum_v pi_v^2 per response token (B, R) under the current policy (optimal_token_baseline)."""
        return self.forwards.sum_pi_squared(batch, self.log_prob_sizes, self.temperature)

    def update_policy(self, batch: Batch, global_step: int = 0) -> dict[str, float]:
        """One PPO update (fulcrum.workers.update.ppo_update) of the loss named by actor.policy_loss.loss_mode.

        Needs `advantages` (and `ref_log_prob` with use_kl_loss), and `old_log_probs` unless the update is
        strictly on-policy (`one_optimizer_step`). Then the loss takes its own forward's log-probs, detached,
        as the old ones (ratio exactly 1, as verl's dp_actor), and a batch without `old_log_probs` gets
        them and the entropies recorded for `recorded_log_probs` (fulcrum/trainer/old_log_probs.py).
        """
        self.on_policy = one_optimizer_step(self.plan, len(batch))
        self.recorded = None
        if "old_log_probs" not in batch:
            if not self.on_policy:
                raise ValueError(
                    f"actor update: the batch has no old_log_probs, and {len(batch)} responses over "
                    f"mini-batches of {self.plan.mini_batch_size} x {self.plan.ppo_epochs} epochs take "
                    "more than one optimiser step (only a strictly on-policy update can do without them)"
                )
            # An empty first entry: a rank whose share is empty still has something to concatenate.
            empty = torch.zeros(0, batch.response_length, device=self.device)
            self.recorded = [(torch.zeros(0, dtype=torch.long), empty, empty)]
            batch = Batch({**batch.tensors, ROW: torch.arange(len(batch))}, batch.non_tensors)
        return ppo_update(self, batch, global_step)

    def recorded_log_probs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The last update's log-probs and entropies (B, R), float32 on the CPU, in the batch's row order:
        what the old-log-prob pass gives, from the update's forward before its step."""
        if self.recorded is None:
            raise RuntimeError("recorded_log_probs: the last update had old_log_probs and recorded nothing")
        # Each rank recorded the rows of its share: all of them, from every rank.
        sp_size = self.forwards.sp_size
        rows = all_gather_rows(torch.cat([r for r, _, _ in self.recorded]), sp_size)
        log_probs, entropys = (
            all_gather_rows(torch.cat([part[i] for part in self.recorded]).float().cpu(), sp_size)
            for i in (1, 2)
        )
        order = torch.empty_like(rows)
        order[rows] = torch.arange(len(rows))
        return log_probs[order], entropys[order]

    def micro_step(self, mb: Batch, agg: dict[str, float]) -> dict[str, torch.Tensor | float]:
        """Forward, loss (this micro-batch's share of the mini-batch loss), backward; detached metrics:
        `loss_step`, replayed from a CUDA graph where it can be (`fulcrum.workers.step_graphs`: not while
        recording old log-probs, in bypass mode or with a router loss, which read the batch on the host)."""
        host_only = self.recorded is not None or self.bypass is not None or self.router_loss is not None
        keys = ["response_mask", "advantages"]
        keys += [] if self.on_policy else ["old_log_probs"]
        keys += ["ref_log_prob"] if self.cfg.use_kl_loss else []
        keys += ["rollout_is_weights"] if "rollout_is_weights" in mb.tensors else []
        graphs = None if host_only else self.forwards.graphs
        return micro_step(graphs, mb, agg, keys, (self.on_policy,), self.loss_step, self.device)

    def loss_step(
        self, inputs: MicroInputs, agg: dict[str, float | torch.Tensor]
    ) -> dict[str, torch.Tensor | float]:
        """The micro-batch's forward, loss and backward.

        policy loss = pg_loss - entropy_coeff * entropy + kl_loss_coef * KL(pi || ref), each aggregated
        by actor.loss_agg_mode (+ router_aux_loss_coef * the routers' load-balancing loss, when a
        mixture of experts' config sets output_router_logits: `fulcrum.models.router_loss`). A loss reports what it defines; a loss that clips nothing reports no
        clip fractions, which are then 0. `agg`: the mini-batch's counts (floats, or 0-d device tensors
        in a graph).
        """
        cfg = self.cfg
        mask = inputs.row("response_mask").float()
        entropy_coeff = float(cfg.entropy_coeff)
        with_entropy = entropy_coeff != 0.0 or self.recorded is not None
        routed = (
            contextlib.nullcontext([]) if self.router_loss is None else recorded_router_logits(self.model)
        )
        with routed as router_logits:
            log_prob, entropy = inputs.log_prob(self.forwards, self.temperature, with_entropy, mask)
        if self.on_policy and self.bypass is None:  # the weights that scored the batch: ratio exactly 1
            old_log_prob = log_prob.detach()
        else:
            old_log_prob = inputs.row("old_log_probs")
        if self.recorded is not None:
            assert entropy is not None and isinstance(inputs, HostInputs)
            self.recorded.append((inputs.batch[ROW], log_prob.detach(), entropy.detach()))
            if entropy_coeff == 0.0:
                entropy = None  # recorded only: its autograd graph (the padded path's saved logits) goes now
        advantages = inputs.row("advantages")
        config = LossConfig.of(cfg, agg)  # type: ignore[arg-type]
        if self.bypass is not None:  # old log-probs are the engine's; correct against the current policy
            pg_loss, pg_metrics = bypass_policy_loss(
                old_log_prob, log_prob, advantages, mask, cfg.loss_agg_mode, config, self.bypass
            )
        else:
            weights = inputs.row("rollout_is_weights") if inputs.has("rollout_is_weights") else None
            pg_loss, pg_metrics = self.policy_loss(
                old_log_prob, log_prob, advantages, mask, cfg.loss_agg_mode, config, weights
            )
        out: dict[str, torch.Tensor | float] = {
            "actor/pg_loss": pg_loss.detach(),
            "actor/pg_clipfrac": 0.0,
            "actor/pg_clipfrac_lower": 0.0,
            **pg_metrics,
        }
        policy_loss = pg_loss
        if entropy is not None:
            entropy_loss = agg_loss(entropy, mask, cfg.loss_agg_mode, **agg)
            policy_loss = policy_loss - entropy_coeff * entropy_loss
        if cfg.use_kl_loss:
            kld = kl_penalty(log_prob, inputs.row("ref_log_prob"), cfg.kl_loss_type)
            kl_loss = agg_loss(kld, mask, cfg.loss_agg_mode, **agg)
            policy_loss = policy_loss + float(cfg.kl_loss_coef) * kl_loss
            out["actor/kl_loss"] = kl_loss.detach()
            out["actor/kl_coef"] = float(cfg.kl_loss_coef)
        if self.router_loss is not None:
            # This micro-batch's share of the mini-batch, by response tokens, as the policy loss's.
            assert isinstance(inputs, HostInputs)
            mb = inputs.batch
            coef, top_k = self.router_loss
            tokens = self.forwards.token_mask(mb)  # with SP: this rank's real tokens of the stream
            balance = load_balancing_loss(router_logits, top_k, tokens, self.forwards.sp)
            share = float(mb["response_mask"].sum()) / float(agg.get("batch_num_tokens", 1.0))
            policy_loss = policy_loss + coef * share * balance
            out["actor/load_balancing_loss"] = balance.detach()
            out["actor/load_balancing_coef"] = coef
        self.forwards.backward(policy_loss)
        return out

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What the rollout engine needs after an update, under Hugging Face names, for
        `RolloutEngine.update_weights`: the policy's whole weights (under FSDP all-gathered one at a
        time: every rank consumes them all) or, with LoRA, only the adapted modules' merged weights
        W + scale·B·A (the frozen rest never changes)."""
        if self.adapters is not None:
            return self.adapters.merged_weights()
        return full_named_tensors(self.model)
