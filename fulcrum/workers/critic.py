"""The critic worker: HF backbone + scalar value head, `compute_values` and the clipped value update.

Its sizes (`critic.ppo_mini_batch_size`, `ppo_micro_batch_size_per_gpu`, `forward_micro_batch_size_per_gpu`,
`ppo_epochs`, token budgets) are independent of the actor's; null ones follow the actor as in verl,
resolved in its `CriticSection` (fulcrum.config.sections).
"""

from __future__ import annotations

from typing import Any

import torch

from fulcrum.algo.losses import compute_value_loss
from fulcrum.batch import Batch
from fulcrum.config.sections import CriticSection
from fulcrum.models.load import load_backbone
from fulcrum.models.lora import Adapters, LoraSettings
from fulcrum.models.value_head import CriticModel
from fulcrum.workers.forwards import ModelForwards, ValueHead
from fulcrum.workers.micro_batch import MicroInputs
from fulcrum.workers.optim import build_lr_scheduler, build_optimizer
from fulcrum.workers.placement import place_on_ranks
from fulcrum.workers.state_parking import OptimizerStateParking
from fulcrum.workers.update import Metrics, Step, UpdatePlan, ppo_update


class CriticWorker:
    def __init__(
        self, section: CriticSection, device: torch.device, total_training_steps: int, tokenizer: Any = None
    ) -> None:
        c = section.critic
        self.cfg = c
        self.device = device
        self.tokenizer = tokenizer
        lora = LoraSettings.of(c.model, "critic.model")
        backbone = load_backbone(
            c.model.path, device, "critic.model.path", lora.base_dtype(device), c.model.override_config
        )
        # LoRA on the backbone; the value head (made after) trains whole.
        self.adapters = Adapters(backbone, lora, c.model.path) if lora.enabled else None
        self.model = CriticModel(backbone)
        if c.model.enable_gradient_checkpointing:
            self.model.gradient_checkpointing_enable({"use_reentrant": False})
        self.model.train()
        self.placement = place_on_ranks(  # sharded: the value head a float32 unit of its own
            self.model, device, c.model.fsdp_config, "critic.model", keep_fp32=("score",)
        )
        # The value head stays float32 (keep): values are not rounded to bf16.
        self.forwards = ModelForwards(
            self.model,
            device,
            bool(c.model.use_remove_padding),
            "critic",
            keep=("score",),
            use_torch_compile=section.use_torch_compile,
            sp_size=int(c.ulysses_sequence_parallel_size),
            sp_key="critic.ulysses_sequence_parallel_size",
            cuda_graphs=bool(c.cuda_graphs),
            cpp_wrapper=section.inductor_cpp_wrapper,
        )
        self.optimizer = build_optimizer(self.model.parameters(), c.optim, device)
        self.parking: OptimizerStateParking | None = None  # set by a trainer that updates several models
        self.lr_scheduler = build_lr_scheduler(self.optimizer, c.optim, total_training_steps, "critic.optim")
        assert c.ppo_epochs is not None and c.loss_agg_mode is not None, "a resolved configuration"
        self.loss_agg_mode = c.loss_agg_mode
        self.ppo_epochs = c.ppo_epochs
        self.values_sizes = section.values
        self.plan = UpdatePlan(
            role="critic",
            ppo_epochs=self.ppo_epochs,
            mini_batch_size=section.mini_batch_size,
            micro_batch_size=section.micro_batch_size,
            use_dynamic_bsz=bool(c.use_dynamic_bsz),
            max_token_len=c.ppo_max_token_len_per_gpu,
            micro_batch_key="critic.ppo_micro_batch_size_per_gpu",
            grad_clip=float(c.grad_clip),
            seed=section.seed,
        )

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """V(s_t) for every response position (B, R), float32 on the CPU, zero outside the response mask."""
        return self.forwards.no_grad_pass(batch, self.values_sizes, ValueHead())[0]

    def update_critic(self, batch: Batch, global_step: int = 0) -> dict[str, float]:
        """One update (fulcrum.workers.update.ppo_update) of the clipped value loss; needs values, returns."""
        return ppo_update(self, batch, global_step, Step(["values", "returns"]))[0]

    def fwd_bwd(self, inputs: MicroInputs) -> tuple[Metrics, tuple[torch.Tensor, ...]]:
        """The micro-batch's forward, clipped value loss (its share of the mini-batch loss) and backward,
        from its inputs alone; its detached metrics."""
        mask = inputs.rows["response_mask"].float()
        (vpreds,) = self.forwards.forward(inputs, ValueHead())
        vf_loss, vf_clipfrac = compute_value_loss(
            vpreds=vpreds,
            values=inputs.rows["values"],
            returns=inputs.rows["returns"],
            response_mask=mask,
            cliprange_value=float(self.cfg.cliprange_value),
            loss_agg_mode=self.loss_agg_mode,
            **inputs.agg,  # type: ignore[arg-type]
        )
        self.forwards.backward(vf_loss)
        metrics: Metrics = {
            "critic/vf_loss": vf_loss.detach(),
            "critic/vf_clipfrac": vf_clipfrac,
            "critic/vpred_mean": (vpreds.detach() * mask).sum() / mask.sum().clamp(min=1),
        }
        return metrics, ()
